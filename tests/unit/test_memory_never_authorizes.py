"""Memory informs, never authorizes (DESIGN principle 6): no module on an authorization path — admission, approvals,
verdicts, policy, leave, the egress dispatch and decider, `core.control`, `core.authority`, `core.widening` and the
egress proxy — nor anything they import inside wakeful, transitively, imports `wakeful.server.memory` or names one of
the memory tables (by the table objects or in SQL text).

Read from the source with ast: a module's imports are its own import statements, and the `__init__` of every package
it imports from (the code Python runs to reach it) — except `wakeful.server`'s own front door, which wires the whole
server for an embedding program and is no part of any decision. Imports under `if TYPE_CHECKING:` count too.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

AUTHORIZATION_PATHS = (
    "wakeful.server.acting.admission", "wakeful.server.acting.approvals", "wakeful.server.acting.verdicts",
    "wakeful.server.acting.policy", "wakeful.server.acting.leave", "wakeful.server.core.control",
    "wakeful.server.core.authority", "wakeful.server.core.widening",
    *sorted(f"wakeful.server.egress.{p.stem}" for p in (ROOT / "server" / "egress").glob("*.py")),
    *sorted(f"wakeful.proxy.{p.stem}" for p in (ROOT / "proxy").glob("*.py")),
)
MEMORY_TABLES = frozenset({"memories", "memory_topics", "memory_links", "memory_uses", "memory_disowned",
                           "memory_changes"})
FRONT_DOOR = "wakeful.server"
DECLARED_IN = "wakeful.server.store.tables"
"""Where every table is declared: naming them there declares them, it reads nothing (its imports are followed)."""
_SQL_NAME = re.compile(r"\b(" + "|".join(sorted(MEMORY_TABLES)) + r")\b")


def _file(module: str) -> Path | None:
    """The source file of a wakeful module (`wakeful.server.core.control` → server/core/control.py)."""
    base = ROOT.joinpath(*module.split(".")[1:])
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_inits(module: str) -> list[str]:
    """The packages Python runs on the way to `module` (the front door of the server excepted)."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p != FRONT_DOOR]


@cache
def _imports(module: str) -> frozenset[str]:
    path = _file(module)
    assert path is not None, module
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from . import x`, `from ..y import x`
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            if not base.startswith("wakeful"):
                continue
            for alias in node.names:  # `from pkg import mod` reaches a module; `from mod import name` the module
                found.add(f"{base}.{alias.name}" if _file(f"{base}.{alias.name}") else base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("wakeful.")}
    return frozenset(m for name in found for m in (name, *_package_inits(name)) if _file(m) and m != FRONT_DOOR)


def reach(start: str) -> set[str]:
    """`start` and every wakeful module it imports, transitively."""
    seen: set[str] = set()
    todo = [start, *_package_inits(start)]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(_imports(module) - seen)
    return seen


@cache
def memory_references(module: str) -> tuple[str, ...]:
    """Where `module` imports the memory package or names a memory table: by name, or in a string of SQL."""
    path = _file(module)
    assert path is not None
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found: list[str] = []
    if module == DECLARED_IN:
        return ()
    if module.startswith("wakeful.server.memory"):
        found.append("is the memory package")
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.alias):
            names = [node.name, node.name.rpartition(".")[2]]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wakeful.server.memory"):
            found.append(f"line {node.lineno}: imports {node.module}")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and _SQL_NAME.search(node.value)):
            found.append(f"line {node.lineno}: SQL text names {_SQL_NAME.findall(node.value)}")
        found += [f"line {getattr(node, 'lineno', '?')}: names {n}" for n in names
                  if n in MEMORY_TABLES or n.startswith("wakeful.server.memory")]
    return tuple(found)


@pytest.mark.parametrize("start", AUTHORIZATION_PATHS)
def test_no_authorization_path_imports_memory_or_reads_its_tables(start: str) -> None:
    offending = {m: refs[:3] for m in sorted(reach(start)) if (refs := memory_references(m))}
    assert not offending, f"{start} reaches memory: {offending}"


def test_the_proof_sees_through_imports_and_would_catch_a_reader_of_memory() -> None:
    # not vacuous: the closure follows imports down to the tables, and the context (which recalls) is caught
    assert {DECLARED_IN, "wakeful.server.core.inbox"} <= reach("wakeful.server.core.control")
    assert "wakeful.proxy.contract" in reach("wakeful.server.egress.dispatch")
    assert any(memory_references(m) for m in reach("wakeful.server.harness.context"))
    assert memory_references("wakeful.server.memory.recall")
    assert len(AUTHORIZATION_PATHS) > 20
