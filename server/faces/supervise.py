"""`wakeful serve` as a supervisor: it starts `wakeful api`, `wakeful worker` and `wakeful proxy` as its children on
one data directory and keeps them running.

- Each child is a fork of serve, not a new interpreter: serve imports what the children run before it starts any
  (`preload`), and has no thread, engine connection or event loop of its own, so a child (and each restart of one)
  costs a fork; what dislikes a fork (SQLite and PostgreSQL connections, the asyncio loop, the wake-up socket,
  the metrics files) is made in the child. Each runs the `wakeful` command of its name (`api`, `worker`, `proxy`)
  with serve's resolved settings, in a session of its own so that a Ctrl-C reaches serve alone and the children
  stop in order; its PID is in the log and in `<data_dir>/run/<name>.pid`. On Linux the kernel kills a child when
  serve dies, even by SIGKILL (`PR_SET_PDEATHSIG`; serve has one thread, the one that forks them all): no child
  outlives it. Serve itself only waits: for a signal, a child's exit (a pidfd) or a child's port.
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
import gc
import logging
import os
import select
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from wakeful.server.core import faults
from wakeful.server.egress.proxyctl import TOKEN_FILE, new_decider_token
from wakeful.server.settings import RESOLVED_ENV, Settings, child_environment

__all__ = ["BACKOFF", "ChildMain", "Supervisor"]

log = logging.getLogger("wakeful.serve")

BACKOFF = (0.5, 30.0)
"""First and longest wait before a child that exited is started again."""
STEADY = 60.0
"""A child that ran this long before it exited starts again after the shortest wait."""
GRACE = {"api": 20.0, "worker": 40.0, "proxy": 10.0}
"""Seconds each child has to stop after SIGTERM before it is killed (the api has its `drain_seconds` on top)."""
REFUSED = 2

ChildMain = Callable[[list[str]], int]
"""Runs a `wakeful` command line (`["worker"]`, `["api", "--await-proxy"]`) in a child; returns its exit code."""


def _die_with_parent(parent: int) -> None:
    import ctypes

    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # serve died before the line above: nobody would stop this child
        os._exit(1)


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
    pid: int | None = None
    """Set while it runs (and until its exit is collected)."""
    code: int | None = None
    """How it ended, once collected: its exit code, or minus the signal that killed it."""
    started: float = 0.0
    backoff: float = BACKOFF[0]
    due: float | None = None
    """When to start it (again); None while it runs or is not wanted yet."""
    pidfd: int | None = None
    listening: bool = False
    """Its port answers (the api's, the proxy's; the worker listens on none)."""

    def poll(self) -> int | None:
        """Its exit code (minus the signal) once it ended, collecting it; None while it runs."""
        if self.pid is None or self.code is not None:
            return self.code
        pid, status = os.waitpid(self.pid, os.WNOHANG)  # serve's own child: no one else collects it
        if pid == 0:
            return None
        self.code = os.waitstatus_to_exitcode(status)
        return self.code

    def wait(self, timeout: float | None) -> int | None:
        """Its exit code once it ended, waiting up to `timeout` seconds (None: until it does; the result is None if
        it still runs then). A signal handler that runs meanwhile (serve's: a second SIGTERM) runs; the wait goes on."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if self.pidfd is not None:
                select.select([self.pidfd], [], [], left)
            else:  # no pidfds (not Linux): look every 50 ms
                select.select([], [], [], 0.05 if left is None else min(left, 0.05))
        return code

    def signal(self, sig: int) -> None:
        if self.pid is not None and self.code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)  # by its PID, never a name


class Supervisor:
    """Runs the children until SIGTERM or SIGINT; `run` returns serve's exit code. Call it from the main thread."""

    def __init__(self, settings: Settings, main: ChildMain, *,
                 names: tuple[str, ...] = ("api", "worker", "proxy")) -> None:
        self._settings = settings
        self._main = main
        self._resolved = child_environment(settings, base={})[RESOLVED_ENV]
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
        own = self._pid_file("serve")  # the process to send SIGTERM to, beside its children's
        try:
            self._run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # before any child starts
            own.write_text(f"{os.getpid()}\n")
            if "proxy" in self._children:
                new_decider_token(self._settings)
            for child in self._children.values():
                child.due = 0.0
            code = self._loop()
        finally:
            signal.set_wakeup_fd(-1)
            crashed = self._stop_all()
            own.unlink(missing_ok=True)
        # A child that reached an armed crash point while being stopped died there all the same: serve says so.
        return faults.EXIT_CODE if crashed and code == 0 else code

    def _asked_to_stop(self, signum: int, _frame: object) -> None:
        if not self._stopping:
            log.info("%s: stopping the api, then the worker, then the proxy", signal.Signals(signum).name)
        elif self._terminating is not None:
            # A second signal while a child stops is passed on: the api draining (drain_seconds) stops now.
            self._terminating.signal(signal.SIGTERM)
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
                code = child.poll()
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
                if c.pid is not None and not c.listening and self._address(c) is not None]

    def _look_for_ports(self) -> None:
        """Mark the children whose port now answers (the proxy's is said in the log)."""
        for child in self._starting():
            address = self._address(child)
            assert address is not None and child.pid is not None
            if not _listening(*address):
                continue
            child.listening = True
            if child.name == "proxy":
                log.info("egress proxy listening on 127.0.0.1:%d (pid %d)", address[1], child.pid)

    def _next_timeout(self) -> float | None:
        waits = [c.due - time.monotonic() for c in self._children.values() if c.due is not None]
        if self._starting():
            waits.append(0.05)  # a child is starting: look for its port (bounded by its start, not a poll of work)
        if not hasattr(os, "pidfd_open") and any(c.pid is not None for c in self._children.values()):
            waits.append(0.5)  # no pidfds (not Linux): look for exits twice a second
        return max(0.0, min(waits)) if waits else None

    def _exited(self, child: _Child, code: int) -> int | None:
        """A child ended on its own: schedule its restart, or return the code serve exits with."""
        assert child.pid is not None
        pid = child.pid
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
        argv = [child.name]
        if child.name == "api" and "proxy" in self._children:
            argv.append("--await-proxy")
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        gc.freeze()  # what serve imported stays in pages the children share, not touched by their collections
        pid = os.fork()
        if pid == 0:
            self._become(argv, parent)  # never returns
        child.pid, child.code = pid, None
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(ProcessLookupError):
                child.pidfd = os.pidfd_open(pid)
        self._pid_file(child.name).write_text(f"{pid}\n")
        log.info("started %s (pid %d)", child.name, pid)

    def _become(self, argv: list[str], parent: int) -> None:
        """In the forked child: leave serve's signals, descriptors and session behind, run the command, exit."""
        code = 1
        try:
            os.setsid()
            _die_with_parent(parent)
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            for fd in (self._signal_r, self._signal_w, *(c.pidfd for c in self._children.values())):
                if fd is not None:
                    os.close(fd)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            os.close(devnull)
            os.environ[RESOLVED_ENV] = self._resolved
            code = self._main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def _pid_file(self, name: str) -> Path:
        return self._run_dir / f"{name}.pid"

    def _forget(self, child: _Child) -> None:
        if child.pidfd is not None:
            os.close(child.pidfd)
        child.pidfd, child.pid, child.code, child.listening = None, None, None, False
        with contextlib.suppress(FileNotFoundError):
            self._pid_file(child.name).unlink()

    def _terminate(self, child: _Child) -> int:
        """Stop a running child with SIGTERM (SIGKILL after its grace); returns how it ended."""
        if (code := child.poll()) is not None:
            return code
        grace = GRACE.get(child.name, 20.0) + (self._settings.drain_seconds if child.name == "api" else 0.0)
        self._terminating = child
        try:
            child.signal(signal.SIGTERM)
            if (code := child.wait(grace)) is None:
                log.error("%s (pid %d) did not stop within %g s: killing it", child.name, child.pid, grace)
                child.signal(signal.SIGKILL)
                code = child.wait(None)
        finally:
            self._terminating = None
        assert code is not None
        return code

    def _kill_all(self) -> None:
        for child in self._children.values():
            if child.pid is None:
                continue
            child.signal(signal.SIGKILL)
            child.wait(None)
            self._forget(child)

    def _stop_all(self) -> bool:
        """Stop every child, the api first; True when one died at an armed crash point meanwhile."""
        crashed = False
        for name in ("api", "worker", "proxy"):
            child = self._children.get(name)
            if child is None or child.pid is None:
                continue
            pid, code = child.pid, self._terminate(child)
            if code == faults.EXIT_CODE and self._settings.crash_at:
                log.error("%s (pid %d) died at a crash point while stopping: serve exits with its code", name, pid)
                crashed = True
            log.info("%s (pid %d) stopped (%s)", name, pid, "SIGTERM" if code == -signal.SIGTERM
                     else _how(code).removeprefix("exited with "))
            self._forget(child)
        with contextlib.suppress(FileNotFoundError):
            (self._settings.decider_socket.parent / TOKEN_FILE).unlink()
        return crashed
