"""Run a real `wakeful serve` process for a test, and make sure it never outlives the test.

`wakeful serve` supervises `wakeful api`, `wakeful worker` (and `wakeful proxy` when WAKEFUL_PROXY=true) as its
children, their PIDs in `<data_dir>/run/*.pid`; they die with it. A child that dies at an armed crash point
(`WAKEFUL_CRASH_AT`) takes serve down with exit 77, so the crash tests see every crash as before.

    with ServeProcess({"WAKEFUL_DATA_DIR": str(tmp_path)}, log_path=tmp_path / "serve.log") as server:
        httpx.get(f"{server.url}/healthz")

`serving(app)` runs an ASGI app (`create_app`'s, say) with `QuietServer` on a thread of this process instead, lifespan
included, for tests that need the real HTTP stack without a second process.

The process is started from the venv's `wakeful` console script (the CLI module has no `__main__`), listens on a
fresh loopback port, and writes stdout and stderr to `log_path` so a failing test can show what the server said.
It is only ever signalled by its own PID.

On Linux the server is also tied to the thread that started it (`PR_SET_PDEATHSIG`): if the test process dies
without cleaning up, the kernel kills the server. That thread must therefore outlive the server — the main thread,
or a pool's worker that is only shut down after the server was stopped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import httpx
import uvicorn
from starlette.types import ASGIApp

from tests.support.polling import wait_until
from wakeful.server.faces.http import QuietServer

__all__ = ["WAKEFUL", "ServeProcess", "ServerExited", "free_port", "serving"]

WAKEFUL = Path(sys.executable).parent / "wakeful"
# Linux: a tiny launcher asks the kernel to SIGKILL the server if the test process dies without cleaning up (a hard
# kill, a runner's os._exit), then execs the server in place, so the PID and the exit code are the server's own.
_LAUNCHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(70)  # the test process died before we asked
os.execv(sys.argv[2], sys.argv[2:])
"""
READY_TIMEOUT = 60.0
"""serve prepares the database and imports what its children run, then forks them: one Python start, on a busy
machine."""
KILL_GRACE = 60.0
"""serve stops its children in order (the api drains, then the worker finishes its runs, then the proxy)."""


class ServerExited(RuntimeError):
    """The server process ended while we were waiting for it to become ready."""

    def __init__(self, returncode: int, log: str) -> None:
        super().__init__(f"wakeful serve exited with code {returncode} before it was ready; its log:\n{log}")
        self.returncode = returncode
        self.log = log


def free_port() -> int:
    """A port nothing listens on right now (the kernel picks it; the tiny reuse race is acceptable in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serving(app: ASGIApp) -> Iterator[str]:
    """Serve `app` on a free loopback port (its lifespan run) until the block ends; yields its base URL."""
    server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, 30, "the server to start")
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def _command() -> list[str]:
    if sys.platform != "linux":
        return [str(WAKEFUL), "serve"]
    return [sys.executable, "-c", _LAUNCHER, str(os.getpid()), str(WAKEFUL), "serve"]


def _clean_environ() -> dict[str, str]:
    # A developer's own WAKEFUL_* settings (and the Anthropic key they fall back to) must not reach the server.
    return {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_") and k != "ANTHROPIC_API_KEY"}


class ServeProcess:
    def __init__(self, env: Mapping[str, str], *, log_path: Path, port: int | None = None) -> None:
        self._fixed_port = port is not None
        self.port = port or free_port()
        self.log_path = log_path
        # Connector calls go out directly unless a test asks for the egress proxy (WAKEFUL_PROXY=true). No tool
        # computers unless asked for (WAKEFUL_COMPUTERS=true, with WAKEFUL_COMPUTER_FAKES=true for no VM): the API
        # holds them and the worker reaches them over <data_dir>/run/computers.sock.
        self._env = {**_clean_environ(), "WAKEFUL_PROXY": "false", "WAKEFUL_COMPUTERS": "false", **env,
                     "WAKEFUL_HOST": "127.0.0.1"}
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.poll()

    @property
    def _process(self) -> subprocess.Popen[bytes]:
        if self._proc is None:
            raise RuntimeError("the server has not been started")
        return self._proc

    def start(self) -> ServeProcess:
        """Start the process and return once `GET /healthz` answers; raises ServerExited if it dies first."""
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError(f"wakeful serve (pid {self._proc.pid}) is already running; a second start would leak it")
        for attempt in range(3):
            try:
                return self._launch()
            except ServerExited as died:
                # Someone took the port between our probe and the server's bind: pick another, unless it was given.
                if self._fixed_port or attempt == 2 or "address already in use" not in died.log[-2000:]:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _launch(self) -> ServeProcess:
        env = {**self._env, "WAKEFUL_PORT": str(self.port)}
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            self._proc = subprocess.Popen(_command(), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT)
        # One client for all the polls: building one per poll (TLS context included) costs more than the poll.
        with httpx.Client(timeout=1.0) as client:
            try:
                wait_until(lambda: self._healthy(client), READY_TIMEOUT,
                           f"wakeful serve (pid {self.pid}) to answer /healthz")
            except AssertionError as exc:
                self.kill()
                raise AssertionError(f"{exc}; its log:\n{self.log()}") from None
        return self

    def _healthy(self, client: httpx.Client) -> bool:
        code = self._process.poll()
        if code is not None:
            raise ServerExited(code, self.log())
        try:
            return client.get(f"{self.url}/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code once the process has ended, or None if it is still running after `timeout` seconds."""
        try:
            return self._process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def terminate(self, grace: float = KILL_GRACE) -> tuple[int, bool]:
        """SIGTERM, then SIGKILL if it has not exited after `grace` seconds. Returns (exit code, had to kill)."""
        process = self._process
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # Popen signals its own PID, never a name
        code = self.wait_exit(grace)
        if code is not None:
            return code, False
        self.kill()
        return process.returncode, True

    def kill(self) -> None:
        process = self._process
        if process.poll() is None:
            process.kill()
            process.wait(timeout=KILL_GRACE)

    def log(self, tail: int | None = None) -> str:
        """What the process wrote (stdout and stderr), or its last `tail` characters, for failure messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log written)"
        return text if tail is None or len(text) <= tail else "…" + text[-tail:]

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._proc is not None:
            self.kill()
