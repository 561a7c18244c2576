"""Routing properties of the inbox: whatever the source, its trust setting and the key it carries, a delivery satisfies
only a wait its sender is entitled to (wakeful issue 15); otherwise its key leads it to the open task it is bound to,
and a delivery that matches nothing goes to its user's one triage session (issue 16).

The senders are webhook sources with any name (the server's own channel names and authority spellings included) and
any trust setting, the user's control channel and the system; the waits are the user's, the system's, one source's
and any source's. What a sender may satisfy is written out here from the design, not taken from the server's code.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Connection, Engine, select

from wakeful.proxy.clock import FakeClock
from wakeful.server.core import control, inbox, sessions, waits
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import Authority, EventStatus, WaitState, events, triage_sessions
from wakeful.server.store.tables import waits as waits_table
from wakeful.server.store.users import ensure_user

NAMES = ["hook", "merchant", "approval", "reconcile", "user", "system", "any_source", "source:hook", "wait", "timer"]
KEYS = ["approval:act_1", "reconcile:act_1", "thread-1", "7", "source:hook", "user"]
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
_users = itertools.count()


@dataclass(frozen=True)
class Sender:
    channel: Literal["webhook", "user", "system"]
    source: str
    trust: str

    def delivery(self, user_id: str, source_id: str, key: str | None) -> inbox.Delivery:
        """As the server builds it: a webhook delivery names only its source; the user's and the system's say so."""
        if self.channel == "webhook":
            return inbox.Delivery(user_id=user_id, source=self.source, source_id=source_id, trust=self.trust,
                                  corr_key=key, payload={"n": source_id})
        return inbox.Delivery(user_id=user_id, source=self.source, source_id=source_id, trust=self.trust,
                              corr_key=key, payload={"n": source_id},
                              authority=Authority.USER if self.channel == "user" else Authority.SYSTEM)


def entitled(wait: str, sender: Sender) -> bool:
    """The design: the user's control channel answers the user's waits, the system its own, a webhook source the
    waits opened for it by name or for any source. Trust and names play no part."""
    if sender.channel == "user":
        return wait == "user"
    if sender.channel == "system":
        return wait == "system"
    return wait in ("any_source", f"source:{sender.source}")


# What the webhook inbox lets into a key: no NUL, no lone surrogate.
storable = st.characters(codec="utf-8", exclude_characters="\x00")
names = st.sampled_from(NAMES) | st.text(storable, min_size=1, max_size=12)
trusts = st.sampled_from(["third_party", "verified_service", "user", "system"])
senders = st.one_of(
    st.builds(Sender, st.just("webhook"), names, trusts),
    st.builds(Sender, st.just("user"), st.sampled_from(["approval", "control", "hook"]), st.just("user")),
    st.builds(Sender, st.just("system"), st.sampled_from(["reconcile", "dispatch", "hook"]), st.just("system")),
)
wait_authorities = st.sampled_from(["user", "system", "any_source"]) | names.map(lambda name: f"source:{name}")
keys = st.sampled_from(KEYS) | st.text(storable, min_size=1, max_size=20)


def fresh_user(engine: Engine, clock: FakeClock) -> str:
    """Each example is a user of its own in the test's database: waits and keys are per user."""
    with write(engine) as conn:
        user_id, _ = ensure_user(conn, name=f"user-{next(_users)}", now=clock.now())
    return user_id


def deliver(engine: Engine, clock: FakeClock, batch: list[inbox.Delivery], *, many: bool) -> list[inbox.Recorded]:
    """Each delivery a moment after the one before (an early answer is the first one received)."""
    results = []
    with write(engine) as conn:
        if many:
            clock.advance(timedelta(seconds=1))
            return inbox.record_many(conn, batch, now=clock.now())
        for delivery in batch:
            clock.advance(timedelta(seconds=1))
            results.append(inbox.record(conn, delivery, now=clock.now()))
    return results


def wait_of(conn: Connection, user_id: str) -> Any:
    return conn.execute(select(waits_table).where(waits_table.c.user_id == user_id)).one()


@PROPERTY
@given(authority=wait_authorities, key=keys, early=st.lists(st.tuples(senders, st.booleans()), max_size=4),
       later=st.lists(st.tuples(senders, st.booleans()), max_size=6), ended=st.booleans(), many=st.booleans())
def test_no_sender_satisfies_a_wait_it_is_not_entitled_to(engine: Engine, clock: FakeClock, authority: str, key: str,
                                                         early: list[tuple[Sender, bool]],
                                                         later: list[tuple[Sender, bool]], ended: bool,
                                                         many: bool) -> None:
    user_id = fresh_user(engine, clock)
    ids = (f"{user_id}-{i}" for i in itertools.count())  # (source, source_id) is unique across users

    def batch(drawn: list[tuple[Sender, bool]]) -> list[inbox.Delivery]:
        return [s.delivery(user_id, next(ids), key if same else f"other:{key}") for s, same in drawn]

    before = deliver(engine, clock, batch(early), many=many)
    with write(engine) as conn:
        wait_session = sessions.create_session(conn, user_id=user_id, now=clock.now())
        waits.register(conn, user_id=user_id, session_id=wait_session, match_key=key, kind="reply",
                       authority=authority, deadline=None, now=clock.now())
        adopted = wait_of(conn, user_id).state == WaitState.SATISFIED
        if ended and not adopted:
            waits.cancel(conn, wait_id=wait_of(conn, user_id).id, now=clock.now())
    after = deliver(engine, clock, batch(later), many=many)

    answers = [i for i, (s, same) in enumerate(early) if same and entitled(authority, s)]
    with read(engine) as conn:
        wait = wait_of(conn, user_id)
        in_wait_session = set(conn.execute(select(events.c.id).where(events.c.session_id == wait_session)).scalars())
    expected_there = {before[i].event_id for i in answers[:1]}  # the first entitled answer that beat its wait
    if answers:
        assert (wait.state, wait.resolved_event_id) == (WaitState.SATISFIED, before[answers[0]].event_id)
    open_ = not answers and not ended
    for (sender, same), result in zip(later, after, strict=True):
        if same and entitled(authority, sender):
            expected_there.add(result.event_id)
            assert result.session_id == wait_session
            assert result.status == (EventStatus.PENDING if open_ else EventStatus.LATE)
            if open_:
                assert (wait.state, wait.resolved_event_id) == (WaitState.SATISFIED, result.event_id)
            open_ = False
        else:  # as if the wait were not there: never satisfying, never late, never in the wait's session
            assert (result.status, result.duplicate) == (EventStatus.PENDING, False)
            assert result.session_id != wait_session
            assert wait.resolved_event_id != result.event_id
    assert in_wait_session == expected_there  # no other event, early or late, reached the wait's session
    if open_:
        assert wait.state == WaitState.PENDING


@PROPERTY
@given(drawn=st.lists(st.tuples(senders, st.sampled_from([*KEYS[:3], None])), min_size=1, max_size=10),
       bound=st.sets(st.sampled_from(KEYS[:3])), many=st.booleans())
def test_a_key_leads_any_sender_to_the_task_it_is_bound_to_and_anything_else_to_triage(
        engine: Engine, clock: FakeClock, drawn: list[tuple[Sender, str | None]], bound: set[str],
        many: bool) -> None:
    user_id = fresh_user(engine, clock)
    with write(engine) as conn:
        task_sessions = {}
        for key in sorted(bound):
            task_sessions[key] = sessions.create_session(conn, user_id=user_id, now=clock.now())
            control.create_task(conn, user_id=user_id, session_id=task_sessions[key], title=key, now=clock.now(),
                                task_keys=[key])
    results = deliver(engine, clock, [s.delivery(user_id, f"{user_id}-{i}", key) for i, (s, key) in enumerate(drawn)],
                      many=many)
    with read(engine) as conn:
        triage = conn.execute(select(triage_sessions.c.session_id)
                              .where(triage_sessions.c.user_id == user_id)).scalar()
    for (_, key), result in zip(drawn, results, strict=True):
        assert result.status == EventStatus.PENDING and not result.duplicate
        assert result.session_id == task_sessions.get(key or "", triage), key
