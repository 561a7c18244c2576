"""It speaks only when it should: levels, quiet hours in the user's zone with one summary when they end, urgency that
breaks through only with a deadline before morning, the daily attention budget, the `after=SEQ` feed, preferences
only the user sets, and the no-model agent that says so once.

The D9 night of the seed, in Asia/Hong_Kong (quiet hours 23:00–07:30): the agent rebooks at 02:12 and asks about
the hotel; nothing reaches the user until 07:30, then exactly one summary with both, in order, with their levels.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest
from fastapi.testclient import TestClient
from mcp import Client
from sqlalchemy import Engine, select

from tests.integration.test_cli import run
from tests.support.records import run_rows
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.connectors import Registry
from wakeful.server.core import inbox, outbox, sessions
from wakeful.server.faces.http import create_app
from wakeful.server.faces.mcpserver import WakefulMCP
from wakeful.server.harness.handlers import NO_MODEL, NoModelHandler
from wakeful.server.harness.model import ScriptedModel, calls, quiet
from wakeful.server.harness.wake import Harness
from wakeful.server.runtime import Runtime, make_handler
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import events
from wakeful.server.store.tables import outbox as outbox_table
from wakeful.server.store.users import issue_token
from wakeful.server.tools.specs import Face, tool_specs

HK = ZoneInfo("Asia/Hong_Kong")
BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)


def hk(day: int, hour: int, minute: int) -> datetime:
    """A Hong Kong wall-clock time in December 2026, as the UTC instant the clock holds."""
    return datetime(2026, 12, day, hour, minute, tzinfo=HK).astimezone(UTC)


@dataclass
class Phone:
    """The user's side (the HTTP API with their token) and the agent's (a scripted model, one run per event)."""

    runtime: Runtime
    http: TestClient
    auth: dict[str, str]
    model: ScriptedModel
    session_id: str
    clock: FakeClock
    owner: str
    events: int = 0

    def prefs(self, **body: Any) -> httpx.Response:
        return self.http.put("/v1/preferences", json=body, headers=self.auth)

    def night(self) -> None:
        answer = self.prefs(timezone="Asia/Hong_Kong", quiet_hours={"start": "23:00", "end": "07:30"})
        assert answer.status_code == 200, answer.text

    def wake(self) -> None:
        """One event for the session, and the run it causes."""
        self.events += 1
        with write(self.runtime.engine) as conn:
            inbox.record(conn, inbox.Delivery(user_id=self.owner, source="hook", source_id=f"d-{self.events}",
                                              payload={"n": self.events}, session_id=self.session_id),
                         now=self.clock.now())
        assert self.runtime.workers[0].run_once()

    def say(self, text: str, *, level: str = "notify", urgent: dict[str, str] | None = None) -> None:
        """The model, woken by an event, calls send_to_user (then has nothing more to do)."""
        args: dict[str, Any] = {"text": text, "level": level} | ({"urgent": urgent} if urgent else {})
        self.model.script += [calls(("send_to_user", args)), quiet("said it")]
        self.wake()

    def deliver(self) -> int:
        """The dispatcher's round: summaries whose hold ended, then the drain (to the local feed)."""
        released = self.runtime.release_held()
        self.runtime.outbox.drain()
        return released

    def feed(self, after: int = 0, limit: int = 100) -> dict[str, Any]:
        answer = self.http.get("/v1/messages", params={"after": after, "limit": limit}, headers=self.auth)
        assert answer.status_code == 200, answer.text
        page: dict[str, Any] = answer.json()
        return page

    def everything(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = self.http.get("/v1/messages", headers=self.auth).json()["messages"]
        return messages


@pytest.fixture
def phone(settings: Settings, engine: Engine, clock: FakeClock, owner: str) -> Iterator[Phone]:
    model = ScriptedModel([])
    runtime = Runtime(settings, handler=NoModelHandler(), clock=clock, engine=engine)
    runtime.workers[0].handler = Harness(model, registry=runtime.registry, instructions=None,
                                         max_tokens_per_run=100_000)
    runtime.prepare()
    clock.set(hk(2, 22, 0))
    with write(engine) as conn:
        token = issue_token(conn, user_id=owner)
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
    with TestClient(create_app(runtime, manage_runtime=False)) as http:
        yield Phone(runtime=runtime, http=http, auth={"Authorization": f"Bearer {token}"}, model=model,
                    session_id=session_id, clock=clock, owner=owner)


# -- quiet hours -------------------------------------------------------------------------------------------------


@BOTH
def test_news_at_0212_reaches_the_user_only_as_one_summary_at_0730_hong_kong_time(phone: Phone) -> None:
    phone.night()
    phone.clock.set(hk(3, 2, 12))
    phone.say("Your CX 101 was cancelled; I rebooked you on CX 105 at 11:05, aisle seat, within policy.",
              level="act")
    phone.say("Extend the hotel by a night? I will ask again in the morning.", level="ask")
    phone.deliver()
    assert phone.feed()["messages"] == [] and phone.feed()["after"] == 0
    held = phone.everything()
    assert [m["state"] for m in held] == ["held", "held"]
    assert all("quiet hours 23:00–07:30 (Asia/Hong_Kong)" in m["gate"] for m in held), held
    assert {m["held_until"] for m in held} == {hk(3, 7, 30).isoformat()}

    phone.clock.set(hk(3, 7, 29))
    assert phone.deliver() == 0 and phone.feed()["messages"] == []
    phone.clock.set(hk(3, 7, 30))
    assert phone.deliver() == 1
    (summary,) = phone.feed()["messages"]
    assert summary["body"]["kind"] == "summary" and summary["state"] == "sent" and summary["seq"] == 1
    assert [(i["level"], i["at"]) for i in summary["body"]["items"]] == [("act", "02:12"), ("ask", "02:12")]
    assert summary["body"]["text"].index("CX 105") < summary["body"]["text"].index("hotel")
    assert summary["body"]["level"] == "act"
    assert {(m["state"], m["summary_id"]) for m in phone.everything() if m["id"] != summary["id"]} == {
        ("batched", summary["id"])}
    assert phone.deliver() == 0 and phone.feed(after=1)["messages"] == []  # one summary, once


@BOTH
def test_an_urgent_message_breaks_through_only_when_its_deadline_falls_before_the_quiet_hours_end(
        phone: Phone) -> None:
    phone.night()
    phone.clock.set(hk(3, 2, 12))
    phone.say("The hotel holds your room only until 06:00: extend it?", level="ask",
              urgent={"reason": "the hotel hold expires before you wake", "deadline": "2026-12-03T06:00:00+08:00"})
    phone.say("The meeting could move to Friday.", level="suggest",
              urgent={"reason": "I would like an answer", "deadline": "2026-12-03T09:00:00+08:00"})
    phone.deliver()
    (urgent,) = phone.feed()["messages"]
    assert urgent["body"]["text"].startswith("The hotel holds") and urgent["state"] == "sent"
    assert urgent["body"]["urgent"]["reason"] == "the hotel hold expires before you wake"
    assert urgent["gate"].startswith("urgent, broke through quiet hours") and "06:00" in urgent["gate"]
    (late,) = [m for m in phone.everything() if m["state"] == "held"]
    assert "is not between now and 2026-12-03 07:30, so it is not urgent" in late["gate"], late["gate"]
    phone.clock.set(hk(3, 7, 30))
    phone.deliver()
    summary = phone.feed(after=urgent["seq"])["messages"]
    assert [[i["text"] for i in m["body"]["items"]] for m in summary] == [["The meeting could move to Friday."]]


def test_urgency_without_a_deadline_is_refused_to_the_model_and_nothing_is_sent(phone: Phone) -> None:
    phone.night()
    phone.clock.set(hk(3, 2, 12))
    phone.model.script += [calls(("send_to_user", {"text": "wake up", "urgent": {"reason": "trust me"}})),
                           quiet("refused")]
    phone.wake()
    phone.deliver()
    assert phone.everything() == []
    assert run_rows(phone.runtime.engine)[-1].reason == "silence: refused"


# -- the attention budget ----------------------------------------------------------------------------------------


@BOTH
def test_past_the_daily_budget_news_waits_for_the_next_summary_and_urgent_news_still_goes(phone: Phone) -> None:
    phone.night()
    assert phone.prefs(attention_budget=2).json()["attention_budget"] == 2
    phone.clock.set(hk(3, 12, 0))
    for n in range(3):
        phone.say(f"price check {n}: unchanged")
    phone.say("Your flight leaves in two hours and check-in closes at 13:00.",
              urgent={"reason": "check-in closes soon", "deadline": "2026-12-03T13:00:00+08:00"})
    phone.deliver()
    texts = [m["body"]["text"] for m in phone.feed()["messages"]]
    assert texts == ["price check 0: unchanged", "price check 1: unchanged",
                     "Your flight leaves in two hours and check-in closes at 13:00."]
    (held,) = [m for m in phone.everything() if m["state"] == "held"]
    assert "the attention budget of 2 messages a day is used" in held["gate"]
    assert held["held_until"] == hk(4, 7, 30).isoformat()  # the next summary: the end of the next quiet hours

    phone.clock.set(hk(4, 7, 30))
    assert phone.deliver() == 1
    (summary,) = phone.feed(after=3)["messages"]
    assert [i["text"] for i in summary["body"]["items"]] == ["price check 2: unchanged"]


# -- the feed ----------------------------------------------------------------------------------------------------


@BOTH
def test_polling_after_seq_while_two_writers_commit_never_misses_or_repeats_a_message(
        phone: Phone, engine: Engine, owner: str) -> None:
    per_writer = 40
    written: list[str] = []
    lock = threading.Lock()

    def writer(name: str) -> None:
        for n in range(per_writer):
            with write(engine) as conn:
                message_id = outbox.enqueue(conn, user_id=owner, body={"text": f"{name} {n}"},
                                            now=phone.clock.now())
            with lock:
                written.append(message_id)

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    seen: list[dict[str, Any]] = []
    after = 0
    while True:
        finished = not any(t.is_alive() for t in threads)  # before the poll: all they wrote is committed by then
        page = phone.feed(after=after, limit=7)
        seen += page["messages"]
        after = page["after"]
        if finished and not page["messages"]:
            break
    for thread in threads:
        thread.join(30)
    assert sorted(m["id"] for m in seen) == sorted(written)  # none missed, none twice
    seqs = [m["seq"] for m in seen]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs) == 2 * per_writer
    for name in ("a", "b"):  # each writer's messages in the order it wrote them
        assert [m["body"]["text"] for m in seen if m["body"]["text"].startswith(name)] == [
            f"{name} {n}" for n in range(per_writer)]


def test_the_feed_refuses_after_with_a_cursor_or_below_zero(phone: Phone) -> None:
    both = phone.http.get("/v1/messages", params={"after": 0, "cursor": "x"}, headers=phone.auth)
    negative = phone.http.get("/v1/messages", params={"after": -1}, headers=phone.auth)
    assert (both.status_code, both.json()["error"]["code"]) == (400, "invalid_parameter")
    assert (negative.status_code, negative.json()["error"]["code"]) == (400, "invalid_parameter")


# -- preferences: only the user sets them ------------------------------------------------------------------------


def test_preferences_are_read_and_set_by_the_user_field_by_field(phone: Phone) -> None:
    assert phone.http.get("/v1/preferences", headers=phone.auth).json() == {
        "timezone": "UTC", "quiet_hours": None, "attention_budget": None}
    phone.night()
    assert phone.prefs(attention_budget=5).json() == {
        "timezone": "Asia/Hong_Kong", "quiet_hours": {"start": "23:00", "end": "07:30"}, "attention_budget": 5}
    assert phone.prefs(quiet_hours=None).json() == {
        "timezone": "Asia/Hong_Kong", "quiet_hours": None, "attention_budget": 5}


@pytest.mark.parametrize(("body", "code"), [
    ({"timezone": "Mars/Olympus_Mons"}, "unknown_timezone"),
    ({"quiet_hours": {"start": "23:00", "end": "23:00"}}, "invalid_quiet_hours"),
    ({"quiet_hours": {"start": "24:00", "end": "07:30"}}, "malformed_body"),
    ({"quiet_hours": {"start": "7:30", "end": "23:00"}}, "malformed_body"),
    ({"quiet_hours": {"start": "23:00"}}, "malformed_body"),
    ({"attention_budget": -1}, "malformed_body"),
    ({"attention_budget": "5"}, "malformed_body"),
    ({"timezone": None}, "malformed_body"),
    ({"do_not_disturb": True}, "malformed_body"),
])
def test_bad_preferences_are_refused_with_a_stable_code_and_change_nothing(phone: Phone, body: dict[str, Any],
                                                                           code: str) -> None:
    phone.night()
    answer = phone.prefs(**body)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, code), answer.text
    assert phone.http.get("/v1/preferences", headers=phone.auth).json()["quiet_hours"] == {
        "start": "23:00", "end": "07:30"}


def test_preferences_need_the_users_token(phone: Phone) -> None:
    missing = phone.http.put("/v1/preferences", json={"attention_budget": 1})
    wrong = phone.http.get("/v1/preferences", headers={"Authorization": "Bearer nope"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "missing_token")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "bad_token")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_agent_over_mcp_has_no_way_to_set_quiet_hours(phone: Phone, settings: Settings) -> None:
    """Principle 9: quiet hours are the user's control state; the agent's channel reaches nothing that writes it."""
    server = WakefulMCP(engine=phone.runtime.engine, clock=phone.clock, settings=settings,
                        tools=phone.runtime.tools, local_user="owner").server
    phone.night()
    phone.clock.set(hk(3, 2, 12))
    async with Client(server) as agent:
        names = {tool.name for tool in (await agent.list_tools()).tools}
        refused = await agent.call_tool("set_preferences", {"quiet_hours": None})
        task_id = (await agent.call_tool("create_responsibility", {"title": "trip"})).structured_content["task_id"]
        sent = await agent.call_tool("send_to_user", {"task_id": task_id, "text": "Extend the hotel?", "level": "ask"})
    assert not sent.is_error, sent.content
    assert [(m["state"], m["body"]["level"]) for m in phone.everything() if m["body"].get("via") == "mcp"] == [
        ("held", "ask")]  # the agent's messages pass the same gate
    assert not {n for n in names if "prefer" in n or "quiet" in n or "budget" in n}, names
    assert refused.is_error
    for face in Face:  # nor does the harness's model
        offered = {s.name for s in tool_specs(phone.runtime.registry, face, computers=True)}
        assert "send_to_user" in offered and not {n for n in offered if "prefer" in n or "quiet_hours" in n}
    assert phone.http.get("/v1/preferences", headers=phone.auth).json()["quiet_hours"] == {
        "start": "23:00", "end": "07:30"}


# -- without a model ---------------------------------------------------------------------------------------------


@BOTH
def test_without_a_model_events_are_settled_in_silence_and_the_user_is_told_once_across_restarts(
        settings: Settings, engine: Engine, clock: FakeClock, owner: str) -> None:
    quiet_settings = settings.model_copy(update={"anthropic_api_key": None})
    with write(engine) as conn:
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
    for start in range(2):  # a restart: a new runtime on the same database
        runtime = Runtime(quiet_settings, clock=clock, engine=engine,
                          handler=make_handler(quiet_settings, Registry(connectors={})))
        runtime.prepare()
        for n in range(2):
            with write(engine) as conn:
                inbox.record(conn, inbox.Delivery(user_id=owner, source="hook", source_id=f"d-{start}-{n}",
                                                  payload={"n": n}, session_id=session_id), now=clock.now())
            assert runtime.workers[0].run_once()
            clock.advance(timedelta(minutes=1))
        runtime.outbox.drain()
    with read(engine) as conn:
        statuses = conn.execute(select(events.c.status)).scalars().all()
        notices = conn.execute(select(outbox_table.c.id, outbox_table.c.body)).all()
    assert statuses == ["processed"] * 4
    assert [r.reason for r in run_rows(engine)] == [f"silence: {NO_MODEL}"] * 4
    assert [n.id for n in notices] == [f"nomodel_{owner}"]
    assert "WAKEFUL_ANTHROPIC_API_KEY" in notices[0].body



def test_the_cli_sets_preferences_as_the_user_and_refuses_bad_ones_with_their_code(tmp_path: Path) -> None:
    run(tmp_path, "token")  # the owner exists
    shown = json.loads(run(tmp_path, "preferences", "--timezone", "Asia/Hong_Kong", "--quiet", "23:00-07:30",
                           "--budget", "5").stdout)
    assert shown == {"timezone": "Asia/Hong_Kong", "quiet_hours": {"start": "23:00", "end": "07:30"},
                     "attention_budget": 5}
    assert json.loads(run(tmp_path, "preferences", "--budget", "off").stdout)["attention_budget"] is None
    for args, code in ((("--quiet", "23:00"), "invalid_quiet_hours"), (("--quiet", "7:00-7:00"), "invalid_quiet_hours"),
                       (("--budget", "-1"), "invalid_parameter"), (("--timezone", "Nowhere"), "unknown_timezone")):
        refused = run(tmp_path, "preferences", *args, check=False)
        assert refused.returncode != 0 and code in refused.stderr, (args, refused.stderr)
    assert json.loads(run(tmp_path, "preferences").stdout)["quiet_hours"] == {"start": "23:00", "end": "07:30"}
