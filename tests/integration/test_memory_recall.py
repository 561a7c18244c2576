"""Recall: which memory records a wake's context carries, read as of the run's start (SQLite and PostgreSQL), with a
scripted model and a fake clock. Records are written through the committer (`memory.propose`), as the user or the
agent would write them; the context is read back as the model was given it, and replayed byte for byte."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select

from tests.support.acting import World, world
from wakeful.proxy.clock import FakeClock
from wakeful.server import memory
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, inbox, keys
from wakeful.server.core.worker import Binding, Worker
from wakeful.server.harness.context import MEMORY_NOTE
from wakeful.server.harness.model import ModelRequest, ScriptedModel, quiet
from wakeful.server.harness.replay import replay
from wakeful.server.harness.wake import Harness
from wakeful.server.memory.recall import LIMIT, focus
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import ControlKind, EventKind, memory_uses, runs, task_versions
from wakeful.server.store.users import ensure_user

pytestmark = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner, policy=Policy()) as w:
        yield w


def remember(w: World, *, user_id: str | None = None, agent: bool = False, **proposal: Any) -> str:
    """A record written through the committer: by the user (active, their own word), or by the agent."""
    actor = memory.Actor(kind=memory.ActorKind.AGENT if agent else memory.ActorKind.USER, name="test")
    proposal = {"text": f"{proposal['subject']} {proposal['relation']} {proposal['value']}"} | proposal
    with write(w.engine) as conn:
        stored = memory.propose(conn, user_id=user_id or w.owner, actor=actor,
                                proposal=memory.Proposal.model_validate(proposal), now=w.clock.now())
    return stored.memory_id


def window(w: World) -> str:
    return remember(w, form="preference", text="The user prefers a window seat.", subject="seat", relation="prefers",
                    value="window", scope="always", topics=["flight", "airline"])


def hook(w: World, task: Binding, source: str, n: int = 1) -> None:
    with write(w.engine) as conn:
        inbox.record(conn, inbox.Delivery(user_id=w.owner, source=source, source_id=f"{source}-{n}",
                                          payload={"n": n}, session_id=task.session_id), now=w.clock.now())


def wake(w: World, settings: Settings, model: ScriptedModel) -> ModelRequest:
    """One wake a minute after the last thing happened: the request the model was first given."""
    w.clock.advance(timedelta(minutes=1))
    model.script.append(quiet("nothing new"))
    seen = len(model.seen)
    harness = Harness(model, registry=w.tools.registry, instructions=None, max_tokens_per_run=100_000)
    assert Worker(w.engine, settings, w.clock, harness, tools=w.tools).run_once()
    w.clock.advance(timedelta(minutes=1))
    return model.seen[seen]


def recalled(request: ModelRequest) -> list[dict[str, Any]]:
    """The records inside the wake's `<memory>` block, one JSON object a line."""
    block = _block(request)
    return [json.loads(line) for line in block.splitlines() if line.startswith("{")]


def _block(request: ModelRequest) -> str:
    found = re.search(r'<memory note="([^"]*)">\n(.*?)\n</memory>', str(request.messages[0]["content"]), re.S)
    assert found is not None and found.group(1) == MEMORY_NOTE
    return found.group(2)


def ids(request: ModelRequest) -> list[str]:
    return [r["id"] for r in recalled(request)]


def direct(w: World, task: Binding | None, *, sources: tuple[str, ...] = ("airline",), user_id: str | None = None,
           run_id: str = "run_none") -> memory.Recall:
    """What a wake of `task` with one webhook from each of `sources` would recall now."""
    with read(w.engine) as conn:
        goal = "" if task is None else control_goal(conn, task)
        now = w.clock.now()
        found = focus(conn, task_id=task.task_id if task else None, goal=goal, sources=sources, now=now)
        return memory.recall(conn, user_id=user_id or w.owner, task_id=task.task_id if task else None, run_id=run_id,
                             event_kinds=["webhook"] * len(sources), focus=found, now=now)


def control_goal(conn: Any, task: Binding) -> str:
    return str(conn.execute(select(task_versions.c.goal).where(task_versions.c.task_id == task.task_id)
                            .order_by(task_versions.c.version.desc())).scalars().first())


def test_a_standing_instruction_is_recalled_on_every_wake_whatever_the_wake_is_about(
        w: World, settings: Settings) -> None:
    instruction = remember(w, form="instruction", text="Never book a red-eye flight.", subject="flight.departure",
                           relation="avoids", value="red-eye", scope="always")
    seat = window(w)
    task = w.task(title="cancel my gym subscription")
    first = recalled(wake(w, settings, ScriptedModel([])))
    assert [r["id"] for r in first] == [instruction] and seat not in json.dumps(first)
    assert first[0] == {"id": instruction, "version": 1, "form": "instruction", "text": "Never book a red-eye flight.",
                        "speaker": "user", "speaker_name": "owner", "scope": "always", "valid_until": None,
                        "confirmed": first[0]["confirmed"]} and first[0]["confirmed"]
    hook(w, task, "airline")
    assert ids(wake(w, settings, ScriptedModel([]))) == [instruction, seat]


def test_a_trip_only_aisle_overrides_the_always_window_inside_its_task_and_the_window_is_back_elsewhere_and_after_close(
        w: World, settings: Settings) -> None:
    seat = window(w)
    trip, other = w.task(title="fly to Hong Kong"), w.task(title="fly to Tokyo")
    aisle = remember(w, form="preference", text="Aisle seat for this trip only.", subject="seat", relation="prefers",
                     value="aisle", scope="task", scope_ref=trip.task_id)
    w.clock.advance(timedelta(minutes=1))
    inside = direct(w, trip)
    assert inside.ids == (aisle,) and [o.to_json() for o in inside.overrides] == [
        {"id": seat, "scope": "always", "overridden_by": aisle}]
    assert direct(w, other).ids == (seat,) and not direct(w, other).overrides
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=trip.task_id, kind=ControlKind.CLOSE, actor="user:test",
                               reason="back home", now=w.clock.now())
    w.clock.advance(timedelta(seconds=1))
    assert direct(w, trip).ids == (seat,), "the aisle expired with its task; the window is in force again"
    with read(w.engine) as conn:
        shown = memory.show(conn, w.owner, seat)
        aisle_now = memory.show(conn, w.owner, aisle)["record"]
    assert len(shown["versions"]) == 1 and shown["record"]["state"] == "active"  # the window was never rewritten
    assert (aisle_now["state"], aisle_now["retire_reason"]) == ("retired", "expired")


def test_a_preference_past_its_valid_until_is_not_recalled_and_a_replay_of_an_earlier_wake_still_recalls_it(
        w: World, settings: Settings) -> None:
    task = w.task(title="fly to Hong Kong")
    until = w.clock.now() + timedelta(hours=1)
    expiring = remember(w, form="preference", text="Until the fare sale ends, prefer the cheapest fare.",
                        subject="fare", relation="prefers", value="cheapest", scope="always", topics=["airline"],
                        valid_until=until.isoformat())
    model = ScriptedModel([])
    hook(w, task, "airline", 1)
    first = wake(w, settings, model)
    assert ids(first) == [expiring] and recalled(first)[0]["valid_until"] == until.isoformat()
    w.clock.advance(timedelta(hours=2))
    hook(w, task, "airline", 2)
    assert ids(wake(w, settings, model)) == []
    _replays_alike(w)


def test_a_pending_hypothesis_is_never_recalled(w: World) -> None:
    task = w.task(title="fly to Hong Kong")
    with write(w.engine) as conn:
        choice = inbox.record(conn, inbox.Delivery(  # what it was inferred from: the user picked the 07:10 flight
            user_id=w.owner, source="chat", source_id="chat-0710", kind=EventKind.MESSAGE, trust="user",
            authority="user", session_id=task.session_id, payload={"text": "the 07:10 one, please"}),
            now=w.clock.now()).event_id
        stored = memory.propose(conn, user_id=w.owner, actor=memory.Actor(kind=memory.ActorKind.AGENT, name="test"),
                                proposal=memory.Proposal.model_validate({
                                    "form": "hypothesis", "text": "The user may prefer early flights.",
                                    "subject": "flight.departure", "relation": "prefers", "value": "early",
                                    "scope": "always", "confidence": 0.6, "topics": ["airline"],
                                    "evidence": [{"type": "event", "id": choice}]}),
                                now=w.clock.now())
    assert stored.state == "pending"
    w.clock.advance(timedelta(minutes=1))
    assert direct(w, task).records == ()


def test_a_forgotten_record_is_recalled_only_as_of_before_it_was_forgotten(w: World, settings: Settings) -> None:
    seat = window(w)
    task = w.task(title="fly to Hong Kong")
    model = ScriptedModel([])
    hook(w, task, "airline", 1)
    first = wake(w, settings, model)
    assert ids(first) == [seat]
    with write(w.engine) as conn:
        reach = memory.forget(conn, w.owner, seat, reason="I fly aisle now", now=w.clock.now()).reach
    assert reach is not None and list(reach.runs) == [first_run(w)]  # the run that recalled it is named
    hook(w, task, "airline", 2)
    second = wake(w, settings, model)
    assert ids(second) == [] and "corrected_since" in _block(second) and seat in _block(second)
    hook(w, task, "airline", 3)
    assert seat not in _block(wake(w, settings, model)), "told once, on the next wake"
    _replays_alike(w)


def test_a_hotel_record_is_not_recalled_for_an_airline_event_but_is_for_a_hotel_one(w: World) -> None:
    floor = remember(w, form="preference", text="The user prefers a high floor.", subject="hotel.floor",
                     relation="prefers", value="high", scope="always", topics=["hotel"])
    task = w.task(title="fly to Hong Kong")
    w.clock.advance(timedelta(minutes=1))
    assert direct(w, task, sources=("airline",)).ids == ()
    assert direct(w, task, sources=("hotel",)).ids == (floor,)


def test_the_focus_is_the_event_sources_the_goal_words_and_the_key_prefixes(w: World) -> None:
    task = w.task(title="Rebook the flights to Hong Kong if the typhoon cancels them")
    with write(w.engine) as conn:
        keys.bind(conn, user_id=w.owner, task_id=task.task_id, keys=["PNR123", "thr-hk-meeting"], actor="user:test",
                  reason="", now=w.clock.now())
    w.clock.advance(timedelta(minutes=1))
    with read(w.engine) as conn:
        found = focus(conn, task_id=task.task_id, goal=control_goal(conn, task), sources=["airline"],
                      now=w.clock.now())
    assert found == ("airline", "rebook", "flights", "flight", "hong", "kong", "typhoon", "cancels", "cancel", "pnr",
                     "thr")


def test_an_empty_recall_is_rendered_as_such(w: World, settings: Settings) -> None:
    w.task(title="fly to Hong Kong")
    request = wake(w, settings, ScriptedModel([]))
    assert _block(request) == "(nothing recalled: no record in force fits this wake)"


def test_the_run_records_which_versions_it_recalled(w: World, settings: Settings) -> None:
    seat = window(w)
    task = w.task(title="fly to Hong Kong")
    hook(w, task, "airline")
    wake(w, settings, ScriptedModel([]))
    with read(w.engine) as conn:
        run_id = conn.execute(select(runs.c.id)).scalar_one()
        assert conn.execute(select(memory_uses.c.run_id, memory_uses.c.memory_id)).all() == [(run_id, seat)]


def test_another_users_records_are_never_recalled(w: World, settings: Settings) -> None:
    with write(w.engine) as conn:
        stranger, _ = ensure_user(conn, name="stranger", now=w.clock.now())
    theirs = [remember(w, user_id=stranger, form="instruction", text="Always fly business.", subject="cabin",
                       relation="prefers", value="business", scope="always"),
              remember(w, user_id=stranger, form="preference", text="Window, always.", subject="seat",
                       relation="prefers", value="window", scope="always", topics=["airline"])]
    mine = window(w)
    task = w.task(title="fly to Hong Kong")
    hook(w, task, "airline")
    request = wake(w, settings, ScriptedModel([]))
    assert ids(request) == [mine] and not any(t in str(request.messages[0]["content"]) for t in theirs)
    assert direct(w, task, user_id=stranger).ids == tuple(theirs)  # in their own recall only


def test_a_statement_is_tagged_as_the_users_stance(w: World) -> None:
    with write(w.engine) as conn:
        said = memory.propose(conn, user_id=w.owner, actor=memory.Actor(kind=memory.ActorKind.USER, name="test"),
                              proposal=memory.Proposal.model_validate({
                                  "form": "statement", "text": "On D3 the user said this airline never delays.",
                                  "subject": "airline.punctuality", "relation": "said", "value": "never delays",
                                  "scope": "always", "topics": ["airline"]}), now=w.clock.now()).memory_id
    task = w.task(title="fly to Hong Kong")
    w.clock.advance(timedelta(minutes=1))
    item = direct(w, task).records[0].to_json()
    assert item["id"] == said and item["stance"] is True and item["said_at"]


def first_run(w: World) -> str:
    with read(w.engine) as conn:
        return str(conn.execute(select(runs.c.id).order_by(runs.c.id)).scalars().first())


def _replays_alike(w: World) -> None:
    with read(w.engine) as conn:
        run_ids = conn.execute(select(runs.c.id).order_by(runs.c.id)).scalars().all()
        reports = [replay(conn, run_id, registry=w.tools.registry, instructions=None) for run_id in run_ids]
    assert [(r.context_same, r.differences) for r in reports] == [(True, [])] * len(run_ids)



def test_recall_is_bounded_in_a_fixed_order_the_narrower_and_better_matching_first(w: World) -> None:
    task = w.task(title="fly to Hong Kong")
    wide = []
    for n in range(14):
        w.clock.advance(timedelta(seconds=1))
        wide.append(remember(w, form="episode", text=f"Rebooked flight {n} during a storm.", subject=f"rebooking.{n}",
                             relation="went", value="ok", scope="always", topics=["airline"]))
    both = remember(w, form="episode", text="Rebooked the Hong Kong flight.", subject="rebooking.hk", relation="went",
                    value="ok", scope="always", topics=["airline", "hong"])
    own = remember(w, form="preference", text="Meals: vegetarian on this trip.", subject="meal", relation="prefers",
                   value="vegetarian", scope="task", scope_ref=task.task_id)
    w.clock.advance(timedelta(minutes=1))
    found = direct(w, task)
    assert found.ids[:2] == (own, both) and len(found.records) == LIMIT
    assert found.ids[2:] == tuple(reversed(wide))[:10] and found.left_out == 4  # then the newest first
    assert direct(w, task) == found
