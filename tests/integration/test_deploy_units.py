"""The systemd units in infra/systemd/ are valid, run as the `wakeful` user in a sandbox, and systemd rates each no
more exposed than docs/deploy.md says."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "infra" / "systemd"
SERVICES = sorted(UNITS.glob("*.service"))
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is missing (Debian's `systemd` package; "
                                                            "scripts/install --all installs it)")
SCORE_ROW = re.compile(r"^\| `([\w@.-]+\.service)` \| ([\d.]+) \|", re.M)


def _directives(unit: Path) -> dict[str, list[str]]:
    """Every `Key=value` of a unit, values in order (a key may repeat)."""
    found: dict[str, list[str]] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def _documented_exposure() -> dict[str, float]:
    return {name: float(score) for name, score in SCORE_ROW.findall((ROOT / "docs" / "deploy.md").read_text())}


def _fake_root(tmp_path: Path) -> Path:
    """A root holding systemd's own units, the shipped ones and an executable where the docs install wakeful, so
    `verify` checks the units as a host set up by docs/deploy.md would load them."""
    root = tmp_path / "root"
    system = next(p for p in (Path("/lib/systemd/system"), Path("/usr/lib/systemd/system")) if p.is_dir())
    shutil.copytree(system, root / "lib" / "systemd" / "system", symlinks=True)
    shutil.copytree(UNITS, root / "etc" / "systemd" / "system")
    binary = root / "opt" / "wakeful" / ".venv" / "bin" / "wakeful"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return root


def test_the_units_are_the_api_the_proxy_a_worker_template_and_a_target_grouping_them() -> None:
    assert {p.name for p in UNITS.iterdir()} == {"wakeful-api.service", "wakeful-proxy.service",
                                                   "wakeful-worker@.service", "wakeful.target"}
    wants = _directives(UNITS / "wakeful.target")["Wants"][0].split()
    assert sorted(wants) == ["wakeful-api.service", "wakeful-proxy.service"]
    for unit in SERVICES:
        assert _directives(unit)["PartOf"] == ["wakeful.target"], unit.name
        assert _directives(unit)["WantedBy"] == ["wakeful.target"], unit.name


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_each_service_runs_as_wakeful_with_only_its_data_directory_writable(unit: Path) -> None:
    d = _directives(unit)
    assert d["User"] == ["wakeful"] and d["Group"] == ["wakeful"]
    assert d["UMask"] == ["0077"]
    assert d["StateDirectory"] == ["wakeful"] and d["StateDirectoryMode"] == ["0700"]
    assert d["ProtectSystem"] == ["strict"] and d["ReadWritePaths"] == ["/var/lib/wakeful"]
    assert d["Environment"] == ["WAKEFUL_DATA_DIR=/var/lib/wakeful"]
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "PrivateDevices", "RestrictSUIDSGID"):
        assert d[key] == ["yes"], key
    assert d["CapabilityBoundingSet"] == [""] and d["AmbientCapabilities"] == [""]
    assert d["RestrictAddressFamilies"] == ["AF_UNIX AF_INET AF_INET6"]
    assert d["SystemCallFilter"][0] == "@system-service"


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_each_service_starts_a_wakeful_command_the_cli_has(unit: Path) -> None:
    start = _directives(unit)["ExecStart"]
    assert len(start) == 1
    binary, command, *options = start[0].split()
    assert binary == "/opt/wakeful/.venv/bin/wakeful"
    assert command in {"api", "worker", "proxy"}
    wakeful = shutil.which("wakeful", path=str(Path(sys.executable).parent))
    assert wakeful
    # With the unit's options: one the command does not have is refused before `--help` is read.
    result = subprocess.run([wakeful, command, *options, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


@needs_analyze
def test_systemd_analyze_verify_finds_nothing_to_say_about_the_units(tmp_path: Path) -> None:
    """`verify` exits 0 even on an unknown key or a value it ignores: any output at all is a failure here."""
    assert ANALYZE
    root = _fake_root(tmp_path)
    names = [p.name.replace("@.service", "@1.service") for p in SERVICES] + ["wakeful.target"]
    result = subprocess.run([ANALYZE, "verify", f"--root={root}", *names], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


@needs_analyze
def test_systemd_analyze_verify_would_catch_a_mistyped_unit(tmp_path: Path) -> None:
    assert ANALYZE
    root = _fake_root(tmp_path)
    api = root / "etc" / "systemd" / "system" / "wakeful-api.service"
    api.write_text(api.read_text().replace("ProtectSystem=strict", "ProtectSystem=stricter"))
    result = subprocess.run([ANALYZE, "verify", f"--root={root}", "wakeful-api.service"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert "stricter" in result.stdout + result.stderr


@needs_analyze
@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_no_service_is_more_exposed_than_the_deploy_doc_says(unit: Path) -> None:
    assert ANALYZE
    documented = _documented_exposure()
    assert unit.name in documented, f"docs/deploy.md has no exposure row for {unit.name}"
    result = subprocess.run([ANALYZE, "security", "--offline=true", unit.name], capture_output=True, text=True,
                            timeout=120, cwd=UNITS)
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert score, result.stdout + result.stderr
    assert float(score.group(1)) <= documented[unit.name], (
        f"{unit.name}: exposure {score.group(1)} is above the {documented[unit.name]} docs/deploy.md states")
