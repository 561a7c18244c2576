"""`wakeful serve` as a supervisor: it starts `wakeful api`, `wakeful worker` and `wakeful proxy` as its children on
one data directory and keeps them running.

- Each child is its own process (`python -m wakeful.server <name>`, with serve's resolved settings), in a session of
  its own so that a Ctrl-C reaches serve alone and the children stop in order; its PID is in the log and in
  `<data_dir>/run/<name>.pid`. On Linux the kernel kills a child when serve dies, even by SIGKILL
  (`PR_SET_PDEATHSIG`, set from serve's main thread, which spawns them all): no child outlives it.
- A child that exits is started again after a backoff (0.5 s, doubling to 30 s; back to 0.5 s once a child ran a
  minute), said in the log with its exit code or signal. Everything a child needs is in the database, so a restarted
  one resumes from it. Two exits are not restarts: exit 2 is a refusal (a setting, a taken port) that a restart
  would only repeat, so serve stops and exits 2; and when crash points are armed (`crash_at`, the crash tests), a
  child that died at one takes serve down with the same code, as a crash of the whole deployment.
- Serve writes the decider channel's token (`<data_dir>/run/decider.token`) before it starts the API (which answers
  on that channel) and the proxy (which asks it about every request), so both start at once and either can restart
  alone; the API listens only once the proxy does (`--await-proxy`), so that the first connector call finds it.
- SIGTERM or SIGINT stops them in order, each with SIGTERM (SIGKILL after a grace): the API first (it drains: the
  requests in flight are answered, acknowledged deliveries are committed), then the worker, then the proxy; serve
  exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from wakeful.server.core import faults
from wakeful.server.egress.proxyctl import TOKEN_FILE, new_decider_token
from wakeful.server.settings import Settings, child_environment

__all__ = ["BACKOFF", "Supervisor"]

log = logging.getLogger("wakeful.serve")

BACKOFF = (0.5, 30.0)
"""First and longest wait before a child that exited is started again."""
STEADY = 60.0
"""A child that ran this long before it exited starts again after the shortest wait."""
GRACE = {"api": 20.0, "worker": 40.0, "proxy": 10.0}
"""Seconds each child has to stop after SIGTERM before it is killed (the api has its `drain_seconds` on top)."""
REFUSED = 2


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _how(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _listening(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        return True
    return False


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff: float = BACKOFF[0]
    due: float | None = None
    """When to start it (again); None while it runs or is not wanted yet."""
    pidfd: int | None = None
    listening: bool = False
    """Its port answers (the api's, the proxy's; the worker listens on none)."""


class Supervisor:
    """Runs the children until SIGTERM or SIGINT; `run` returns serve's exit code. Call it from the main thread."""

    def __init__(self, settings: Settings, *, names: tuple[str, ...] = ("api", "worker", "proxy")) -> None:
        self._settings = settings
        self._env = child_environment(settings)
        self._children = {name: _Child(name) for name in names}
        self._run_dir = settings.data_dir / "run"
        self._signal_r, self._signal_w = os.pipe()
        self._stopping = False
        self._terminating: _Child | None = None
        """The child being stopped (a second SIGTERM or SIGINT to serve is passed on to it)."""

    # -- the loop ----------------------------------------------------------------------------------------------------

    def run(self) -> int:
        os.set_blocking(self._signal_w, False)
        signal.set_wakeup_fd(self._signal_w)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._asked_to_stop)
        try:
            if "proxy" in self._children:
                new_decider_token(self._settings)
            for child in self._children.values():
                child.due = 0.0
            return self._loop()
        finally:
            signal.set_wakeup_fd(-1)
            self._stop_all()

    def _asked_to_stop(self, signum: int, _frame: object) -> None:
        if not self._stopping:
            log.info("%s: stopping the api, then the worker, then the proxy", signal.Signals(signum).name)
        elif self._terminating is not None and self._terminating.proc is not None:
            # A second signal while a child stops is passed on: the api draining (drain_seconds) stops now.
            with contextlib.suppress(ProcessLookupError):
                self._terminating.proc.send_signal(signal.SIGTERM)
        self._stopping = True

    def _loop(self) -> int:
        while not self._stopping:
            now = time.monotonic()
            for child in self._children.values():
                if child.due is not None and child.due <= now:
                    self._spawn(child)
            self._look_for_ports()
            timeout = self._next_timeout()
            fds = [c.pidfd for c in self._children.values() if c.pidfd is not None]
            ready, _, _ = select.select([self._signal_r, *fds], [], [], timeout)
            if self._signal_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._signal_r, 512)
            for child in self._children.values():
                code = child.proc.poll() if child.proc is not None else None
                if code is not None and not self._stopping:
                    if (exit_code := self._exited(child, code)) is not None:
                        return exit_code
        return 0

    def _address(self, child: _Child) -> tuple[str, int] | None:
        if child.name == "api":
            return self._settings.host, self._settings.port
        if child.name == "proxy":
            return "127.0.0.1", self._settings.proxy_port
        return None

    def _starting(self) -> list[_Child]:
        """Children started whose port does not answer yet."""
        return [c for c in self._children.values()
                if c.proc is not None and not c.listening and self._address(c) is not None]

    def _look_for_ports(self) -> None:
        """Mark the children whose port now answers (the proxy's is said in the log)."""
        for child in self._starting():
            address = self._address(child)
            assert address is not None and child.proc is not None
            if not _listening(*address):
                continue
            child.listening = True
            if child.name == "proxy":
                log.info("egress proxy listening on 127.0.0.1:%d (pid %d)", address[1], child.proc.pid)

    def _next_timeout(self) -> float | None:
        waits = [c.due - time.monotonic() for c in self._children.values() if c.due is not None]
        if self._starting():
            waits.append(0.05)  # a child is starting: look for its port (bounded by its start, not a poll of work)
        if not hasattr(os, "pidfd_open") and any(c.proc is not None for c in self._children.values()):
            waits.append(0.5)  # no pidfds (not Linux): look for exits twice a second
        return max(0.0, min(waits)) if waits else None

    def _exited(self, child: _Child, code: int) -> int | None:
        """A child ended on its own: schedule its restart, or return the code serve exits with."""
        assert child.proc is not None
        pid = child.proc.pid
        self._forget(child)
        if code == REFUSED:
            log.error("%s (pid %d) refused to run (exit 2; its reason is above): stopping", child.name, pid)
            return REFUSED
        if code == faults.EXIT_CODE and self._settings.crash_at:
            log.error("%s (pid %d) died at a crash point: serve goes down with it (crash_at is set)", child.name, pid)
            self._kill_all()
            return faults.EXIT_CODE
        ran = time.monotonic() - child.started
        if ran >= STEADY:
            child.backoff = BACKOFF[0]
        log.error("%s (pid %d) %s; restarting it in %.1f s", child.name, pid, _how(code), child.backoff)
        child.due = time.monotonic() + child.backoff
        child.backoff = min(child.backoff * 2, BACKOFF[1])
        return None

    # -- children ----------------------------------------------------------------------------------------------------

    def _spawn(self, child: _Child) -> None:
        child.due = None
        child.started = time.monotonic()
        argv = [sys.executable, "-m", "wakeful.server", child.name]
        if child.name == "api" and "proxy" in self._children:
            argv.append("--await-proxy")
        child.proc = subprocess.Popen(argv, env=self._env,
                                      stdin=subprocess.DEVNULL, start_new_session=True,
                                      preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(ProcessLookupError):
                child.pidfd = os.pidfd_open(child.proc.pid)
        self._run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._pid_file(child).write_text(f"{child.proc.pid}\n")
        log.info("started %s (pid %d)", child.name, child.proc.pid)

    def _pid_file(self, child: _Child) -> Path:
        return self._run_dir / f"{child.name}.pid"

    def _forget(self, child: _Child) -> None:
        if child.pidfd is not None:
            os.close(child.pidfd)
        child.pidfd, child.proc, child.listening = None, None, False
        with contextlib.suppress(FileNotFoundError):
            self._pid_file(child).unlink()

    def _terminate(self, child: _Child) -> None:
        proc = child.proc
        if proc is None or proc.poll() is not None:
            return
        grace = GRACE.get(child.name, 20.0) + (self._settings.drain_seconds if child.name == "api" else 0.0)
        self._terminating = child
        try:
            proc.send_signal(signal.SIGTERM)  # by its PID, never a name
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not stop within %g s: killing it", child.name, proc.pid, grace)
            proc.kill()
            proc.wait()
        finally:
            self._terminating = None

    def _kill_all(self) -> None:
        for child in self._children.values():
            if child.proc is not None and child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
            if child.proc is not None:
                self._forget(child)

    def _stop_all(self) -> None:
        for name in ("api", "worker", "proxy"):
            child = self._children.get(name)
            if child is None or child.proc is None:
                continue
            self._terminate(child)
            code = child.proc.returncode
            log.info("%s (pid %d) stopped (%s)", name, child.proc.pid, "SIGTERM" if code == -signal.SIGTERM
                     else _how(code).removeprefix("exited with "))
            self._forget(child)
        with contextlib.suppress(FileNotFoundError):
            (self._settings.decider_socket.parent / TOKEN_FILE).unlink()
