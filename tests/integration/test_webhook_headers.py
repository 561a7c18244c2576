"""How the webhook inbox reads a delivery's headers, through a real server on loopback: a name in any case, and a
name sent twice is judged by its first value (as a lookup by name finds it), for the signature and for a session key
a source reads from a header. Signatures are computed by the documented recipe (`test_webhook_replays.generic`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.test_webhook_replays import SECRET, Server, code, generic, now, serving
from tests.support.records import event_rows
from wakeful.proxy.clock import FakeClock
from wakeful.server.settings import Settings

BODY = b'{"text": "hello"}'


@pytest.fixture
def server(tmp_path: Path, clock: FakeClock) -> Iterator[Server]:
    sources = {"generic": {"kind": "generic", "secret": SECRET},
               "threads": {"kind": "generic", "secret": SECRET, "session_key": "header:X-Thread-KEY"}}
    with serving(Settings(data_dir=tmp_path, proxy=False, poll_interval=0.05, sweep_interval=3600, sources=sources),
                 clock) as server:
        yield server


def post(server: Server, source: str, headers: list[tuple[str, str]]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/hooks/{source}", content=BODY, timeout=10,
                      headers=[("content-type", "application/json"), *headers])


def test_a_signature_header_sent_twice_is_judged_by_its_first_value(server: Server, clock: FakeClock) -> None:
    signed = generic(BODY, "twice-1", now(clock))
    good, wrong = signed.pop("X-Wakeful-Signature"), "v1=" + "0" * 64
    assert post(server, "generic", [*signed.items(), ("X-Wakeful-Signature", good),
                                    ("X-Wakeful-Signature", wrong)]).status_code == 200
    signed = generic(BODY, "twice-2", now(clock))
    good = signed.pop("X-Wakeful-Signature")
    refused = post(server, "generic", [*signed.items(), ("X-Wakeful-Signature", wrong),
                                       ("X-Wakeful-Signature", good)])
    assert code(refused) == (401, "signature_mismatch")
    assert server.source_ids() == ["twice-1"]


def test_signature_headers_are_read_in_any_case(server: Server, clock: FakeClock) -> None:
    signed = generic(BODY, "cased-1", now(clock))
    answer = post(server, "generic", [(name.upper(), value) for name, value in signed.items()])
    assert answer.status_code == 200, answer.text
    assert server.source_ids() == ["cased-1"]


def test_a_session_key_read_from_a_header_is_found_whatever_the_case_of_either_name(
        server: Server, clock: FakeClock) -> None:
    for delivery, name in (("key-1", "x-thread-key"), ("key-2", "X-THREAD-KEY")):
        answer = post(server, "threads", [*generic(BODY, delivery, now(clock)).items(), (name, f"thread-{delivery}")])
        assert answer.status_code == 200, answer.text
    assert [(e.source_id, e.corr_key) for e in event_rows(server.runtime.engine)] == [
        ("key-1", "thread-key-1"), ("key-2", "thread-key-2")]
