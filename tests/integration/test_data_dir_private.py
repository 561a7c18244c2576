"""What wakeful keeps in its data directory (the database, the vault and its key, the ledger's signing key, the
deployment CA) cannot be read by another OS user, such as the one an agent with a shell runs as (docs/security.md).

The tests run as root and read as `nobody` with setpriv; the data directory sits in a directory anyone may enter,
and a control file beside it shows that `nobody` can read what is left open."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SETPRIV = shutil.which("setpriv")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                                reason="needs root and setpriv (util-linux) to read as another user")
WAKEFUL = str(Path(sys.executable).with_name("wakeful"))
SECRETS = ["wakeful.db", "vault.key", "ledger.key", "proxy/ca.key.enc", "proxy/ca.pem"]


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    assert SETPRIV
    return subprocess.run([SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30)


def _wakeful(*argv: str) -> None:
    """A command run as the operator would under a permissive umask (022), so nothing depends on the caller's."""
    result = subprocess.run([WAKEFUL, *argv], capture_output=True, text=True, timeout=120,
                            preexec_fn=lambda: os.umask(0o022), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def open_parent() -> Iterator[Path]:
    parent = Path(tempfile.mkdtemp(prefix="wakeful-private-", dir="/tmp"))
    parent.chmod(0o755)
    control = parent / "open.txt"
    control.write_text("anyone may read this")
    control.chmod(0o644)
    try:
        yield parent
    finally:
        shutil.rmtree(parent)


def _populate(data_dir: Path) -> None:
    _wakeful("token", "--data-dir", str(data_dir))  # creates the directory and the database
    _wakeful("ledger", "key", "--data-dir", str(data_dir))  # the ledger's signing key
    _wakeful("proxy", "ca", "--data-dir", str(data_dir))  # the vault key and the deployment CA


def test_another_user_can_read_nothing_wakeful_keeps_in_the_data_directory_it_creates(open_parent: Path) -> None:
    assert _as_nobody("cat", str(open_parent / "open.txt")).stdout == "anyone may read this"  # the probe reads
    data_dir = open_parent / "data"
    _populate(data_dir)
    listing = _as_nobody("ls", str(data_dir))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr
    for name in SECRETS:
        assert (data_dir / name).is_file(), name
        read = _as_nobody("cat", str(data_dir / name))
        assert read.returncode != 0 and "Permission denied" in read.stderr, name


def test_the_data_directory_is_0700_and_every_file_wakeful_writes_in_it_0600(open_parent: Path) -> None:
    data_dir = open_parent / "data"
    _populate(data_dir)
    assert data_dir.stat().st_mode & 0o777 == 0o700
    for path in data_dir.rglob("*"):
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), f"{path.relative_to(data_dir)} is {mode:o}"


def test_in_a_data_directory_made_open_beforehand_the_secrets_are_still_owner_only(open_parent: Path) -> None:
    """An operator who made the directory with a plain `mkdir` (0755): wakeful's own files are still 0600."""
    data_dir = open_parent / "data"
    data_dir.mkdir()
    data_dir.chmod(0o755)
    _populate(data_dir)
    for name in SECRETS:
        read = _as_nobody("cat", str(data_dir / name))
        assert read.returncode != 0 and "Permission denied" in read.stderr, name


def test_a_database_directory_the_engine_creates_itself_is_owner_only(open_parent: Path) -> None:
    """A process that opens its engine without the CLI's data-directory step (a new command, a test) still makes
    the SQLite file's directory 0700, whatever the umask."""
    from wakeful.server.store.db import make_engine

    old = os.umask(0o022)
    try:
        engine = make_engine(f"sqlite:///{open_parent / 'fresh' / 'wakeful.db'}")
        engine.dispose()
    finally:
        os.umask(old)
    assert (open_parent / "fresh").stat().st_mode & 0o777 == 0o700
