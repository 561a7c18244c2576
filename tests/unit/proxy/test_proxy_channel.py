"""The decider channel: authenticated, pipelined, fail-closed on the proxy's end; audit records acked and re-sent."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from wakeful.proxy.audit import EgressRecord
from wakeful.proxy.channel import (
    ACK,
    AUDIT,
    DECIDE,
    HELLO,
    MAX_FRAME,
    VERDICT,
    WELCOME,
    ChannelError,
    DeciderClient,
    DeciderServer,
    frame,
    read_frame,
)
from wakeful.proxy.contract import REASONS, Allow, DecisionRequest, RefusalCode, Refuse, Verdict, encode_verdict, refuse

pytestmark = pytest.mark.anyio
TOKEN = "channel-token"
ALLOW = Allow(credential=None, rule="r", attempt_id=None, action_id=None)
UNAVAILABLE = RefusalCode.DECIDER_UNAVAILABLE


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def sock() -> Iterator[Path]:
    # Short: a unix socket path is limited to ~107 bytes, and pytest's tmp_path can be longer.
    directory = Path(tempfile.mkdtemp(prefix="wkc-"))
    yield directory / "run" / "decider.sock"
    shutil.rmtree(directory, ignore_errors=True)


def request(n: int = 1) -> DecisionRequest:
    return DecisionRequest(request_id=f"req_{n}", user_id="usr_1", attempt_token=None, client_token="tok",
                           method="GET", scheme="https", host="merchant.test", port=443, path="/x", query="",
                           body_sha256=hashlib.sha256(b"").hexdigest(), resolved_ips=(), client="tool_computer")


def record(n: int = 1) -> EgressRecord:
    return EgressRecord(request_id=f"req_{n}", at=datetime(2030, 1, 1, tzinfo=UTC), user_id="usr_1",
                        client="tool_computer", attempt_id=None, action_id=None, method="GET", scheme="https",
                        host="merchant.test", port=443, path="/x", verdict="allow", code=None, rule="r",
                        credential=None, bytes_up=0, bytes_down=5, upstream_status=200, latency_ms=1.0)


class Store:
    def __init__(self) -> None:
        self.records: list[EgressRecord] = []
        self.calls = 0
        self.fail = 0

    async def __call__(self, records: list[EgressRecord]) -> None:
        self.calls += 1
        if self.fail:
            self.fail -= 1
            raise RuntimeError("database is down")
        self.records.extend(records)


async def allow(req: DecisionRequest) -> Verdict:
    return ALLOW


async def started(path: Path, decide: Callable[[DecisionRequest], Awaitable[Verdict]] = allow,
                  store: Store | None = None, hello_timeout: float = 2.0) -> DeciderServer:
    server = DeciderServer(path, TOKEN, decide, store or Store(), hello_timeout=hello_timeout)
    await server.start()
    return server


@pytest.fixture
async def client(sock: Path) -> AsyncIterator[DeciderClient]:
    c = DeciderClient(sock, TOKEN, timeout=2.0, backoff=0.0)
    yield c
    await c.close()


# --- decisions -----------------------------------------------------------------------------------------------------

async def test_a_verdict_comes_back_for_its_request(sock: Path, client: DeciderClient) -> None:
    seen: list[DecisionRequest] = []

    async def decide(req: DecisionRequest) -> Verdict:
        seen.append(req)
        return refuse(RefusalCode.HOST_NOT_ALLOWED) if req.request_id == "req_2" else ALLOW

    async with await started(sock, decide):
        assert await client.decide(request(1)) == ALLOW
        assert await client.decide(request(2)) == refuse(RefusalCode.HOST_NOT_ALLOWED)
    assert seen == [request(1), request(2)]
    assert seen[0].client_token == "tok"


async def test_the_socket_is_owner_only_in_an_owner_only_directory(sock: Path) -> None:
    async with await started(sock):
        assert sock.stat().st_mode & 0o777 == 0o600
        assert sock.parent.stat().st_mode & 0o777 == 0o700
    assert not sock.exists()


async def test_a_socket_directory_open_to_others_is_refused(sock: Path) -> None:
    sock.parent.mkdir(parents=True)
    sock.parent.chmod(0o755)
    with pytest.raises(ChannelError, match="chmod 700"):
        await started(sock)


async def test_pipelined_requests_are_answered_out_of_order_each_with_its_own_verdict(
        sock: Path, client: DeciderClient) -> None:
    release_first = asyncio.Event()

    async def decide(req: DecisionRequest) -> Verdict:
        if req.request_id == "req_1":
            await release_first.wait()
            return ALLOW
        return refuse(RefusalCode.NOT_ADMITTED)

    async with await started(sock, decide):
        first = asyncio.create_task(client.decide(request(1)))
        second = await client.decide(request(2))  # answered while the first is still being decided
        assert second == refuse(RefusalCode.NOT_ADMITTED) and not first.done()
        release_first.set()
        assert await first == ALLOW


async def test_a_wrong_token_is_refused_and_nothing_is_decided(sock: Path) -> None:
    seen: list[DecisionRequest] = []

    async def decide(req: DecisionRequest) -> Verdict:
        seen.append(req)
        return ALLOW

    async with await started(sock, decide):
        wrong = DeciderClient(sock, "not-the-token", backoff=0.0)
        verdict = await wrong.decide(request())
        await wrong.close()
    assert isinstance(verdict, Refuse) and verdict.code == UNAVAILABLE
    assert seen == []


async def test_no_decider_listening_is_decider_unavailable(sock: Path, client: DeciderClient) -> None:
    verdict = await client.decide(request())
    assert isinstance(verdict, Refuse) and verdict.code == UNAVAILABLE


async def test_the_client_reconnects_once_the_decider_is_back(sock: Path, client: DeciderClient) -> None:
    assert (await client.decide(request(1))).code == UNAVAILABLE  # type: ignore[union-attr]
    async with await started(sock):
        assert await client.decide(request(2)) == ALLOW


async def test_a_slow_decider_is_refused_after_the_timeout_and_its_late_answer_is_ignored(sock: Path) -> None:
    release = asyncio.Event()

    async def decide(req: DecisionRequest) -> Verdict:
        if req.request_id == "req_1":
            await release.wait()
        return ALLOW

    client = DeciderClient(sock, TOKEN, timeout=0.2, backoff=0.0)
    async with await started(sock, decide):
        verdict = await client.decide(request(1))
        assert isinstance(verdict, Refuse) and verdict.code == UNAVAILABLE
        assert "did not answer" in verdict.reason
        release.set()  # the late allow for req_1 arrives now, and must not be taken for req_2's answer
        assert await client.decide(request(2)) == ALLOW
        assert client.connected
    await client.close()


async def test_a_decider_that_raises_answers_decider_unavailable_and_keeps_serving(
        sock: Path, client: DeciderClient, caplog: pytest.LogCaptureFixture) -> None:
    async def decide(req: DecisionRequest) -> Verdict:
        if req.request_id == "req_1":
            raise RuntimeError("policy bug")
        return ALLOW

    async with await started(sock, decide):
        verdict = await client.decide(request(1))
        assert isinstance(verdict, Refuse) and verdict.code == UNAVAILABLE
        assert await client.decide(request(2)) == ALLOW
    assert "RuntimeError" in caplog.text and "policy bug" not in caplog.text  # a message may quote a token


async def test_losing_the_connection_refuses_every_pending_request(sock: Path, client: DeciderClient) -> None:
    entered = asyncio.Event()
    server: DeciderServer

    async def decide(req: DecisionRequest) -> Verdict:
        entered.set()
        await asyncio.Event().wait()  # never answers
        return ALLOW

    server = await started(sock, decide)
    pending = [asyncio.create_task(client.decide(request(n))) for n in (1, 2, 3)]
    await asyncio.wait_for(entered.wait(), 5)
    await server.close()
    verdicts = await asyncio.wait_for(asyncio.gather(*pending), 5)
    assert all(isinstance(v, Refuse) and v.code == UNAVAILABLE for v in verdicts)


# --- a hand-written decider, for answers the real one never gives ----------------------------------------------------

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def fake_decider(path: Path, script: Script) -> asyncio.Server:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            kind, _ = await read_frame(reader)
            if kind == HELLO:
                writer.write(frame(WELCOME, b'{"v":1}'))
                await script(reader, writer)
        except (asyncio.IncompleteReadError, OSError):
            pass  # the client hung up
        finally:
            writer.close()

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return await asyncio.start_unix_server(serve, path=str(path))


def answering(make: Callable[[str], bytes]) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            kind, body = await read_frame(reader)
            if kind == DECIDE:
                writer.write(make(json.loads(body)["request_id"]))

    return script


MALFORMED = Refuse(code=RefusalCode.MALFORMED_VERDICT, reason=REASONS[RefusalCode.MALFORMED_VERDICT])


@pytest.mark.parametrize("make", [
    lambda rid: frame(VERDICT, b'{"v":1,"request_id":"%s","verdict":"allow"}' % rid.encode()),
    lambda rid: frame(VERDICT, b'{"v":1,"request_id":"%s","verdict":"allow","credential":null,"rule":"r",'
                               b'"attempt_id":null,"action_id":null,"extra":1}' % rid.encode()),
    lambda rid: frame(VERDICT, b"not json at all"),
    lambda rid: frame(VERDICT, b"[1,2]"),
    lambda rid: frame(b"Z", b"{}"),
], ids=["missing-keys", "extra-key", "garbage", "no-request-id", "unknown-kind"])
async def test_an_answer_that_is_not_a_well_formed_verdict_is_malformed_verdict(
        sock: Path, client: DeciderClient, make: Callable[[str], bytes]) -> None:
    server = await fake_decider(sock, answering(make))
    async with server:
        assert await client.decide(request()) == MALFORMED


async def test_a_verdict_for_another_request_is_ignored_and_the_request_times_out(sock: Path) -> None:
    server = await fake_decider(sock, answering(lambda rid: frame(VERDICT, encode_verdict(ALLOW, request_id="other"))))
    client = DeciderClient(sock, TOKEN, timeout=0.2, backoff=0.0)
    async with server:
        verdict = await client.decide(request())
    await client.close()
    assert isinstance(verdict, Refuse) and verdict.code == UNAVAILABLE


async def test_a_decider_that_hangs_up_mid_request_is_decider_unavailable(sock: Path, client: DeciderClient) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader)

    async with await fake_decider(sock, hang_up):
        verdict = await client.decide(request())
    assert isinstance(verdict, Refuse) and verdict.code == UNAVAILABLE


# --- the server's guard ----------------------------------------------------------------------------------------------

async def _closed_without_welcome(path: Path, first: bytes | None) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    if first is not None:
        writer.write(first)
    try:
        async with asyncio.timeout(5):
            return await reader.read()  # everything until the server closes
    finally:
        writer.close()


@pytest.mark.parametrize("first", [
    None,  # no hello at all: closed after hello_timeout
    frame(HELLO, b'{"v":1,"token":"wrong"}'),
    frame(HELLO, b'{"v":1,"token":"channel-token","extra":1}'),
    frame(DECIDE, b"{}"),
    (MAX_FRAME + 1).to_bytes(4, "big") + HELLO,
    (0).to_bytes(4, "big"),
], ids=["silent", "wrong-token", "extra-key", "no-hello", "oversized", "empty"])
async def test_the_server_closes_without_a_welcome_unless_the_first_frame_is_the_right_hello(
        sock: Path, first: bytes | None) -> None:
    async with await started(sock, hello_timeout=0.2):
        assert await _closed_without_welcome(sock, first) == b""


async def test_the_server_welcomes_the_right_token_then_closes_on_an_oversized_frame(sock: Path) -> None:
    async with await started(sock):
        reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.write(frame(HELLO, json.dumps({"v": 1, "token": TOKEN}).encode()))
        assert await asyncio.wait_for(read_frame(reader), 5) == (WELCOME, b'{"v":1}')
        writer.write((MAX_FRAME + 1).to_bytes(4, "big") + DECIDE)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


def test_a_frame_longer_than_the_limit_is_never_built() -> None:
    assert len(frame(DECIDE, b"x" * (MAX_FRAME - 1))) == 4 + MAX_FRAME
    with pytest.raises(ChannelError):
        frame(DECIDE, b"x" * MAX_FRAME)


# --- audit ---------------------------------------------------------------------------------------------------------

async def test_audit_records_are_stored_and_acknowledged(sock: Path, client: DeciderClient) -> None:
    store = Store()
    async with await started(sock, store=store):
        for n in (1, 2, 3):
            client.audit(record(n))
        assert await client.flush(5)
    assert [r.request_id for r in store.records] == ["req_1", "req_2", "req_3"]
    assert client.audit_pending == 0


async def test_records_queued_while_the_decider_is_down_are_delivered_once_it_is_up(
        sock: Path, client: DeciderClient) -> None:
    client.audit(record(1))
    assert not await client.flush(0.05)
    store = Store()
    async with await started(sock, store=store):
        assert await client.flush(5)
    assert [r.request_id for r in store.records] == ["req_1"]


async def test_a_record_sent_twice_is_stored_once_and_acked_twice(sock: Path) -> None:
    store = Store()
    async with await started(sock, store=store):
        reader, writer = await asyncio.open_unix_connection(str(sock))
        writer.write(frame(HELLO, json.dumps({"v": 1, "token": TOKEN}).encode()))
        await asyncio.wait_for(read_frame(reader), 5)
        from wakeful.proxy.audit import encode_record
        writer.write(frame(AUDIT, encode_record(record(1))) * 2)
        acks = [await asyncio.wait_for(read_frame(reader), 5) for _ in range(2)]
        writer.close()
    assert acks == [(ACK, b'{"v":1,"request_id":"req_1"}')] * 2
    assert [r.request_id for r in store.records] == ["req_1"]


async def test_when_storing_fails_the_records_are_sent_again_and_stored_once(
        sock: Path, client: DeciderClient, caplog: pytest.LogCaptureFixture) -> None:
    store = Store()
    store.fail = 1
    async with await started(sock, store=store):
        client.audit(record(1))
        assert await client.flush(5)
    assert store.calls == 2
    assert [r.request_id for r in store.records] == ["req_1"]
    assert "will send them again" in caplog.text


async def test_past_its_capacity_the_client_drops_the_oldest_records_and_says_so(
        sock: Path, caplog: pytest.LogCaptureFixture) -> None:
    client = DeciderClient(sock, TOKEN, audit_capacity=2, backoff=0.0)
    with caplog.at_level(logging.WARNING, logger="wakeful.proxy.channel"):
        for n in (1, 2, 3):
            client.audit(record(n))
    store = Store()
    async with await started(sock, store=store):
        assert await client.flush(5)
    await client.close()
    assert client.audit_dropped == 1
    assert [r.request_id for r in store.records] == ["req_2", "req_3"]
    assert "1 egress audit records dropped" in caplog.text
