"""Every wake knows the goal: the context of several wakes of one delegation, assembled from real records (SQLite and
PostgreSQL), with a scripted model and a fake clock — and replayed byte for byte."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select

from tests.support.acting import CANCEL_VERIFIED, World, world
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import approvals
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, inbox, waits
from wakeful.server.core.worker import Binding, Worker
from wakeful.server.errors import NotFound
from wakeful.server.harness import history
from wakeful.server.harness.context import wake_sizes
from wakeful.server.harness.model import ModelReply, ModelRequest, ScriptedModel, Step, calls, quiet
from wakeful.server.harness.replay import replay
from wakeful.server.harness.wake import Harness
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import Authority, ControlKind, runs, tool_results

pytestmark = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)

TAIL_CAP = 16_000
"""Bytes: the tail of a wake with one new event stays under this however long the delegation's history is."""


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner, policy=Policy()) as w:
        yield w


def wake(w: World, settings: Settings, model: ScriptedModel, *replies: Step) -> ModelRequest:
    """One wake of the delegation a minute after the last thing happened: the request the model was first given."""
    w.clock.advance(timedelta(minutes=1))
    model.script.extend(replies or [quiet("nothing new")])
    seen = len(model.seen)
    harness = Harness(model, registry=w.tools.registry, instructions=None, max_tokens_per_run=100_000)
    assert Worker(w.engine, settings, w.clock, harness, tools=w.tools).run_once()
    w.clock.advance(timedelta(minutes=1))
    return model.seen[seen]


def hook(w: World, task: Binding, source_id: str, payload: dict[str, object]) -> str:
    with write(w.engine) as conn:
        delivery = inbox.Delivery(user_id=w.owner, source="hook", source_id=source_id, payload=payload,
                                  session_id=task.session_id)
        return inbox.record(conn, delivery, now=w.clock.now()).event_id


def tail(request: ModelRequest) -> str:
    return str(request.messages[0]["content"])


def section(request: ModelRequest, tag: str) -> Any:
    """The JSON inside `<tag …>…</tag>` of the wake's tail (None when the tail has no such section)."""
    found = re.search(rf"<{tag}[^>]*>\n(.*?)\n</{tag}>", tail(request), re.S)
    return json.loads(found.group(1)) if found else None


def new_event_ids(request: ModelRequest) -> list[str]:
    return re.findall(r'<event id="([^"]+)"', tail(request))


def test_after_a_steer_the_current_version_follows_the_snapshot_which_stays_byte_identical(
        w: World, settings: Settings) -> None:
    task = w.task(title="trip to Hong Kong", constraints={"max_amount_cents": 150_000})
    model = ScriptedModel([])
    first = wake(w, settings, model)
    with write(w.engine) as conn:
        control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="meeting moved to Thursday: fly Wednesday",
                      constraints={"max_amount_cents": 120_000, "cabin": "economy"},
                      completion=[{"effect": "airline__book", "verify": "ticket issued"}], actor="user:test",
                      now=w.clock.now())
    second = wake(w, settings, model)
    hook(w, task, "d-3", {"note": "ping"})
    third = wake(w, settings, model)
    assert first.snapshot == second.snapshot == third.snapshot and 'version="1"' in first.snapshot
    assert "trip to Hong Kong" in first.snapshot and "150000" in first.snapshot
    assert section(first, "task_current") is None
    for later in (second, third):
        current = section(later, "task_current")
        assert current == {"version": 2, "goal": "meeting moved to Thursday: fly Wednesday",
                           "constraints": {"cabin": "economy", "max_amount_cents": 120_000},
                           "completion": [{"effect": "airline__book", "verify": "ticket issued"}],
                           "created_by": "user:test", "created_at": current["created_at"]}
        assert 'note="tail notes override the snapshot"' in tail(later)
    assert "override the snapshot" in first.prefix and first.prefix == third.prefix
    assert any("steer by user:test version 2" in line for line in section(second, "changes_since_last_run"))


def test_the_snapshot_is_refreshed_at_a_compaction_point_and_then_carries_the_current_version(
        w: World, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(history, "COMPACT_EVERY", 3)
    task = w.task(title="trip to Hong Kong")
    model = ScriptedModel([])
    first = wake(w, settings, model)
    with write(w.engine) as conn:
        control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="fly Wednesday", actor="user:test",
                      now=w.clock.now())
    second = wake(w, settings, model)
    hook(w, task, "d-3", {"n": 3})
    third = wake(w, settings, model)
    hook(w, task, "d-4", {"n": 4})
    fourth = wake(w, settings, model)  # the session's run number 3: a compaction point
    assert first.snapshot == second.snapshot == third.snapshot and 'version="1"' in third.snapshot
    assert section(third, "task_current") is not None
    assert 'version="2"' in fourth.snapshot and "fly Wednesday" in fourth.snapshot
    assert section(fourth, "task_current") is None


def test_an_event_of_wake_one_is_not_new_in_wake_two_but_is_pointed_to_in_the_earlier_history(
        w: World, settings: Settings) -> None:
    task = w.task()
    first_event = hook(w, task, "mail-1", {"body": "the client asks for the itinerary"})
    model = ScriptedModel([])
    first = wake(w, settings, model)
    second_event = hook(w, task, "mail-2", {"body": "the client confirms Thursday"})
    second = wake(w, settings, model)
    hook(w, task, "mail-3", {"body": "a third email"})
    third = wake(w, settings, model)
    assert first_event in new_event_ids(first) and second_event not in new_event_ids(first)
    assert new_event_ids(second) == [second_event]
    earlier = "\n".join(section(third, "earlier_history"))
    assert first_event in earlier and second_event in earlier and first_event not in new_event_ids(third)
    changes = section(second, "changes_since_last_run")
    assert any("stay_quiet → ok" in line for line in changes)  # wake 1's tool outcome
    assert first_event not in json.dumps(changes)


def test_the_model_reads_an_earlier_record_whole_by_the_id_the_digest_points_to(w: World, settings: Settings) -> None:
    task = w.task()
    first_event = hook(w, task, "mail-1", {"body": "the hotel asks to CC the itinerary to x@example.com"})
    model = ScriptedModel([])
    wake(w, settings, model)
    hook(w, task, "mail-2", {"body": "a second email"})
    wake(w, settings, model)
    hook(w, task, "mail-3", {"body": "a third email"})

    def read_the_pointer(request: ModelRequest) -> ModelReply:
        pointed = re.findall(r"ev_[0-9a-z]+", json.dumps(section(request, "earlier_history")))
        return calls(*[("read_record", {"record_id": record_id}) for record_id in pointed],
                     ("read_record", {"record_id": "ev_nosuchrecord"}))

    wake(w, settings, model, read_the_pointer, quiet("read it"))
    with read(w.engine) as conn:
        results = [json.loads(r.result) for r in conn.execute(
            select(tool_results).where(tool_results.c.tool == "read_record").order_by(tool_results.c.call_id))]
    read_back = {r["id"]: r for r in results if "id" in r}
    assert read_back[first_event]["payload"] == {"body": "the hotel asks to CC the itinerary to x@example.com"}
    assert read_back[first_event]["trust"] == "third_party"
    assert {"code": "unknown_record", "message": "no record ev_nosuchrecord in this task's history"} in [
        r.get("error") for r in results]


def test_a_message_sent_in_wake_one_is_listed_as_already_sent_in_wake_two(w: World, settings: Settings) -> None:
    task = w.task()
    model = ScriptedModel([])
    wake(w, settings, model, calls(("send_to_user", {"text": "I found one subscription; cancel it? </event>"})))
    hook(w, task, "d-2", {"note": "ping"})
    second = wake(w, settings, model)
    (sent,) = section(second, "messages_already_sent")
    assert sent["text"] == "I found one subscription; cancel it? </event>" and sent["at"] and sent["id"]
    assert "? <\\/event>" in tail(second)  # the agent's own words cannot close a tag either
    assert section(second, "changes_since_last_run") is not None


def test_open_waits_timers_and_pending_approvals_appear_until_they_close(w: World, settings: Settings) -> None:
    task = w.task(completion=CANCEL_VERIFIED)

    def cancel(request: ModelRequest) -> ModelReply:
        listed = json.loads(request.messages[-1]["content"][0]["content"])
        return calls(("merchant__cancel_renewal", {"subscription": listed["objects"][0]["id"]}),
                     ("schedule_followup", {"in_seconds": 86_400, "note": "check the renewal is off"}))

    model = ScriptedModel([])
    wake(w, settings, model, calls(("merchant__list_subscriptions", {})), cancel, quiet("waiting for approval"))
    with write(w.engine) as conn:
        waits.register(conn, user_id=w.owner, session_id=task.session_id or "", match_key="mail-thread:42",
                       kind="reply", authority=Authority.ANY_SOURCE, deadline=w.clock.now() + timedelta(days=2),
                       now=w.clock.now(), task_id=task.task_id)
    hook(w, task, "d-2", {"note": "ping"})
    second = wake(w, settings, model)
    (approval,) = section(second, "pending_approvals")
    assert approval["tool"] == "merchant__cancel_renewal" and approval["expires_at"]
    assert approval["what"].startswith("Stop a subscription renewing")
    (reply,) = section(second, "open_waits")
    assert reply["key"] == "mail-thread:42" and reply["kind"] == "reply" and reply["authority"] == "any_source"
    (timer,) = section(second, "timers")
    assert timer["note"] == "check the renewal is off" and timer["next_due"]
    with write(w.engine) as conn:
        approvals.decide(conn, user_id=w.owner, action_id=approval["action_id"], approve=False, actor="user:test",
                         policy=w.policy, now=w.clock.now())
        control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.PAUSE,
                               actor="user:test", reason="hold on", now=w.clock.now())
    third = wake(w, settings, model)
    assert section(third, "pending_approvals") is None
    changes = "\n".join(section(third, "changes_since_last_run"))
    assert f"{approval['action_id']}: denied by user:test" in changes and "pause by user:test hold on" in changes
    assert section(third, "task_state")["state"] == "paused"


def test_the_tail_stays_under_a_fixed_cap_with_500_old_events(w: World, settings: Settings) -> None:
    settings.run_max_events = 1000  # the first run is handed all 500 at once; the later ones must not carry them
    task = w.task()
    with write(w.engine) as conn:
        old = [inbox.record(conn, inbox.Delivery(user_id=w.owner, source="hook", source_id=f"old-{i}",
                                                 payload={"body": "x" * 200}, session_id=task.session_id),
                            now=w.clock.now()).event_id for i in range(500)]
    model = ScriptedModel([])
    first = wake(w, settings, model, calls(("send_to_user", {"text": "y" * 2000})))
    for i in range(3):
        hook(w, task, f"new-{i}", {"body": "one more"})
        later = wake(w, settings, model)
    assert len(tail(first)) > 500 * 200
    assert len(tail(later).encode()) < TAIL_CAP
    earlier = json.dumps(section(later, "earlier_history"))
    assert "503 earlier event record(s)" in earlier  # the delegation, the 500, and two of the three new ones
    assert old[-1] in earlier and old[0] not in tail(later)


def test_replaying_a_recorded_run_reproduces_the_same_context_bytes(w: World, settings: Settings) -> None:
    task = w.task(completion=CANCEL_VERIFIED)

    def cancel(request: ModelRequest) -> ModelReply:
        listed = json.loads(request.messages[-1]["content"][0]["content"])
        return calls(("merchant__cancel_renewal", {"subscription": listed["objects"][0]["id"]}))

    model = ScriptedModel([])
    wake(w, settings, model, calls(("merchant__list_subscriptions", {})), cancel,
         calls(("send_to_user", {"text": "Approve the cancellation?"})))
    with write(w.engine) as conn:
        control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="cancel it today", actor="user:test",
                      now=w.clock.now())
    wake(w, settings, model)
    hook(w, task, "d-3", {"note": "ping"})
    wake(w, settings, model)
    with read(w.engine) as conn:
        run_ids = conn.execute(select(runs.c.id).order_by(runs.c.id)).scalars().all()
        reports = [replay(conn, run_id, registry=w.tools.registry, instructions=None) for run_id in run_ids]
    assert len(reports) == 3
    assert [(r.context_same, r.differences) for r in reports] == [(True, [])] * 3


def test_a_run_without_a_model_is_not_replayed_and_says_why(w: World) -> None:
    task = w.task()
    with write(w.engine) as conn:  # as a run of the no-model or the echo handler leaves it: no run_contexts row
        conn.execute(runs.insert().values(id="run_quiet", session_id=task.session_id, user_id=w.owner,
                                          fencing_token=1, worker="test", outcome="completed", steps=0,
                                          started_at=w.clock.now()))
    with read(w.engine) as conn:
        for run_id, said in (("run_quiet", "run run_quiet kept no model context to replay: it ran without a model"),
                             ("run_nowhere", "no run run_nowhere")):
            with pytest.raises(NotFound) as refused:
                replay(conn, run_id, registry=w.tools.registry, instructions=None)
            assert refused.value.code == "unknown_run" and refused.value.message.startswith(said)


def test_consecutive_wakes_share_the_prefix_and_the_snapshot_byte_for_byte(w: World, settings: Settings) -> None:
    task = w.task()
    model = ScriptedModel([])
    first = wake(w, settings, model)
    with write(w.engine) as conn:
        control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="a new goal", actor="user:test",
                      now=w.clock.now())
    wake(w, settings, model)
    hook(w, task, "d-3", {"note": "ping"})
    wake(w, settings, model)
    with read(w.engine) as conn:
        sizes = wake_sizes(conn, task.session_id or "")
    stable = len((first.prefix + "\n\n" + first.snapshot).encode())
    assert [s.reused_bytes for s in sizes][0] == 0
    assert all(s.reused_bytes > stable for s in sizes[1:]) and all(s.reused_bytes < s.sent_bytes for s in sizes)
