"""infra/setup-host prepares a host as docs/deploy.md says, run here into a scratch tree (`--root`); and the deploy
and security docs show host commands only in blocks the suite does not pretend to run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "infra" / "setup-host"
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="infra/setup-host runs as root and needs useradd (Debian's passwd)")


def _scratch_root(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    for name in ("shadow", "gshadow"):
        (root / "etc" / name).write_text("")
    return root


def _settings_in(env: Path) -> dict[str, str]:
    """What an EnvironmentFile= sets: its KEY=value lines, comments left out."""
    lines = [line for line in env.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return dict(line.split("=", 1) for line in lines)


def _setup(root: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SETUP), "--root", str(root), *extra], capture_output=True, text=True, timeout=120)


def test_setup_host_adds_the_wakeful_user_a_private_data_directory_the_environment_and_the_units(
        tmp_path: Path) -> None:
    root = _scratch_root(tmp_path)
    result = _setup(root)
    assert result.returncode == 0, result.stderr
    entry = next(line.split(":") for line in (root / "etc" / "passwd").read_text().splitlines()
                 if line.startswith("wakeful:"))
    uid, gid, home, shell = int(entry[2]), int(entry[3]), entry[5], entry[6]
    assert (home, shell) == ("/var/lib/wakeful", "/usr/sbin/nologin")
    assert uid < 1000  # a system user
    data = (root / "var" / "lib" / "wakeful").stat()
    assert (data.st_mode & 0o777, data.st_uid, data.st_gid) == (0o700, uid, gid)
    env = root / "etc" / "wakeful" / "wakeful.env"
    assert (env.stat().st_mode & 0o777, env.stat().st_uid, env.stat().st_gid) == (0o640, 0, gid)
    assert "WAKEFUL_DATABASE_URL" not in _settings_in(env)  # SQLite in the data directory (docs/deploy.md)
    installed = sorted(p.name for p in (root / "etc" / "systemd" / "system").iterdir())
    assert installed == sorted(p.name for p in (ROOT / "infra" / "systemd").iterdir())


def test_setup_host_run_again_changes_nothing_and_closes_a_data_directory_left_open(tmp_path: Path) -> None:
    root = _scratch_root(tmp_path)
    assert _setup(root, "--database-url", "sqlite:////var/lib/wakeful/wakeful.db").returncode == 0
    env = root / "etc" / "wakeful" / "wakeful.env"
    env.write_text(env.read_text() + "WAKEFUL_PORT=9000\n")  # the operator's own edit
    (root / "var" / "lib" / "wakeful").chmod(0o755)
    again = _setup(root)
    assert again.returncode == 0, again.stderr
    assert "adding the system user" not in again.stderr
    assert [line.startswith("wakeful:") for line in (root / "etc" / "passwd").read_text().splitlines()].count(True) == 1
    assert env.read_text().endswith("WAKEFUL_DATABASE_URL=sqlite:////var/lib/wakeful/wakeful.db\nWAKEFUL_PORT=9000\n")
    assert (root / "var" / "lib" / "wakeful").stat().st_mode & 0o777 == 0o700


def test_setup_host_refuses_an_option_it_does_not_know(tmp_path: Path) -> None:
    result = _setup(_scratch_root(tmp_path), "--yes")
    assert result.returncode == 2 and "unknown option --yes" in result.stderr


def test_the_deploy_doc_shows_the_setup_command_the_tests_run_and_the_units_it_installs() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    assert "```text\ninfra/setup-host\n```" in text
    for unit in (ROOT / "infra" / "systemd").iterdir():
        assert f"`{unit.name}`" in text, unit.name


def test_setup_host_leaves_the_database_url_out_so_one_host_runs_on_sqlite_without_psycopg(tmp_path: Path) -> None:
    """The regression: it always wrote a PostgreSQL URL, which fails every command without psycopg, while
    docs/deploy.md says one host needs none."""
    root = _scratch_root(tmp_path)
    result = _setup(root)
    assert result.returncode == 0, result.stderr
    assert "WAKEFUL_DATABASE_URL" not in _settings_in(root / "etc" / "wakeful" / "wakeful.env")
    assert "SQLite" in result.stderr
    # PostgreSQL is asked for by name.
    postgres = _scratch_root(tmp_path / "postgres")
    url = "postgresql+psycopg://wakeful@/wakeful?host=/run/postgresql"
    assert _setup(postgres, "--database-url", url).returncode == 0
    assert _settings_in(postgres / "etc" / "wakeful" / "wakeful.env") == {"WAKEFUL_DATABASE_URL": url}


def test_setup_host_says_when_the_group_the_api_unit_joins_is_missing(tmp_path: Path) -> None:
    root = _scratch_root(tmp_path)
    without = _setup(root)
    assert without.returncode == 0 and "no group libvirt" in without.stderr
    with (root / "etc" / "group").open("a") as group:
        group.write("libvirt:x:990:\n")
    assert "no group libvirt" not in _setup(root).stderr


def test_setup_host_help_is_its_header_comment_and_nothing_of_its_code() -> None:
    result = subprocess.run([str(SETUP), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Prepare a Debian 12 host")
    assert "--database-url" in result.stdout and "--root DIR" in result.stdout
    assert "set -euo" not in result.stdout and "#" not in result.stdout


def test_the_deploy_doc_installs_psycopg_where_it_names_a_postgresql_database() -> None:
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text.split("### PostgreSQL", 1)[1].split("\n### ", 1)[0]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "docs/deploy.md's PostgreSQL section no longer shows its commands"
    commands = block.group(1)
    assert "pip install 'psycopg[binary]" in commands
    assert commands.index("pip install 'psycopg") < commands.index("WAKEFUL_DATABASE_URL=postgresql+psycopg")
