"""Helper tasks over real records and the airline simulator on loopback, with scripted models: the helper starts from
its handoff alone, may only read, returns its result as an event carrying the version it was based on, its IDs are
its own, and it stops with its task."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select

from tests.support.acting import World, world
from tests.support.records import messages
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, inbox
from wakeful.server.core.worker import Binding, Worker
from wakeful.server.errors import Refused
from wakeful.server.harness.helper_run import HELPER_PROMPT
from wakeful.server.harness.model import ModelReply, ModelRequest, ScriptedModel, calls, quiet
from wakeful.server.harness.wake import Harness
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import (
    ControlKind,
    RunOutcome,
    actions,
    events,
    helpers,
    refusals,
    runs,
    timers,
    tool_results,
)

HANDOFF = {"goal": "compare today's AMS to LIS flights for the trip", "constraints": ["morning departures first"],
           "output_form": "one line per flight: number, departs, price"}


@pytest.fixture
def w(engine: Engine, clock: FakeClock, owner: str) -> Iterator[World]:
    with world(engine, clock, owner, policy=Policy()) as w:
        yield w


@dataclass
class Roles:
    """The main agent's script and the helpers' script, told apart by the context a request carries."""

    main: ScriptedModel
    helper: ScriptedModel
    name: str = "scripted"

    def complete(self, request: ModelRequest) -> ModelReply:
        return (self.helper if request.prefix.startswith(HELPER_PROMPT) else self.main).complete(request)


def worker(w: World, settings: Settings, model: Roles) -> Worker:
    harness = Harness(model, registry=w.tools.registry, instructions=None, max_tokens_per_run=100_000)
    return Worker(w.engine, settings, w.clock, harness, tools=w.tools)


def run_all(wk: Worker) -> int:
    ran = 0
    while wk.run_once():
        ran += 1
        assert ran < 20, "runs never settle"
    return ran


def day(w: World) -> str:
    return (w.clock.now() + timedelta(days=7)).date().isoformat()  # PNR123's day (`create_airline`)


def search(w: World) -> ModelReply:
    return calls(("airline__search_flights", {"from": "AMS", "to": "LIS", "date": day(w)}))


def last_result(request: ModelRequest, index: int = 0) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(request.messages[-1]["content"][index]["content"])
    return loaded


def return_flights(request: ModelRequest) -> ModelReply:
    """The helper's answer: the flights its search found, with the IDs its read returned."""
    flights = last_result(request)["objects"]
    lines = "\n".join(f"{f['flight']} {f['departs_at']} {f['price_cents']} id={f['id']}" for f in flights)
    return calls(("return_result", {"result": lines}))


def helper_row(w: World) -> Any:
    with read(w.engine) as conn:
        return conn.execute(select(helpers)).one()


def result_events(w: World) -> list[Any]:
    with read(w.engine) as conn:
        return conn.execute(select(events).where(events.c.source == "helper")).all()


def tool_errors(w: World, run_id: str) -> dict[str, str]:
    with read(w.engine) as conn:
        rows = conn.execute(select(tool_results).where(tool_results.c.run_id == run_id)).all()
    return {r.tool: json.loads(r.result)["error"]["code"] for r in rows if "error" in json.loads(r.result)}


def helper_run_id(w: World) -> str:
    """The helper's first run."""
    return _runs(w, helper_row(w).session_id)[0]


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
def test_a_helper_compares_flights_from_its_handoff_alone_and_its_result_returns_with_its_version(
        w: World, settings: Settings) -> None:
    task = w.task(title="keep my Lisbon trip on track", constraints={"max_amount_cents": 20_000})
    with write(w.engine) as conn:
        inbox.record(conn, inbox.Delivery(user_id=w.owner, source="hook", source_id="mail-1",
                                          session_id=task.session_id,
                                          payload={"body": "the client: my boss confirms on Tuesday"}),
                     now=w.clock.now())
    roles = Roles(main=ScriptedModel([calls(("start_helper", HANDOFF), ("stay_quiet", {"reason": "comparing"})),
                                      quiet("noted")]),
                  helper=ScriptedModel([search(w), return_flights]))
    wk = worker(w, settings, roles)
    assert run_all(wk) == 3  # main (starts it), helper (reads, returns), main (reads the result)

    helper_saw = roles.helper.seen[0]
    assert "my boss confirms" not in json.dumps(helper_saw.messages) + helper_saw.prefix  # not the main conversation
    assert 'source="helper_handoff" trust="agent"' in helper_saw.messages[0]["content"]
    assert HANDOFF["goal"] in helper_saw.messages[0]["content"] and '"version": 1' in helper_saw.messages[0]["content"]
    reads = {op.tool_name for op in w.tools.registry.tools() if op.effect == "read"}
    assert {t["name"] for t in helper_saw.tools} == reads | {"return_result"} and "airline__search_flights" in reads
    row = helper_row(w)
    assert (row.state, row.task_version, row.parent_session_id) == ("returned", 1, task.session_id)
    assert row.session_id != task.session_id
    (result,) = result_events(w)
    payload = json.loads(result.payload)
    assert (result.session_id, result.trust, result.authority) == (task.session_id, "helper", "agent")
    assert payload["helper_id"] == row.id and payload["based_on_version"] == 1
    assert payload["result"].splitlines()[0].startswith("AB100 ")  # cheapest first, as the airline answered
    main_tail = roles.main.seen[1].messages[0]["content"]
    assert 'source="helper" trust="helper"' in main_tail and "AB100" in main_tail and "STALE" not in main_tail
    assert messages(w.engine) == []  # a helper never reaches the user


def test_a_result_based_on_an_older_version_shows_stale_in_the_main_context(w: World, settings: Settings) -> None:
    task = w.task(title="keep my Lisbon trip on track")
    roles = Roles(main=ScriptedModel([calls(("start_helper", HANDOFF), ("stay_quiet", {"reason": "comparing"}))]),
                  helper=ScriptedModel([search(w), return_flights]))
    wk = worker(w, settings, roles)
    assert wk.run_once()  # the main run starts the helper (based on version 1)
    w.clock.advance(timedelta(minutes=1))
    with write(w.engine) as conn:  # the user steers before the helper returns
        control.steer(conn, user_id=w.owner, task_id=task.task_id, goal="fly on the afternoon instead",
                      actor="user:test", now=w.clock.now())
    run_all(wk)
    (result,) = result_events(w)
    assert json.loads(result.payload)["based_on_version"] == 1
    (seen,) = [r for r in roles.main.seen if 'source="helper"' in r.messages[0]["content"]]
    tail = seen.messages[0]["content"]
    assert "STALE: based on version 1; the task is at version 2 now" in tail and '"version": 2' in tail


def test_a_helper_that_calls_write_tools_is_refused_and_nothing_happens(w: World, settings: Settings) -> None:
    task = w.task(title="keep my Lisbon trip on track")

    def compromised(request: ModelRequest) -> ModelReply:
        booking, flights = last_result(request, 0)["objects"][0], last_result(request, 1)["objects"]
        return calls(("airline__order_flight", {"pnr": booking["id"], "flight": flights[-1]["id"]}),
                     ("send_to_user", {"text": "I booked CD310 for you"}), ("start_helper", HANDOFF),
                     ("schedule_followup", {"in_seconds": 3600}), ("computer__observe", {}))

    roles = Roles(main=ScriptedModel([calls(("start_helper", HANDOFF), ("stay_quiet", {"reason": "comparing"}))]),
                  helper=ScriptedModel([calls(("airline__get_booking", {"pnr": "PNR123"}),
                                              ("airline__search_flights", {"from": "AMS", "to": "LIS",
                                                                           "date": day(w)})),
                                        compromised, calls(("return_result", {"result": "nothing booked"}))]))
    run_all(worker(w, settings, roles))
    assert tool_errors(w, helper_run_id(w)) == dict.fromkeys(
        ["airline__order_flight", "send_to_user", "start_helper", "schedule_followup", "computer__observe"],
        "helper_read_only")
    assert w.airline.orders() == [] and messages(w.engine) == []
    with read(w.engine) as conn:
        assert conn.execute(select(actions)).all() == [] and conn.execute(select(timers)).all() == []
        assert len(conn.execute(select(helpers)).all()) == 1
        assert sorted(r.tool for r in conn.execute(select(refusals).where(refusals.c.code == "helper_read_only"))) \
            == ["airline__order_flight", "computer__observe", "schedule_followup", "send_to_user", "start_helper"]
    # The tool layer holds it too, for any call from the helper's session, whoever makes it.
    as_helper = Binding(user_id=w.owner, task_id=task.task_id, session_id=helper_row(w).session_id)
    with pytest.raises(Refused) as refused:
        w.call(as_helper, "merchant__cancel_renewal", subscription="obj_01x")
    assert refused.value.code == "helper_read_only"


def test_an_id_the_helper_was_given_is_refused_to_the_main_run_which_reads_again(w: World,
                                                                                  settings: Settings) -> None:
    w.task(title="keep my Lisbon trip on track")
    seen: dict[str, str] = {}

    def read_the_booking(request: ModelRequest) -> ModelReply:
        found = re.search(r"AB100 \S+ \d+ id=(obj_[0-9a-z]+)", request.messages[0]["content"])
        assert found is not None
        seen["helpers"] = found.group(1)
        return calls(("airline__get_booking", {"pnr": "PNR123"}))

    def order_with_the_helpers_id(request: ModelRequest) -> ModelReply:
        seen["pnr"] = last_result(request)["objects"][0]["id"]
        return calls(("airline__order_flight", {"pnr": seen["pnr"], "flight": seen["helpers"]}))

    def read_again(request: ModelRequest) -> ModelReply:
        seen["refused"] = last_result(request)["error"]["code"]
        return search(w)

    def order_with_its_own(request: ModelRequest) -> ModelReply:
        own = last_result(request)["objects"][0]
        assert own["flight"] == "AB100" and own["id"] != seen["helpers"]
        return calls(("airline__order_flight", {"pnr": seen["pnr"], "flight": own["id"]}))

    roles = Roles(main=ScriptedModel([calls(("start_helper", HANDOFF), ("stay_quiet", {"reason": "comparing"})),
                                      read_the_booking, order_with_the_helpers_id, read_again, order_with_its_own]),
                  helper=ScriptedModel([search(w), return_flights]))
    run_all(worker(w, settings, roles))
    assert seen["refused"] == "unknown_object"
    with read(w.engine) as conn:
        (action,) = conn.execute(select(actions)).all()
        (refused,) = conn.execute(select(refusals.c.detail).where(refusals.c.tool == "airline__order_flight")).all()
    assert "issued to a helper run" in refused.detail
    content = json.loads(action.content)
    assert content["refs"] == {"pnr": "PNR123", "flight": "AB100"} and content["task_version"] == 1
    assert w.airline.orders() == []  # it waits for the user's approval (risk "ask"): nothing left


def test_closing_the_task_stops_its_helper_at_its_next_step(w: World, settings: Settings) -> None:
    task = w.task(title="keep my Lisbon trip on track")

    def user_closes_meanwhile(request: ModelRequest) -> ModelReply:
        with write(w.engine) as conn:
            control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.CLOSE,
                                   actor="user:test", reason="trip cancelled", now=w.clock.now())
        return search(w)

    roles = Roles(main=ScriptedModel([calls(("start_helper", HANDOFF), ("stay_quiet", {"reason": "comparing"}))]),
                  helper=ScriptedModel([user_closes_meanwhile, calls(("return_result", {"result": "too late"}))]))
    run_all(worker(w, settings, roles))
    assert len(roles.helper.seen) == 1  # stopped at its next step, and never asked again
    row = helper_row(w)
    assert (row.state, row.reason) == ("stopped", "the task was closed")
    with read(w.engine) as conn:
        outcomes = [r.outcome for r in conn.execute(select(runs.c.outcome).where(runs.c.session_id == row.session_id)
                                                    .order_by(runs.c.started_at, runs.c.id))]
    assert outcomes == [RunOutcome.INTERRUPTED, RunOutcome.COMPLETED]  # the second only settles its events
    assert tool_errors(w, helper_run_id(w)) == {"airline__search_flights": "closed"}
    assert result_events(w) == []


def test_a_helper_is_admitted_like_other_proactive_things(w: World, settings: Settings) -> None:
    task = w.task(title="keep my Lisbon trip on track")
    capped = settings.model_copy(update={"helper_cap": 1})
    roles = Roles(main=ScriptedModel([calls(("start_helper", HANDOFF), ("start_helper", HANDOFF),
                                            ("stay_quiet", {"reason": "comparing"}))]),
                  helper=ScriptedModel([]))
    wk = worker(w, capped, roles)
    assert wk.run_once()
    assert tool_errors(w, _runs(w)[0]) == {"start_helper": "cap_exceeded"}  # the second, counting this run's first
    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.PAUSE,
                               actor="user:test", reason="hold on", now=w.clock.now())
    roles.main.script.extend([calls(("start_helper", HANDOFF), ("stay_quiet", {"reason": "paused"}))])
    run_all(wk)
    assert helper_row(w).state == "stopped" and roles.helper.seen == []  # it stopped with the pause, unasked
    assert tool_errors(w, _runs(w, task.session_id)[-1]) == {"start_helper": "paused"}

    def stop_comes_meanwhile(request: ModelRequest) -> ModelReply:
        with write(w.engine) as conn:
            control.set_stop(conn, stopped=True, user_id=w.owner, actor="user:test", reason="stop",
                             now=w.clock.now())
        return calls(("start_helper", HANDOFF))

    with write(w.engine) as conn:
        control.set_task_state(conn, user_id=w.owner, task_id=task.task_id, kind=ControlKind.RESUME,
                               actor="user:test", reason="go on", now=w.clock.now())
    roles.main.script.extend([stop_comes_meanwhile])
    run_all(wk)
    assert tool_errors(w, _runs(w, task.session_id)[-1]) == {"start_helper": "stopped"}
    assert len(_helpers(w)) == 1


def _helpers(w: World) -> list[Any]:
    with read(w.engine) as conn:
        return conn.execute(select(helpers)).all()


def _runs(w: World, session_id: str | None = None) -> list[str]:
    query = select(runs.c.id).order_by(runs.c.started_at, runs.c.id)
    if session_id is not None:
        query = query.where(runs.c.session_id == session_id)
    with read(w.engine) as conn:
        return list(conn.execute(query).scalars())


def test_a_helper_that_runs_out_of_steps_or_time_or_ends_without_a_result_fails_and_the_main_task_hears_it(
        w: World, settings: Settings) -> None:
    w.task(title="keep my Lisbon trip on track")
    tight = settings.model_copy(update={"helper_max_steps": 2, "helper_cap": 3})

    def slow(request: ModelRequest) -> ModelReply:
        w.clock.advance(tight.helper_max_time)
        return search(w)

    roles = Roles(main=ScriptedModel([calls(*[("start_helper", HANDOFF)] * 3,
                                            ("stay_quiet", {"reason": "comparing"}))]),
                  helper=ScriptedModel([search(w), search(w), search(w), ModelReply(text="I would rather not say"),
                                        slow]))
    run_all(worker(w, tight, roles))
    failures = sorted(json.loads(e.payload)["failed"].split(" at ")[0] for e in result_events(w))
    assert failures == ["it ended without return_result", "its budget of 2 steps was used", "its time ran out"]
    with read(w.engine) as conn:
        assert sorted(r.state for r in conn.execute(select(helpers))) == ["failed"] * 3
    assert [m.get("kind") for m in messages(w.engine)] == []  # the main task is told; the user is not
