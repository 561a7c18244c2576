"""The server's decider answers tool-computer requests inline from the records, and nothing it read is kept: a STOP,
a START, a revocation or a policy edit counts from the very next request. Real SQLite, the real `DeciderService`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine

from wakeful.proxy.clock import FakeClock
from wakeful.proxy.contract import Allow, DecisionRequest, Refuse, Verdict
from wakeful.server.core import control
from wakeful.server.egress import grants as egress
from wakeful.server.egress.proxyctl import DeciderService
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.users import ensure_user

RULES = '[[allow]]\nname = "shop"\nhost = "shop.example.com"\ncredential = "shop_session"\n'


def ask(user_id: str, token: str | None, host: str = "shop.example.com") -> DecisionRequest:
    return DecisionRequest(request_id="r", user_id=user_id, attempt_token=None, client_token=token, method="GET",
                           scheme="https", host=host, port=443, path="/", query="",
                           body_sha256=hashlib.sha256(b"").hexdigest(), resolved_ips=(), client="tool_computer")


@pytest.fixture
def service(engine: Engine, clock: FakeClock, settings: Settings) -> DeciderService:
    settings.policies.mkdir(parents=True, exist_ok=True)
    (settings.policies / "egress.toml").write_text(RULES)
    return DeciderService(engine, clock, settings)


@pytest.fixture
def token(engine: Engine, clock: FakeClock, owner: str) -> str:
    with write(engine) as conn:
        return egress.issue_client_token(conn, user_id=owner, label="vm", now=clock.now())[1]


def code(verdict: Verdict) -> str:
    return "allow" if isinstance(verdict, Allow) else verdict.code.value


def both_paths(service: DeciderService, req: DecisionRequest) -> str:
    """The inline verdict, checked against the pooled SQLAlchemy path for the same records."""
    inline = service.decide_inline(req)
    assert inline is not None, "a tool-computer request on a SQLite file is answered inline"
    with read(service._engine) as conn:
        pooled = egress.decide(conn, req, now=service._clock.now(), rules=service._current_rules())
    assert inline == pooled
    return code(inline)


def test_a_stop_and_a_start_count_from_the_very_next_request(
        engine: Engine, clock: FakeClock, owner: str, token: str, service: DeciderService) -> None:
    assert both_paths(service, ask(owner, token)) == "allow"
    for scope, stopped, expected in [(owner, True, "not_admitted"), (owner, False, "allow"),
                                     (None, True, "not_admitted"), (None, False, "allow")]:
        clock.advance(timedelta(seconds=1))
        with write(engine) as conn:
            control.set_stop(conn, stopped=stopped, user_id=scope, actor="user", reason="test", now=clock.now())
        assert both_paths(service, ask(owner, token)) == expected, (scope, stopped)


def test_another_users_stop_does_not_stop_this_one(
        engine: Engine, clock: FakeClock, owner: str, token: str, service: DeciderService) -> None:
    with write(engine) as conn:
        alice, _ = ensure_user(conn, name="alice", now=clock.now())
        control.set_stop(conn, stopped=True, user_id=alice, actor="user", reason="test", now=clock.now())
    assert both_paths(service, ask(owner, token)) == "allow"


def test_a_revoked_credential_is_refused_at_the_very_next_request(
        engine: Engine, clock: FakeClock, owner: str, service: DeciderService) -> None:
    with write(engine) as conn:
        client_id, token = egress.issue_client_token(conn, user_id=owner, label="vm", now=clock.now())
    assert both_paths(service, ask(owner, token)) == "allow"
    with write(engine) as conn:
        egress.revoke_client(conn, client_id, now=clock.now())
    assert both_paths(service, ask(owner, token)) == "not_admitted"


def test_unknown_credentials_and_requests_without_one_are_not_admitted(
        owner: str, token: str, service: DeciderService) -> None:
    assert both_paths(service, ask(owner, "not-the-token")) == "not_admitted"
    assert both_paths(service, ask("usr_someone_else", token)) == "not_admitted"
    assert both_paths(service, ask(owner, None)) == "not_admitted"
    assert both_paths(service, ask(owner, token, "elsewhere.example.com")) == "host_not_allowed"


def test_a_policy_edit_counts_from_the_next_request(
        owner: str, token: str, service: DeciderService, settings: Settings) -> None:
    assert both_paths(service, ask(owner, token, "docs.example.com")) == "host_not_allowed"
    path = settings.policies / "egress.toml"
    path.write_text(RULES + '\n[[allow]]\nname = "docs"\nhost = "docs.example.com"\n')
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert both_paths(service, ask(owner, token, "docs.example.com")) == "allow"


def test_when_the_inline_lookup_cannot_answer_at_once_the_pooled_path_decides(
        owner: str, token: str, service: DeciderService) -> None:
    inline = service._inline
    assert inline is not None
    held = threading.Lock()
    inline._lock = held  # another thread is using the inline connection
    with held:
        assert service.decide_inline(ask(owner, token)) is None
        assert code(service.decide_now(ask(owner, token))) == "allow"
        assert code(asyncio.run(service.decide(ask(owner, token)))) == "allow"
    service.close()


def test_a_database_the_inline_lookup_cannot_read_falls_back_and_still_refuses_what_it_must(
        engine: Engine, clock: FakeClock, owner: str, token: str, service: DeciderService, tmp_path: Path) -> None:
    inline = service._inline
    assert inline is not None
    inline._conn.close()  # any sqlite3 error on the inline connection
    assert service.decide_inline(ask(owner, token)) is None
    assert code(service.decide_now(ask(owner, token))) == "allow"
    with write(engine) as conn:
        control.set_stop(conn, stopped=True, user_id=None, actor="user", reason="test", now=clock.now())
    verdict = asyncio.run(service.decide(ask(owner, token)))
    assert isinstance(verdict, Refuse) and verdict.code == "not_admitted"
