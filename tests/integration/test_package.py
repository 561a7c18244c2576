"""The built wheel is a whole product: installed into a fresh virtualenv outside the checkout, `wakeful demo` runs.

The wheel is built by pip from a copy of the sources (a `build/` folder left in the checkout by an earlier build
could otherwise slip stale files into it). The fresh virtualenv has no system site-packages and no checkout on its
path; it takes the wheel's dependencies, read-only, from this test run's own environment through one path entry
(no network needed), and `pip check` confirms they satisfy what the wheel declares. The demo then runs from an
empty folder with a new data directory: the simulator, the connector declarations and the migrations all have to
come from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from wakeful.vm.image.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("server", "vm", "proxy", "policies", "images")  # each ships as wakeful.<name>
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")


def _shipped(top: str) -> list[Path]:
    return sorted(p for p in (ROOT / top).rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def _run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    for top in SOURCES:
        shutil.copytree(ROOT / top, source / top, ignore=shutil.ignore_patterns("__pycache__"))
    for name in PROJECT_FILES:
        shutil.copy2(ROOT / name, source / name)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", work / "dist", source, cwd=work)
    (built,) = (work / "dist").glob("wakeful-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("venv")
    _run(sys.executable, "-m", "venv", "--without-pip", home / "venv", cwd=home)
    python = home / "venv" / "bin" / "python"
    _pip(python, "install", "--quiet", "--no-deps", "--no-index", wheel, cwd=home)
    # The dependencies: this environment's site-packages as a plain path entry, after the venv's own. Its `.pth`
    # files are not run from there, so the editable install of the checkout does not come along.
    site = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=home).stdout.strip()
    (Path(site) / "wakeful-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    yield home / "venv"


def _pip(python: Path, *args: str | Path, cwd: Path, env: dict[str, str] | None = None) -> None:
    """This environment's pip, acting on the fresh virtualenv (which has none of its own: it needs none)."""
    _run(sys.executable, "-m", "pip", "--python", python, *args, cwd=cwd, env=env)


def _clean_env(home: Path) -> dict[str, str]:
    """No WAKEFUL_ settings, no PYTHONPATH, a HOME of its own: nothing from this checkout or this user leaks in."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("WAKEFUL_", "PYTHON", "VIRTUAL_ENV"))}
    return keep | {"HOME": str(home), "XDG_DATA_HOME": str(home / "share")}


def test_the_wheel_has_exactly_one_top_level_import_name_wakeful(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    recorded = [line.split(",")[0] for line in zipfile.ZipFile(wheel).read(record).decode().splitlines() if line]
    assert sorted(recorded) == sorted(names)
    tops = {n.split("/")[0] for n in recorded if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"wakeful"}
    assert "wakeful/__init__.py" not in names  # a namespace: another distribution could share it without clashing


def test_the_wheel_carries_every_file_of_the_code_policies_and_image_recipe_and_the_licence(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"wakeful/{top}/{p.relative_to(ROOT / top).as_posix()}" for top in SOURCES for p in _shipped(top)}
    assert not expected - names, sorted(expected - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_the_installed_image_recipe_is_the_checkout_s_with_its_executable_bits(venv: Path) -> None:
    """The recipe's hashes cover each file's executable bit: equal hashes mean the same recipe, runnable."""
    script = ("import dataclasses, json; from wakeful.vm.image import DEFAULT_RECIPE; "
              "from wakeful.vm.image.recipe import load_recipe; r = load_recipe(DEFAULT_RECIPE); "
              "print(json.dumps({'path': str(r.path), **{k: v for k, v in dataclasses.asdict(r).items() "
              "if k.endswith('_hash')}}))")
    installed = json.loads(_run(venv / "bin" / "python", "-c", script, cwd=venv.parent,
                                env=_clean_env(venv.parent)).stdout)
    assert Path(installed.pop("path")).is_relative_to(venv)
    checkout = load_recipe(ROOT / "images" / "guest")
    assert installed == {k: v for k, v in vars(checkout).items() if k.endswith("_hash")}


def test_the_wheel_s_declared_dependencies_are_met_and_it_imports_from_the_venv(venv: Path) -> None:
    _pip(venv / "bin" / "python", "check", cwd=venv.parent, env=_clean_env(venv.parent))
    script = ("import json, wakeful.server.sims, wakeful.policies, wakeful.images, wakeful.server; "
              "print(json.dumps([m.__file__ for m in (wakeful.server, wakeful.server.sims, wakeful.policies, "
              "wakeful.images)]))")
    files = json.loads(_run(venv / "bin" / "python", "-c", script, cwd=venv.parent,
                            env=_clean_env(venv.parent)).stdout)
    assert all(Path(f).is_relative_to(venv) for f in files), files


def test_wakeful_demo_runs_from_the_wheel_in_a_folder_without_a_checkout(venv: Path,
                                                                           tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = _run(venv / "bin" / "wakeful", "demo", "--data-dir", tmp_path / "data", cwd=elsewhere,
                  env=_clean_env(tmp_path), timeout=120)
    for line in ("approval_required", "persisted before sending", "unknown None ReadTimeout",
                 "reconcile → accepted", "verify → accepted", "completion → accepted",
                 "merchant's own records: 1 cancellation(s) of sub_1; renewal is now off"):
        assert line in result.stdout, line
    assert (tmp_path / "data" / "wakeful.db").is_file()
