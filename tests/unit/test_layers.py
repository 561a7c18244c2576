"""The rooms of `wakeful.server` import only from the rooms below them; `proxy` is the lowest package, `vm` may import
it, and neither imports the server.

The table is the one in `server/__init__.py`'s docstring; imports under `if TYPE_CHECKING:` count too (a type
that crosses a layer upward is a design smell even when it costs nothing at run time).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SHARED = {"errors", "settings"}
SELF_CONTAINED = {"sims"}  # stand-ins for the outside world: not even the shared modules
CLOCK = "wakeful.proxy.clock"
"""The one clock: every room may import it (it lives in the lowest package)."""
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "settings": set(),
    "sims": set(),
    "store": set(),
    "observe": {"store", "vm"},  # health, metrics, logs: every room above may report to it (vm: to ask libvirt)
    "audit": {"store"},
    "core": {"store", "observe"},
    "memory": {"store"},  # knowledge: informs plans, never authorizes (no room of an authorization path imports it)
    # the proxy's contract only: a connector request is an `EgressRequest`
    "acting": {"store", "observe", "core", "proxy"},
    "computers": {"store", "observe", "vm"},
    "egress": {"store", "observe", "core", "acting", "computers", "vm", "proxy"},
    "tools": {"store", "observe", "memory", "core", "acting", "computers", "egress", "vm"},
    "harness": {"store", "observe", "memory", "core", "acting", "computers", "egress", "tools", "vm"},
    "runtime": {"store", "observe", "audit", "memory", "core", "acting", "computers", "egress", "tools", "harness",
                "vm", "proxy"},
    "evals": {"store", "observe", "audit", "memory", "core", "acting", "computers", "egress", "tools", "harness",
              "runtime", "vm", "proxy", "sims"},
    "faces": {"store", "observe", "audit", "memory", "core", "acting", "computers", "egress", "tools", "harness",
              "runtime", "evals", "vm", "proxy", "sims"},
}


def _room(module: str) -> str:
    """`wakeful.server.core.worker` → `core`; `wakeful.vm.x` → `vm`; the server's front door is `server`."""
    parts = module.split(".")
    if parts[1] != "server":
        return parts[1]
    return parts[2] if len(parts) > 2 else "server"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("wakeful."):
            if node.module == "wakeful.server":  # the front door, or a room named as a module
                found |= {f"wakeful.server.{alias.name}" for alias in node.names}
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("wakeful.")}
    return found


def _modules(top: str) -> list[Path]:
    return sorted(p for p in (ROOT / top).rglob("*.py") if "migrations" not in p.parts)


def _room_of(path: Path) -> str:
    rel = path.relative_to(ROOT / "server").parts
    return rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")


@pytest.mark.parametrize("path", _modules("server"), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_server_module_imports_only_from_the_rooms_below_its_own(path: Path) -> None:
    room = _room_of(path)
    if room in {"__init__", "__main__"}:
        return
    allowed = ALLOWED[room] | {room} | (set() if room in SELF_CONTAINED else SHARED)
    upward = sorted(m for m in _imports(path) if _room(m) not in allowed and m != CLOCK)
    assert not upward, f"{path.relative_to(ROOT)} ({room}) imports from a room above it: {upward}"


@pytest.mark.parametrize(("top", "may_import"), [("vm", {"vm", "proxy"}), ("proxy", {"proxy"})])
def test_the_proxy_imports_only_itself_and_the_vm_only_itself_and_the_proxy(top: str, may_import: set[str]) -> None:
    offending = {str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if _room(m) not in may_import)
                 for p in _modules(top)}
    assert not {k: v for k, v in offending.items() if v}


def test_the_clock_is_declared_once_in_the_proxy() -> None:
    # The simulators keep their own simulated time: they stand in for other systems and import nothing of ours.
    declared = sorted(str(p.relative_to(ROOT)) for top in ("server", "vm", "proxy") for p in _modules(top)
                      if "sims" not in p.parts
                      and any(isinstance(node, ast.ClassDef) and node.name.lstrip("_").endswith("Clock")
                              for node in ast.walk(ast.parse(p.read_text()))))
    assert declared == ["proxy/clock.py"]


def test_every_room_of_the_server_is_in_the_table() -> None:
    rooms = {_room_of(p) for p in _modules("server")} - {"__init__", "__main__"}
    assert rooms == set(ALLOWED)


def test_acting_meets_the_proxy_only_through_its_contract() -> None:
    # The proxy is a leaf below the server; acting builds requests in its typed contract and uses nothing else of it.
    reached = {m for p in (ROOT / "server" / "acting").glob("*.py") for m in _imports(p) if _room(m) == "proxy"}
    assert reached <= {"wakeful.proxy.contract"}, reached
