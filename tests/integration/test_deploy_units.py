"""The systemd units in infra/systemd/ are valid, run as the `wakeful` user in a sandbox, and systemd rates each no
more exposed than docs/deploy.md says; the group `libvirt` goes to the unit of the process that holds the tool
computers, and no unit restarts a refusal."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wakeful.server.computers.remote import RemoteComputers
from wakeful.server.faces.supervise import REFUSED
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Role, Runtime
from wakeful.server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "infra" / "systemd"
SERVICES = sorted(UNITS.glob("*.service"))
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is missing (Debian's `systemd` package; "
                                                            "scripts/install --all installs it)")
SCORE_ROW = re.compile(r"^\| `([\w@.-]+\.service)` \| ([\d.]+) \|", re.M)
UNIT_ROW = re.compile(r"^\| `([\w@.-]+\.service)` \|(.*)$", re.M)


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


def _command(unit: Path) -> str:
    """The wakeful command a service runs (`api`, `worker`, `proxy`)."""
    return _directives(unit)["ExecStart"][0].split()[1]


def _holds_computers(command: str, data_dir: Path) -> bool:
    """Whether the process `wakeful <command>` starts holds the tool computers itself, as its runtime decides with
    computers = true (the worker's reach the API's over a socket; the proxy has no runtime)."""
    if command not in {role.value for role in Role}:
        return False
    settings = Settings(data_dir=data_dir, computers=True, computer_fakes=True)
    runtime = Runtime(settings, handler=EchoHandler(), role=Role(command))
    try:
        return runtime.computers is not None and not isinstance(runtime.computers, RemoteComputers)
    finally:
        runtime.engine.dispose()


def _doc_rows(text: str) -> dict[str, list[str]]:
    """Each unit's rows in the doc's tables (the units table, then the exposure table)."""
    rows: dict[str, list[str]] = {}
    for name, rest in UNIT_ROW.findall(text):
        rows.setdefault(name, []).append(rest)
    return rows


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


def test_the_unit_of_the_process_that_holds_the_tool_computers_is_the_only_one_in_the_group_libvirt(
        tmp_path: Path) -> None:
    """The regression: the API came to hold the computers while the worker's unit kept the group `libvirt`, the JIT
    Playwright needs and the user IDs PrivateUsers would hide, and the API's unit was without them."""
    holders = [unit.name for unit in SERVICES if _holds_computers(_command(unit), tmp_path / unit.stem)]
    assert holders == ["wakeful-api.service"]
    for unit in SERVICES:
        d = _directives(unit)
        if unit.name in holders:
            assert d["SupplementaryGroups"] == ["libvirt"], unit.name
            assert "libvirtd.service" in d["After"][0].split(), unit.name
            # Playwright's driver is Node.js (a JIT); PrivateUsers would hide the group libvirt.
            assert "MemoryDenyWriteExecute" not in d and "PrivateUsers" not in d, unit.name
        else:
            assert "SupplementaryGroups" not in d, unit.name
            assert d["MemoryDenyWriteExecute"] == ["yes"] and d["PrivateUsers"] == ["yes"], unit.name


def test_the_deploy_doc_gives_the_group_libvirt_to_the_process_that_holds_the_tool_computers(tmp_path: Path) -> None:
    rows = _doc_rows((ROOT / "docs" / "deploy.md").read_text())
    for unit in SERVICES:
        holds = _holds_computers(_command(unit), tmp_path / unit.stem)
        assert len(rows[unit.name]) == 2, f"docs/deploy.md has not both rows (units, exposure) for {unit.name}"
        for row in rows[unit.name]:
            assert ("group `libvirt`" in row) == holds, f"{unit.name}: {row}"


@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_no_service_restarts_a_refusal(unit: Path) -> None:
    """`wakeful` exits 2 when it refuses to run (a setting, a second worker on SQLite, no decider to wait for): a
    restart every 2 s would refuse again, for ever. `wakeful serve` does not restart such a child either."""
    d = _directives(unit)
    assert d["Restart"] == ["on-failure"]
    assert d["RestartPreventExitStatus"] == [str(REFUSED)]
    assert "RestartPreventExitStatus=2" in (ROOT / "docs" / "deploy.md").read_text()


@needs_analyze
def test_the_deploy_docs_drop_in_for_a_host_without_tool_computers_confines_the_api_as_the_proxy(
        tmp_path: Path) -> None:
    assert ANALYZE
    text = (ROOT / "docs" / "deploy.md").read_text()
    drop_in = re.search(r"`systemctl edit wakeful-api\.service`\).*?```ini\n(.*?)```", text, re.S)
    assert drop_in, "docs/deploy.md no longer shows the API's drop-in for a host without tool computers"
    root = tmp_path / "root"
    shutil.copytree(UNITS, root / "etc" / "systemd" / "system")
    (root / "etc" / "systemd" / "system" / "wakeful-api.service.d").mkdir()
    (root / "etc" / "systemd" / "system" / "wakeful-api.service.d" / "override.conf").write_text(drop_in.group(1))
    result = subprocess.run([ANALYZE, "security", "--offline=true", f"--root={root}", "wakeful-api.service"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "Service has no supplementary groups" in result.stdout, result.stdout + result.stderr
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert score, result.stdout + result.stderr
    assert float(score.group(1)) <= _documented_exposure()["wakeful-proxy.service"]
