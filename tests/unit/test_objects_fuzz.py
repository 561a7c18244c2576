"""Fuzzing `server.objects.resolve` on a real SQLite file: an ID resolves only when it is exactly one the server
minted for this user, task, task version and kind, and has not expired; everything else is `unknown_object`."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine

from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.objects import IssuedObject, UnknownObject, mint, resolve
from wakeful.server.core import control, sessions
from wakeful.server.store.db import read, write
from wakeful.server.store.users import ensure_user

KINDS = ("subscription", "quote", "flight")
TTL = timedelta(hours=6)
SHORT_TTL = timedelta(minutes=1)
OFFSETS = (timedelta(0), timedelta(seconds=30), SHORT_TTL - timedelta(microseconds=1), SHORT_TTL,
           SHORT_TTL + timedelta(seconds=1), TTL - timedelta(seconds=1), TTL, TTL + timedelta(days=1))


@dataclass(frozen=True, kw_only=True)
class Minted:
    id: str
    user: str
    task: str
    version: int
    kind: str
    ref: str
    snapshot: dict[str, Any]
    expires_at: datetime


@dataclass(frozen=True, kw_only=True)
class Context:
    user: str
    task: str
    version: int
    kind: str
    now: datetime


@dataclass(frozen=True, kw_only=True)
class Universe:
    start: datetime
    users: tuple[str, ...]
    tasks: tuple[str, ...]
    objects: tuple[Minted, ...]

    @property
    def by_id(self) -> dict[str, Minted]:
        return {o.id: o for o in self.objects}


@pytest.fixture
def universe(engine: Engine, clock: FakeClock, owner: str) -> Universe:
    """Two users; the owner's two tasks (the first steered to version 2) and the other user's one; objects of
    several kinds in each, one of them short-lived."""
    now = clock.now()
    with write(engine) as conn:
        other, _ = ensure_user(conn, name="other", now=now)
        tasks = []
        for user in (owner, owner, other):
            session_id = sessions.create_session(conn, user_id=user, now=now)
            tasks.append(control.create_task(conn, user_id=user, session_id=session_id, title="errand", now=now))
        control.steer(conn, user_id=owner, task_id=tasks[0], goal="v2", actor="user:test", now=now)
        plan = [(owner, tasks[0], 1, "subscription", TTL), (owner, tasks[0], 2, "subscription", TTL),
                (owner, tasks[0], 2, "quote", TTL), (owner, tasks[0], 2, "quote", SHORT_TTL),
                (owner, tasks[0], 2, "flight", TTL), (owner, tasks[1], 1, "subscription", TTL),
                (owner, tasks[1], 1, "quote", SHORT_TTL), (other, tasks[2], 1, "subscription", TTL),
                (other, tasks[2], 1, "flight", TTL)]
        minted = []
        for n, (user, task, version, kind, ttl) in enumerate(plan):
            ref, snapshot = f"ext-{kind}-{n}", {"n": n, "price_cents": 100 * n, "currency": "EUR"}
            object_id = mint(conn, user_id=user, task_id=task, task_version=version, kind=kind, connector="sim",
                             ref=ref, operation=f"sim__read_{kind}", snapshot=snapshot, now=now, ttl=ttl)
            minted.append(Minted(id=object_id, user=user, task=task, version=version, kind=kind, ref=ref,
                                 snapshot=snapshot, expires_at=now + ttl))
    return Universe(start=now, users=(owner, other), tasks=tuple(tasks), objects=tuple(minted))


def expected(u: Universe, candidate: object, ctx: Context) -> Minted | None:
    obj = u.by_id.get(candidate) if isinstance(candidate, str) else None
    if obj is None or (obj.user, obj.task, obj.version, obj.kind) != (ctx.user, ctx.task, ctx.version, ctx.kind):
        return None
    return obj if ctx.now < obj.expires_at else None


def check(engine: Engine, u: Universe, candidate: object, ctx: Context) -> IssuedObject | None:
    want = expected(u, candidate, ctx)
    with read(engine) as conn:
        if want is not None:
            got = resolve(conn, candidate, user_id=ctx.user, task_id=ctx.task, task_version=ctx.version,
                          kind=ctx.kind, now=ctx.now)
            assert (got.id, got.kind, got.ref, got.snapshot, got.expires_at) == (
                want.id, want.kind, want.ref, want.snapshot, want.expires_at)
            assert got.operation == f"sim__read_{want.kind}"
            return got
        with pytest.raises(UnknownObject) as refused:
            resolve(conn, candidate, user_id=ctx.user, task_id=ctx.task, task_version=ctx.version, kind=ctx.kind,
                    now=ctx.now)
    assert refused.value.code == "unknown_object" and refused.value.http_status == 403
    real = u.by_id.get(candidate) if isinstance(candidate, str) else None
    if real is None or real.user != ctx.user:
        # Another user's ID is indistinguishable from one that was never issued.
        assert refused.value.why in ("never issued", "not a string")
    if real is not None:
        assert real.ref not in refused.value.message  # the refusal never leaks what the ID stands for
    return None


# -- strategies ---------------------------------------------------------------------------------------------------


def mutate(object_id: str, how: str, n: int, char: str) -> str:
    i = n % len(object_id)
    if how == "truncated":
        return object_id[:i]
    if how == "extended":
        return object_id + char
    if how == "case":
        if n % 2:
            return object_id.upper()
        letters = [k for k, c in enumerate(object_id) if c.isalpha()]  # "obj" at least
        k = letters[n % len(letters)]
        return object_id[:k] + object_id[k].swapcase() + object_id[k + 1:]
    if how == "one_char":
        replacement = char if char != object_id[i] else ("0" if object_id[i] != "0" else "1")
        return object_id[:i] + replacement + object_id[i + 1:]
    if how == "padded":
        return (" ", "\n", "\t", "\x00")[n % 4] + object_id if n % 2 else object_id + (" ", "\n", "%00", "\x00")[n % 4]
    if how == "prefix":
        return ("act_", "OBJ_", "obj-", "")[n % 4] + object_id.removeprefix("obj_")
    if how == "sql":
        return (f"{object_id}' OR '1'='1", f"{object_id}%", "%", "_" * len(object_id), f"{object_id}' --")[n % 5]
    raise AssertionError(how)


MUTATIONS = ("truncated", "extended", "case", "one_char", "padded", "prefix", "sql")
ID_CHARS = st.sampled_from("0123456789abcdefghjkmnpqrstvwxyzilouABCZ_-%")


@st.composite
def contexts(draw: st.DrawFn, u: Universe, near: Minted | None) -> Context:
    now = u.start + draw(st.sampled_from(OFFSETS))
    if near is not None and draw(st.booleans()):  # most often the object's own binding: the interesting edge
        return Context(user=near.user, task=near.task, version=near.version, kind=near.kind, now=now)
    return Context(user=draw(st.sampled_from(u.users)), task=draw(st.sampled_from(u.tasks)),
                   version=draw(st.integers(1, 3)), kind=draw(st.sampled_from(KINDS)), now=now)


@st.composite
def candidates(draw: st.DrawFn, u: Universe) -> tuple[object, Minted | None]:
    """An arbitrary value, a real ID, or a real ID mutated; with the real object it came from, if any."""
    source = draw(st.sampled_from(u.objects))
    choice = draw(st.sampled_from(["text", "id_like", "exact", "exact", "mutated", "mutated", "not_a_string"]))
    if choice == "text":
        return draw(st.text(max_size=60)), None
    if choice == "id_like":
        return "obj_" + draw(st.text(ID_CHARS, min_size=0, max_size=30)), None
    if choice == "exact":
        return source.id, source
    if choice == "not_a_string":
        return draw(st.one_of(st.none(), st.integers(), st.binary(max_size=30), st.lists(st.text(max_size=5)),
                              st.just(source.id.encode()), st.just([source.id]))), None
    mutated = mutate(source.id, draw(st.sampled_from(MUTATIONS)), draw(st.integers(0, 200)), draw(ID_CHARS))
    return mutated, source


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_resolve_accepts_exactly_the_ids_minted_for_this_binding_and_nothing_else(
        engine: Engine, universe: Universe, data: st.DataObject) -> None:
    # The universe is minted once per test and only read here, so sharing it across examples is sound.
    candidate, near = data.draw(candidates(universe))
    ctx = data.draw(contexts(universe, near))
    event("resolved" if check(engine, universe, candidate, ctx) is not None else "unknown_object")


# -- the same properties, enumerated (independent of what the fuzzer happens to draw) ------------------------------


def own(obj: Minted, now: datetime) -> Context:
    return Context(user=obj.user, task=obj.task, version=obj.version, kind=obj.kind, now=now)


def test_every_minted_id_resolves_in_its_own_binding_until_it_expires(engine: Engine, universe: Universe) -> None:
    for obj in universe.objects:
        assert check(engine, universe, obj.id, own(obj, universe.start)) is not None
        assert check(engine, universe, obj.id, own(obj, obj.expires_at - timedelta(microseconds=1))) is not None
        assert check(engine, universe, obj.id, own(obj, obj.expires_at)) is None  # expiry is exclusive
        assert check(engine, universe, obj.id, own(obj, obj.expires_at + timedelta(days=1))) is None


def test_a_minted_id_resolves_in_no_other_binding(engine: Engine, universe: Universe) -> None:
    for obj in universe.objects:
        for user in universe.users:
            for task in universe.tasks:
                for version in (1, 2, 3):
                    for kind in KINDS:
                        ctx = Context(user=user, task=task, version=version, kind=kind, now=universe.start)
                        resolved = check(engine, universe, obj.id, ctx)
                        assert (resolved is not None) == ((user, task, version, kind) ==
                                                          (obj.user, obj.task, obj.version, obj.kind))


@pytest.mark.parametrize("how", MUTATIONS)
def test_no_mutation_of_a_real_id_resolves(engine: Engine, universe: Universe, how: str) -> None:
    for obj in universe.objects:
        for n in range(0, 60, 7):
            for char in "0az_A":
                candidate = mutate(obj.id, how, n, char)
                assert candidate != obj.id
                assert check(engine, universe, candidate, own(obj, universe.start)) is None
