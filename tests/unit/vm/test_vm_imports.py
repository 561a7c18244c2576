"""Only the three adapters load their libraries: every other module of `vm/` (fakes included) imports none of
Playwright, paramiko or libvirt, so the fakes and the rules run where those are missing or broken."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ADAPTERS = {
    "wakeful.vm.cdp_browser": "playwright",
    "wakeful.vm.ssh_channel": "paramiko",
    "wakeful.vm.host_tunnel": "paramiko",  # the tunnel to another KVM host (SSH too)
    "wakeful.vm.libvirt_adapter": "libvirt",
}
LIBRARIES = sorted(set(ADAPTERS.values()))


def _vm_modules() -> list[str]:
    """Every module under `vm/`, named as installed (`vm/image/build.py` → `wakeful.vm.image.build`)."""
    names = []
    for path in sorted((ROOT / "vm").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(("wakeful", *(parts[:-1] if parts[-1] == "__init__" else parts))))
    return names


def _libraries_loaded_by(modules: list[str]) -> list[str]:
    """Import `modules` in a fresh interpreter; which of the three libraries are in its `sys.modules` after."""
    code = (f"import importlib, json, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"print(json.dumps(sorted(lib for lib in {LIBRARIES!r} if lib in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_every_vm_module_but_the_adapters_imports_no_playwright_paramiko_or_libvirt() -> None:
    modules = [m for m in _vm_modules() if m not in ADAPTERS]
    assert {"wakeful.vm.fake_browser", "wakeful.vm.fake_guest", "wakeful.vm.toolcomputer",
            "wakeful.vm.image.build"} <= set(modules)
    assert _libraries_loaded_by(modules) == []


@pytest.mark.parametrize(("adapter", "library"), sorted(ADAPTERS.items()))
def test_each_adapter_is_a_vm_module_and_loads_its_library(adapter: str, library: str) -> None:
    assert adapter in _vm_modules()
    assert _libraries_loaded_by([adapter]) == [library]
