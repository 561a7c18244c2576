"""A throwaway PostgreSQL server on loopback for the tests that must hold on PostgreSQL too.

One cluster per test session, in a temporary folder, listening on 127.0.0.1 only, with trust authentication (it is
reachable from this machine alone and holds nothing but test data); each test gets a database of its own, a copy of
one migrated once per session (`CREATE DATABASE … TEMPLATE`: migrating every test's database cost more than most
tests). Run as
root (as CI is), the server runs as the `postgres` user, which refuses nothing but root. Where PostgreSQL is not
installed (`scripts/install --all` installs it), the tests that need it are skipped and say why.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

__all__ = ["postgres_bin", "postgres_cluster", "postgres_database", "postgres_template"]


def postgres_bin() -> Path | None:
    """The folder of `initdb` and `pg_ctl`: Debian keeps them off PATH, under /usr/lib/postgresql/<major>/bin."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def postgres_cluster(*, durable: bool = False, connections: int = 100) -> Iterator[str]:
    """Start a cluster; yields the URL of its server (without a database), stops and removes it at the end.
    `durable`: fsync on (benchmarks, beside SQLite's `synchronous=FULL`); tests run without it."""
    where = postgres_bin()
    if where is None:
        pytest.skip("PostgreSQL is not installed (scripts/install --all installs it)")
    root = Path(tempfile.mkdtemp(prefix="wakeful-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(root, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", _free_port()
    pg_ctl = [*as_user, str(where / "pg_ctl"), "-D", str(data)]
    try:
        subprocess.run([*as_user, str(where / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                        "-E", "UTF8", *([] if durable else ["--no-sync"])],
                       check=True, capture_output=True, timeout=120)
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c max_connections={connections}"
        subprocess.run([*pg_ctl, "-w", "-t", "60", "-l", str(root / "log"), "-o",
                        options + ("" if durable else " -c fsync=off"), "start"],
                       check=True, capture_output=True, timeout=90)
        try:
            yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
        finally:
            subprocess.run([*pg_ctl, "-w", "-t", "60", "-m", "fast", "stop"], capture_output=True, timeout=90)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def postgres_database(server: str, template: str | None = None) -> str:
    """A new database on `server`, empty or a copy of the database named `template`; returns its URL."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(f"{server.replace('postgresql+psycopg', 'postgresql')}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}" + (f" TEMPLATE {template}" if template else ""))
    return f"{server}/{name}"


def postgres_template(server: str, prepare: Callable[[str], None]) -> str:
    """A database on `server` that `prepare(url)` fills, then marked a template; returns its name, for
    `postgres_database(server, template=name)`. `prepare` must leave no connection to it open (a copy needs none)."""
    url = postgres_database(server)
    prepare(url)
    name = url.rpartition("/")[2]
    with psycopg.connect(f"{server.replace('postgresql+psycopg', 'postgresql')}/postgres", autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {name} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false")
    return name
