"""`wakeful api` and `wakeful proxy --await-api 60` as the systemd units of docs/deploy.md run them: the api writes a
new decider token at each start, and the proxy, which keeps running, must follow it (it reads the token file again
as it reconnects). A proxy the decider refuses is not ready on `/readyz`.

Real processes on a temporary data directory; every wait is on a condition, with a deadline.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.polling import wait_until
from tests.support.serve import WAKEFUL, free_port
from wakeful.proxy.channel import HELLO, frame
from wakeful.proxy.contract import RefusalCode
from wakeful.server.settings import Settings

START = 60.0
"""Seconds for one process to start on a busy machine (a Python start, the database prepared)."""
DECIDED = 30.0
"""Seconds for the proxy to reach the restarted api: its reconnects back off to one a second at most."""


class Deployment:
    """The api and the proxy as separate processes on one data directory, each signalled by its own PID only."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.api_port, self.proxy_port = free_port(), free_port()
        self.env = {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")},
                    "WAKEFUL_DATA_DIR": str(data_dir), "WAKEFUL_HOST": "127.0.0.1", "WAKEFUL_PORT": str(self.api_port),
                    "WAKEFUL_PROXY": "true", "WAKEFUL_PROXY_PORT": str(self.proxy_port), "WAKEFUL_COMPUTERS": "false"}
        self.api: subprocess.Popen[bytes] | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.api_log, self.proxy_log = data_dir / "api.log", data_dir / "proxy.log"

    def _spawn(self, *args: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen([str(WAKEFUL), *args], env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT)

    def start_api(self) -> None:
        self.api = self._spawn("api", log=self.api_log)
        api = self.api
        wait_until(lambda: self._alive(api, self.api_log) and self._healthy(), START, "the api to answer /healthz")

    def start_proxy(self) -> None:
        self.proxy = self._spawn("proxy", "--await-api", "60", log=self.proxy_log)
        proxy = self.proxy
        wait_until(lambda: self._alive(proxy, self.proxy_log) and self._listening(), START, "the proxy to listen")

    def stop_api(self, sig: signal.Signals) -> None:
        assert self.api is not None
        self.api.send_signal(sig)  # Popen signals its own PID
        self.api.wait(timeout=START)

    def stop_all(self) -> None:
        for proc in (self.api, self.proxy):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=START)

    @staticmethod
    def _alive(proc: subprocess.Popen[bytes], log: Path) -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text(errors='replace')}"
        return True

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.api_port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def _listening(self) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", self.proxy_port)) == 0

    def verdict(self) -> str:
        """What the proxy answers a request that is not a connector's admitted call: the decider's refusal when it
        reaches the decider (`not_admitted`), else `decider_unavailable`."""
        with httpx.Client(proxy=f"http://127.0.0.1:{self.proxy_port}", timeout=10) as client:
            return client.get("http://nowhere.example/").headers["x-wakeful-refusal"]

    def decided(self) -> bool:
        return self.verdict() != RefusalCode.DECIDER_UNAVAILABLE

    def readyz(self) -> httpx.Response:
        return httpx.get(f"http://127.0.0.1:{self.api_port}/readyz", timeout=10)

    def logs(self) -> str:
        return "\n".join(f.read_text(errors="replace") for f in (self.api_log, self.proxy_log) if f.exists())


@contextmanager
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(tmp_path)
    try:
        yield d
    finally:
        d.stop_all()


def _token(d: Deployment) -> str:
    return (Settings(data_dir=d.data_dir).decider_socket.parent / "decider.token").read_text().strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_running_proxy_reaches_the_decider_again_after_the_api_restarts_with_a_new_token(
        tmp_path: Path, sig: signal.Signals) -> None:
    with deployment(tmp_path) as d:
        d.start_api()
        d.start_proxy()
        assert wait_until(d.decided, DECIDED, "a first request decided") and d.verdict() == "not_admitted"
        first = _token(d)

        d.stop_api(sig)
        d.start_api()
        assert _token(d) != first  # a new run, a new token: the proxy holds the old one

        wait_until(d.decided, DECIDED, f"a request decided again after the api's restart:\n{d.logs()}")
        assert d.verdict() == "not_admitted" and d.proxy is not None and d.proxy.poll() is None
        ready = d.readyz()
        assert ready.status_code == 200 and ready.json()["checks"]["proxy"] == "ok", ready.text
        assert first not in d.logs() and _token(d) not in d.logs()  # the token is a secret


def test_a_proxy_started_against_a_killed_apis_token_file_follows_the_api_that_starts_after_it(
        tmp_path: Path) -> None:
    with deployment(tmp_path) as d:
        d.start_api()
        d.stop_api(signal.SIGKILL)
        stale = _token(d)  # left behind by the killed api

        d.start_proxy()  # takes the stale file at once, as under systemd when both units start together
        d.start_api()
        assert _token(d) != stale

        wait_until(d.decided, DECIDED, f"a request decided by the api that started after the proxy:\n{d.logs()}")
        assert d.verdict() == "not_admitted"
        assert stale not in d.logs() and _token(d) not in d.logs()


def test_readyz_says_the_proxy_is_not_ready_while_the_decider_refuses_its_hello(tmp_path: Path) -> None:
    with deployment(tmp_path) as d:
        d.start_api()
        d.start_proxy()
        assert wait_until(d.decided, DECIDED, "a first request decided")
        ready = d.readyz()
        assert ready.status_code == 200 and ready.json()["checks"]["proxy"] == "ok", ready.text

        # What a proxy holding an earlier run's token says; the decider closes without a welcome.
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(Settings(data_dir=d.data_dir).decider_socket))
            s.sendall(frame(HELLO, b'{"v":1,"token":"an-earlier-runs-token"}'))
            assert s.recv(1) == b""
        # The real proxy is still connected: a refused stranger does not make it unready.
        assert d.readyz().status_code == 200

        d.stop_api(signal.SIGKILL)  # the proxy's connection goes with it
        d.start_api()
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(Settings(data_dir=d.data_dir).decider_socket))
            s.sendall(frame(HELLO, b'{"v":1,"token":"an-earlier-runs-token"}'))
            assert s.recv(1) == b""
        refused = d.readyz()
        assert refused.status_code == 503, refused.text
        said = refused.json()["error"]["checks"]["proxy"]
        assert "refuses the proxy's hello" in said and "an-earlier-runs-token" not in refused.text

        wait_until(d.decided, DECIDED, "the real proxy reaching the decider with this run's token")
        ready = d.readyz()
        assert ready.status_code == 200 and ready.json()["checks"]["proxy"] == "ok", ready.text
