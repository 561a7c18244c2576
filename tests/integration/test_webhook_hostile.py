"""Hostile bodies at the webhook inbox, through the real endpoint on loopback (hypothesis): whatever a signed sender
puts in the body (nesting, size, numbers, encodings, duplicate keys) and in the keys the server reads from it, the
answer is a 2xx with the delivery stored as valid JSON within the schema's bounds, or a 4xx with a documented code
and nothing stored; never a 500.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select

from wakeful.proxy.clock import FakeClock
from wakeful.server.core.signatures import sign
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.sims import serve
from wakeful.server.store.db import make_engine, migrate, read, write
from wakeful.server.store.tables import events
from wakeful.server.store.users import ensure_user

SECRET = "hostile-test-secret"
MAX_BODY = 4096
REFUSALS = {  # docs/webhooks.md, the table of refusals
    400: {"malformed_body", "json_too_deep", "number_too_long", "number_out_of_range", "duplicate_key",
          "missing_delivery_id", "invalid_delivery_id", "invalid_session_key"},
    401: {"signature_missing", "signature_malformed", "signature_mismatch"},  # an ID the sender could not sign
    413: {"payload_too_large"},
}
HOSTILE_CHARS = ["\ud800", "\udfff", "\x00", "\u2028", "\ufeff", "\u202e", "\"", "\\", "é", "💥"]
_deliveries = itertools.count()


@dataclass
class Inbox:
    url: str
    engine: Engine
    clock: FakeClock

    def post(self, source: str, kind: str, body: bytes, delivery_id: bytes | None) -> httpx.Response:
        now = self.clock.now().timestamp()
        headers: dict[str, Any]
        if kind != "generic":
            headers = sign(kind, secret=SECRET.encode(), body=body, now=now)
        else:  # the generic scheme signs its delivery ID: one it cannot sign goes with the signature of another
            try:
                headers = sign(kind, secret=SECRET.encode(), body=body, now=now,
                               delivery_id=None if delivery_id is None else delivery_id.decode("latin-1"))
            except ValueError:
                headers = sign(kind, secret=SECRET.encode(), body=body, now=now, delivery_id="signed-id")
                del headers["X-Wakeful-Delivery"]
        if delivery_id is not None:
            headers["X-Wakeful-Delivery"] = delivery_id
        return httpx.post(f"{self.url}/v1/hooks/{source}", content=body, headers=headers, timeout=30)

    def stored(self, source: str, source_id: str) -> Any:
        with read(self.engine) as conn:
            return conn.execute(select(events).where(events.c.source == source,
                                                     events.c.source_id == source_id)).first()

    def count(self) -> int:
        with read(self.engine) as conn:
            return len(conn.execute(select(events.c.id)).all())


@pytest.fixture(scope="module")
def hostile_inbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Inbox]:
    """One server for every example: each delivery has an ID of its own, so examples do not meet."""
    data: Path = tmp_path_factory.mktemp("hostile")
    settings = Settings(data_dir=data, max_body_bytes=MAX_BODY, poll_interval=0.05, sweep_interval=3600, proxy=False,
                        sources={"generic": {"kind": "generic", "secret": SECRET},
                                 "stripe": {"kind": "stripe", "secret": SECRET}})
    engine = make_engine(settings.db_url)
    migrate(engine)
    clock = FakeClock()
    with write(engine) as conn:
        ensure_user(conn, name="owner", now=clock.now())
    runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine)
    runtime.prepare()
    runtime.committer.start()  # the inbox's writer; no worker runs
    try:
        with serve(create_app(runtime, manage_runtime=False)) as url:
            yield Inbox(url=url, engine=engine, clock=clock)
    finally:
        runtime.committer.stop()
        engine.dispose()


texts = st.text(st.characters() | st.sampled_from(HOSTILE_CHARS), max_size=30) | st.sampled_from(HOSTILE_CHARS)
scalars = (st.none() | st.booleans() | st.integers(-(10**70), 10**70) | st.floats() | texts
           | st.text(st.sampled_from(HOSTILE_CHARS), min_size=150, max_size=400))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                      max_leaves=12)


def _dumps(value: Any, ascii_only: bool) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)  # NaN and Infinity come out as the non-JSON words


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    """A JSON object (perhaps with a hostile session key or Stripe object ID) in some encoding, or something that
    only looks like one: too deep, too long, two values for one key, not UTF-8, over the size limit."""
    shape = draw(st.sampled_from(["object", "object", "keyed", "keyed", "deep", "long_number", "huge_number",
                                  "duplicate", "bytes", "oversize"]))
    if shape == "deep":
        depth = draw(st.integers(60, 200))
        return b'{"a":' + b"[" * depth + b"]" * depth + b"}"
    if shape == "long_number":
        return b'{"n": ' + draw(st.sampled_from([b"", b"-"])) + b"9" * draw(st.integers(60, 200)) + b"}"
    if shape == "huge_number":  # a few characters, beyond any double
        return b'{"n": ' + draw(st.sampled_from([b"1e999", b"-1.5e400", b"1E+309", b"[2e308]"])) + b"}"
    if shape == "duplicate":
        return b'{"session_key": "a", "x": {"k": 1, "k": 1}, "session_key": "b"}'
    if shape == "bytes":
        return draw(st.binary(max_size=200))
    payload = draw(st.dictionaries(texts, values, max_size=4))
    keys = scalars if shape == "keyed" else values  # what the server reads a key from is a scalar or nothing
    if shape == "keyed" or draw(st.booleans()):
        payload["session_key"] = draw(keys)
    if shape == "keyed" or draw(st.booleans()):
        payload["id"] = draw(keys)
        payload["data"] = {"object": {"id": draw(keys)}}
    if shape == "oversize":
        payload["pad"] = "x" * MAX_BODY
    text = _dumps(payload, ascii_only=draw(st.booleans()))
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "utf-16", "latin-1"]))
    return text.encode(encoding, errors="surrogatepass" if encoding.startswith("utf") else "replace")


delivery_ids = st.none() | st.binary(max_size=400).map(  # any header value HTTP lets through
    lambda raw: b"d" + bytes(b if 0x20 <= b < 0x7F or b >= 0x80 else 0x2E for b in raw))


def strict(text: str) -> Any:
    def refuse(word: str) -> Any:
        raise AssertionError(f"{word} was stored: it is not JSON")
    return json.loads(text, parse_constant=refuse)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=bodies(), header_id=delivery_ids, source=st.sampled_from(["generic", "stripe"]))
def test_a_hostile_body_is_stored_within_bounds_or_refused_with_a_code(hostile_inbox: Inbox, body: bytes,
                                                                       header_id: bytes | None, source: str) -> None:
    unique = f"-{next(_deliveries)}".encode()
    header = header_id + unique if header_id is not None else None
    before = hostile_inbox.count()
    answer = hostile_inbox.post(source, source, body, header)
    assert answer.status_code in (200, *REFUSALS), answer.text
    if answer.status_code != 200:
        assert answer.json()["error"]["code"] in REFUSALS[answer.status_code], answer.text
        assert hostile_inbox.count() == before  # refused whole: nothing stored
        return
    event_id = answer.json()["event_id"]
    with read(hostile_inbox.engine) as conn:
        row = conn.execute(select(events).where(events.c.id == event_id)).one()
    stored = strict(row.payload)
    if not answer.json()["duplicate"]:  # a Stripe ID drawn twice names the first delivery, kept as it was
        assert stored == json.loads(body.decode("utf-8"))  # what was accepted was UTF-8 JSON, kept as it was sent
    assert all(math.isfinite(n) for n in _numbers(stored))
    for column in ("source_id", "corr_key"):  # what the schema can hold on PostgreSQL as on SQLite
        value = getattr(row, column)
        if value is not None:
            assert len(value) <= events.c[column].type.length and "\x00" not in value
            value.encode("utf-8")  # no lone surrogate
    if source == "generic":
        assert header is not None and row.source_id == header.decode("latin-1")


def _numbers(value: Any) -> Iterator[float]:
    if isinstance(value, float):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
