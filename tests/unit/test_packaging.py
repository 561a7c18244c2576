"""pyproject.toml describes the package the code is: every package named, every imported library declared.

The wheel itself is built and installed in `tests/integration/test_package.py`; these checks are the fast half.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
RUNTIME_CODE = ("server", "vm", "proxy")
NOT_FOR_RUNTIME = {"dev"}  # the development tools' extra: runtime code may not lean on it


def _normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them: `SQLAlchemy` and `sqlalchemy`, `mcp_types` and `mcp-types`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> set[str]:
    """Every distribution named in the dependencies or in an extra a user may install."""
    requirements = list(PYPROJECT["project"]["dependencies"])
    for extra, listed in PYPROJECT["project"].get("optional-dependencies", {}).items():
        if extra not in NOT_FOR_RUNTIME:
            requirements += listed
    names = set()
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        assert match, requirement
        names.add(_normalized(match.group(1)))
    return names


def _imported_top_level_names() -> dict[str, set[str]]:
    """Top-level module name → the files importing it, for every absolute import in the runtime code (including
    imports inside functions and under `TYPE_CHECKING`)."""
    found: dict[str, set[str]] = {}
    for top in RUNTIME_CODE:
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.partition(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_imported_third_party_module_is_a_declared_dependency() -> None:
    declared, distributions = _declared(), packages_distributions()
    missing = {}
    for module, importers in _imported_top_level_names().items():
        if module in sys.stdlib_module_names or module == "wakeful":
            continue
        provided_by = {_normalized(d) for d in distributions.get(module, [])}
        if not provided_by & declared:
            missing[module] = (sorted(provided_by) or ["no installed distribution"], sorted(importers))
    assert not missing, f"imported but not declared in pyproject.toml (module: (distributions, importers)): {missing}"


def test_the_dependency_check_would_catch_a_module_that_arrives_only_transitively() -> None:
    """The check above is only worth something if a transitive-only module is really missing from the declaration:
    `sniffio` comes with httpx and anyio but is named nowhere in pyproject.toml."""
    assert "sniffio" not in _declared()
    assert {_normalized(d) for d in packages_distributions()["sniffio"]} == {"sniffio"}


def _package_dirs() -> dict[str, Path]:
    """Every folder setuptools should ship as a package: a mapped root and each folder below it with an
    `__init__.py`, by its installed name."""
    found = {}
    for name, folder in SETUPTOOLS["package-dir"].items():
        root = ROOT / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root).parts
            found[".".join((name, *relative))] = init.parent
    return found


def test_the_package_list_names_every_package_of_the_tree_and_nothing_else() -> None:
    assert sorted(SETUPTOOLS["packages"]) == sorted(_package_dirs())


def test_the_only_top_level_import_name_is_wakeful() -> None:
    assert {name.partition(".")[0] for name in SETUPTOOLS["packages"]} == {"wakeful"}
    assert {name.partition(".")[0] for name in SETUPTOOLS["package-dir"]} == {"wakeful"}


def test_the_command_line_leaves_the_web_stack_and_the_simulators_to_the_commands_that_use_them() -> None:
    """Every `wakeful` process imports the command line (the egress proxy child too, on every `wakeful serve`):
    what only `serve`, `sim` or `eval` need is imported when they run, not on each start."""
    heavy = ("fastapi", "mcp", "wakeful.server.evals", "wakeful.server.sims", "wakeful.server.faces.http",
             "wakeful.server.audit", "wakeful.server.faces.cli_ledger")
    probe = f"import sys, wakeful.server.faces.cli; print(sorted(m for m in sys.modules if m.startswith({heavy!r})))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    assert loaded == "[]"
