"""The proxy's end of the decider channel follows the decider's token: asked for at each connect, and tried again by
itself once it changes after a refused hello (a `wakeful api` restarted with a new one). The decider says when the
last hello it heard was refused and no proxy is connected (`/readyz`'s proxy check)."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from wakeful.proxy.audit import EgressRecord
from wakeful.proxy.channel import DeciderClient, DeciderServer
from wakeful.proxy.contract import Allow, DecisionRequest, RefusalCode, Refuse, Verdict

pytestmark = pytest.mark.anyio
ALLOW = Allow(credential=None, rule="r", attempt_id=None, action_id=None)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sock() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="wkt-"))  # short: a unix socket path is limited to ~107 bytes
    yield directory / "run" / "decider.sock"
    shutil.rmtree(directory, ignore_errors=True)


def request(n: int) -> DecisionRequest:
    return DecisionRequest(request_id=f"req_{n}", user_id="usr_1", attempt_token=None, client_token="tok",
                           method="GET", scheme="https", host="merchant.test", port=443, path="/x", query="",
                           body_sha256=hashlib.sha256(b"").hexdigest(), resolved_ips=(), client="tool_computer")


async def allow(_req: DecisionRequest) -> Verdict:
    return ALLOW


async def keep(_records: list[EgressRecord]) -> None:
    return None


async def eventually(condition: Callable[[], bool], within: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + within
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.01)  # the poll tick: the loop re-checks the condition


class TokenFile:
    """What `wakeful proxy` reads the token from: the file the api rewrites at each start."""

    def __init__(self, token: str) -> None:
        self.token = token

    def __call__(self) -> str:
        return self.token


async def test_a_decider_restarted_with_a_new_token_decides_the_next_request(sock: Path) -> None:
    token = TokenFile("first-run")
    client = DeciderClient(sock, token, backoff=0.0)
    try:
        async with DeciderServer(sock, "first-run", allow, keep):
            assert await client.decide(request(1)) == ALLOW
        token.token = "second-run"
        async with DeciderServer(sock, "second-run", allow, keep):
            assert await client.decide(request(2)) == ALLOW
    finally:
        await client.close()


async def test_after_a_refused_hello_the_client_reconnects_by_itself_once_the_token_changes(sock: Path) -> None:
    token = TokenFile("stale")
    client = DeciderClient(sock, token, backoff=0.01, max_backoff=0.05)
    try:
        async with DeciderServer(sock, "fresh", allow, keep) as server:
            verdict = await client.decide(request(1))
            assert isinstance(verdict, Refuse) and verdict.code == RefusalCode.DECIDER_UNAVAILABLE
            assert server.hello_refused and not client.connected
            token.token = "fresh"  # no request comes: the client finds it alone
            await eventually(lambda: client.connected)
            assert not server.hello_refused
            assert await client.decide(request(2)) == ALLOW
    finally:
        await client.close()


async def test_a_refused_stranger_does_not_count_against_a_connected_proxy(sock: Path) -> None:
    proxy, stranger = DeciderClient(sock, "right"), DeciderClient(sock, "wrong")
    try:
        async with DeciderServer(sock, "right", allow, keep) as server:
            assert not server.hello_refused  # no hello heard yet
            assert await proxy.decide(request(1)) == ALLOW
            assert isinstance(await stranger.decide(request(2)), Refuse)
            assert not server.hello_refused
    finally:
        await proxy.close()
        await stranger.close()
