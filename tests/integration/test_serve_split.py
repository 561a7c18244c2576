"""`wakeful serve` split into processes: it supervises `wakeful api`, `wakeful worker` and `wakeful proxy`, restarts
a child that died, stops them all on SIGTERM, leaves no orphan when it is killed, and a delivery the API commits
wakes the worker process at once (not at its next poll), on SQLite and on PostgreSQL.

Everything here is a real process, signalled only by its own PID; the records are read from the database."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine, select

from tests.integration.test_cli import WAKEFUL
from tests.support.polling import wait_until
from tests.support.postgres import postgres_database
from tests.support.serve import ServeProcess, free_port
from wakeful.server.core.signatures import sign
from wakeful.server.store.db import make_engine, read
from wakeful.server.store.tables import EventStatus, events

SECRET = "split-secret"
POLL = 60.0
"""The worker's poll, set far above how long a woken run takes: a run that starts sooner was woken."""
CHILDREN = ("api", "worker", "proxy")


def _env(data_dir: Path, *, database_url: str | None = None, proxy: bool = True) -> dict[str, str]:
    env = {
        "WAKEFUL_DATA_DIR": str(data_dir),
        "WAKEFUL_COMPUTERS": "false",  # test_serve_computers_split.py runs them (on fakes)
        "WAKEFUL_PROXY": "true" if proxy else "false",
        "WAKEFUL_PROXY_PORT": str(free_port()),
        "WAKEFUL_ECHO_WITHOUT_MODEL": "true",
        "WAKEFUL_SOURCES__HOOK__KIND": "generic",
        "WAKEFUL_SOURCES__HOOK__SECRET": SECRET,
        "WAKEFUL_POLL_INTERVAL": str(POLL),
        "WAKEFUL_IDLE_POLL_MAX": str(POLL),
        "WAKEFUL_LEASE": "1",
    }
    if database_url:
        env["WAKEFUL_DATABASE_URL"] = database_url
    return env


def _pids(data_dir: Path) -> dict[str, int]:
    found = {}
    for name in CHILDREN:
        try:
            found[name] = int((data_dir / "run" / f"{name}.pid").read_text())
        except (FileNotFoundError, ValueError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _deliver(url: str, delivery_id: str) -> str:
    body = json.dumps({"text": f"delivery {delivery_id}"}).encode()
    headers = {"Content-Type": "application/json",
               **sign("generic", secret=SECRET.encode(), body=body, now=time.time(), delivery_id=delivery_id)}
    answer = httpx.post(f"{url}/v1/hooks/hook", content=body, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    event_id: str = answer.json()["event_id"]
    return event_id


def _status(engine: Engine, event_id: str) -> str:
    with read(engine) as conn:
        status: str = conn.execute(select(events.c.status).where(events.c.id == event_id)).scalar_one()
    return status


def _all_children(data_dir: Path, server: ServeProcess) -> dict[str, int]:
    def running() -> dict[str, int] | None:
        pids = _pids(data_dir)
        return pids if set(pids) == set(CHILDREN) and all(map(_alive, pids.values())) else None

    return wait_until(running, 60, "three children running")


def test_serve_starts_api_worker_and_proxy_and_sigterm_stops_them_all(tmp_path: Path) -> None:
    with ServeProcess(_env(tmp_path), log_path=tmp_path / "serve.log") as server:
        children = _all_children(tmp_path, server)
        assert len(set(children.values()) | {server.pid}) == 4
        assert int((tmp_path / "run" / "serve.pid").read_text()) == server.pid  # what to send SIGTERM to
        code, killed = server.terminate(grace=60)
        assert (code, killed) == (0, False), server.log()
    assert not any(map(_alive, children.values()))
    assert _pids(tmp_path) == {} and not (tmp_path / "run" / "serve.pid").exists()


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_serve_forks_its_children_from_one_interpreter_and_stays_single_threaded(tmp_path: Path) -> None:
    """A (re)start costs serve's one interpreter start and a fork per child, not an interpreter start per child:
    each child's command line is serve's own (a fork, no exec), and serve has one thread (signals and waitpid)."""
    with ServeProcess(_env(tmp_path), log_path=tmp_path / "serve.log") as server:
        children = _all_children(tmp_path, server)
        serve_cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        for name, pid in children.items():
            assert Path(f"/proc/{pid}/cmdline").read_bytes() == serve_cmdline, name
            assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == server.pid, name
        assert _threads(server.pid) == 1
        os.kill(children["worker"], signal.SIGKILL)
        again = wait_until(lambda: (p := _pids(tmp_path).get("worker")) and p != children["worker"] and p, 60,
                           f"a new worker; log:\n{server.log(3000)}")
        assert Path(f"/proc/{again}/cmdline").read_bytes() == serve_cmdline
        assert _threads(server.pid) == 1
        assert server.terminate(grace=60) == (0, False)


def test_a_killed_worker_is_restarted_and_a_delivery_posted_meanwhile_gets_its_run(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'wakeful.db'}")
    with ServeProcess(_env(tmp_path, proxy=False), log_path=tmp_path / "serve.log") as server:
        worker = wait_until(lambda: _pids(tmp_path).get("worker"), 60, "the worker child")
        os.kill(worker, signal.SIGKILL)
        event_id = _deliver(server.url, "while-the-worker-is-dead")
        wait_until(lambda: (p := _pids(tmp_path).get("worker")) and p != worker, 60,
                   f"a new worker; log:\n{server.log(3000)}")
        assert f"worker (pid {worker}) was killed by SIGKILL; restarting it" in server.log()
        wait_until(lambda: _status(engine, event_id) == EventStatus.PROCESSED, POLL / 2,
                   f"the delivery's run; log:\n{server.log(3000)}")
        assert server.terminate(grace=60) == (0, False)


def test_a_killed_serve_leaves_no_child_behind(tmp_path: Path) -> None:
    with ServeProcess(_env(tmp_path), log_path=tmp_path / "serve.log") as server:
        children = _all_children(tmp_path, server)
        server.kill()  # SIGKILL: serve cleans nothing up; the kernel ends its children
    wait_until(lambda: not any(map(_alive, children.values())), 30, f"the children to end: {children}")


def _woken_at_once(tmp_path: Path, database_url: str | None) -> None:
    url = database_url or f"sqlite:///{tmp_path / 'wakeful.db'}"
    with ServeProcess(_env(tmp_path, database_url=database_url, proxy=False),
                      log_path=tmp_path / "serve.log") as server:
        wait_until(lambda: "wakeful worker running" in server.log(), 60, "the worker to run")
        engine = make_engine(url)
        # The worker looked once at its start and next looks POLL seconds later: only a wake-up is sooner.
        event_id = _deliver(server.url, f"wake-{uuid.uuid4().hex[:8]}")
        wait_until(lambda: _status(engine, event_id) == EventStatus.PROCESSED, POLL / 2,
                   f"the run the wake-up starts; log:\n{server.log(3000)}")
        engine.dispose()
        assert server.terminate(grace=60) == (0, False)


def test_a_delivery_wakes_the_worker_process_at_once_on_sqlite(tmp_path: Path) -> None:
    _woken_at_once(tmp_path, None)


def test_a_delivery_wakes_the_worker_processes_at_once_on_postgresql(tmp_path: Path,
                                                                     request: pytest.FixtureRequest) -> None:
    _woken_at_once(tmp_path, postgres_database(request.getfixturevalue("postgres_server")))


def test_a_second_worker_on_one_sqlite_database_is_refused(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}, **_env(tmp_path, proxy=False)}
    first = subprocess.Popen([WAKEFUL, "worker"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=(tmp_path / "first.log").open("wb"))
    try:
        wait_until(lambda: "wakeful worker running" in (tmp_path / "first.log").read_text(), 60, "the first worker")
        second = subprocess.run([WAKEFUL, "worker"], env=env, capture_output=True, text=True, timeout=60,
                                stdin=subprocess.DEVNULL)
        assert second.returncode == 2
        assert f"wakeful: worker_running: another wakeful worker (pid {first.pid})" in second.stderr
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
