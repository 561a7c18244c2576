"""Every tool through the real MCP client, with random schema-valid arguments drawn from the same typed models the
schemas are generated from: each call ends in a tool result or a tool error whose text starts with a stable code.

A protocol error (the client raises), the SDK's opaque "Error executing tool", a traceback or an uncoded message
fails. The arguments mix real object IDs with forged ones and another user's, this user's task with another
user's and with unknown ones, element refs from a real observation with made-up ones, and the longest strings and
the bounds of every range. The simulators serve the connectors on loopback; the tool computer is the vm layer's
in-memory one, and admitted acts run on it at once as in `wakeful serve`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from mcp import Client
from sqlalchemy import Engine

from tests.support.acting import world
from tests.support.computers import FakeComputers
from tests.support.model_strategies import JSON, Special, arguments
from wakeful.proxy.clock import FakeClock
from wakeful.server.acting.connectors import OBJECT_ID_PATTERN, load_connectors
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, sessions
from wakeful.server.core.worker import Binding
from wakeful.server.egress.dispatch import ActionDispatcher
from wakeful.server.faces.mcpserver import WakefulMCP
from wakeful.server.settings import EXAMPLE_POLICIES
from wakeful.server.store.db import write
from wakeful.server.store.users import ensure_user
from wakeful.server.tools.specs import TASK_ID_PATTERN, Face, tool_specs

TOOLS = [s.name for s in tool_specs(load_connectors(EXAMPLE_POLICIES / "connectors"), Face.MCP, computers=True)]
CODED = re.compile(r"[a-z][a-z0-9_]*: \S")
FUZZ = settings(max_examples=25, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.filter_too_much])


@dataclass(repr=False)  # hypothesis prints its arguments on failure: the strategies inside are long
class Fuzzing:
    call: Callable[[str, dict[str, Any]], Any]
    mcp: WakefulMCP
    special: Special
    computers: FakeComputers

    def __repr__(self) -> str:
        return "Fuzzing(...)"


@pytest.fixture
def fuzzing(engine: Engine, clock: FakeClock, owner: str, settings: Any) -> Iterator[Fuzzing]:
    with ExitStack() as stack:
        w = stack.enter_context(world(engine, clock, owner, policy=Policy()))
        computers = FakeComputers(clock)
        acts = ActionDispatcher(engine, clock, policy=w.policy, computers=computers)
        stack.callback(acts.close)
        w.tools.attach_computers(computers, dispatch_now=lambda action_id: acts.dispatch(f"dsp_{action_id}", action_id),
                                 notify=lambda binding, token: None)
        mcp = WakefulMCP(engine=engine, clock=clock, settings=settings, tools=w.tools, local_user="owner")
        portal = stack.enter_context(start_blocking_portal())
        client = stack.enter_context(portal.wrap_async_context_manager(Client(mcp.server)))

        def call(tool: str, args: dict[str, Any]) -> Any:
            return portal.call(client.call_tool, tool, args)

        mine = call("create_responsibility", {"title": "fuzz"}).structured_content["task_id"]
        owned = [o["id"] for o in call("merchant__list_subscriptions", {"task_id": mine}).structured_content["objects"]]
        owned += [o["id"] for o in call("hotel__quote_stay", {"task_id": mine, "hotel": "H-100", "nights": 2})
                  .structured_content.get("objects", [])]
        theirs, their_objects = _another_users_task_and_objects(w.tools, engine, clock)
        observed = json.loads(call("computer__observe", {"task_id": mine}).content[0].text)
        refs = re.findall(r"^\[([^\]]+)\]", observed["text"], flags=re.MULTILINE)
        special = Special(
            by_pattern={
                TASK_ID_PATTERN: st.sampled_from([mine, mine, mine, mine, theirs, "task_00forged", "task_" + "9" * 59]),
                OBJECT_ID_PATTERN: st.sampled_from(owned + their_objects) | st.from_regex(OBJECT_ID_PATTERN,
                                                                                            fullmatch=True)
                | st.just("obj_" + "z" * 5000),
            },
            by_field={"ref": st.sampled_from(refs) | st.text(max_size=64),
                      "observation": st.sampled_from([observed["observation"], 0]) | st.integers(0, 10**6)})
        yield Fuzzing(call=call, mcp=mcp, special=special, computers=computers)


def _another_users_task_and_objects(tools: Any, engine: Engine, clock: FakeClock) -> tuple[str, list[str]]:
    with write(engine) as conn:
        mallory, _ = ensure_user(conn, name="mallory", now=clock.now())
        session_id = sessions.create_session(conn, user_id=mallory, now=clock.now())
        task_id = control.create_task(conn, user_id=mallory, session_id=session_id, title="theirs", now=clock.now())
    listed = tools.call(Binding(user_id=mallory, task_id=task_id), "merchant__list_subscriptions", {})
    return task_id, [o["id"] for o in listed["objects"]]


def assert_result_or_coded_error(tool: str, args: dict[str, Any], result: Any) -> None:
    texts = [c.text for c in result.content if getattr(c, "type", None) == "text"]
    shown = f"{tool}({json.dumps(args)[:300]}) → {texts[:1]}"
    assert not any("Traceback" in t or "Error executing tool" in t for t in texts), shown
    if result.is_error:
        assert texts and CODED.match(texts[0]), shown
        assert result.structured_content["error"]["code"] == texts[0].split(":", 1)[0], shown
        event(f"{tool}: {texts[0].split(':', 1)[0]}")  # --hypothesis-show-statistics shows what was reached
    else:
        assert isinstance(result.structured_content, dict), shown
        event(f"{tool}: result")


@pytest.mark.parametrize("tool", TOOLS)
@FUZZ
@given(data=st.data())
def test_every_tool_answers_schema_valid_arguments_with_a_result_or_a_coded_error(
        fuzzing: Fuzzing, tool: str, data: st.DataObject) -> None:
    spec = fuzzing.mcp.specs()[tool]
    args = data.draw(arguments(spec.model(Face.MCP), fuzzing.special), label="arguments")
    schema = next(t.input_schema for t in fuzzing.mcp.tool_list() if t.name == tool)
    problems = [e.message for e in Draft202012Validator(schema).iter_errors(args)]
    assert not problems, f"the model drew arguments its own schema refuses: {problems}"
    result = fuzzing.call(tool, args)  # a protocol error raises here
    assert_result_or_coded_error(tool, args, result)
    fuzzing.computers.tc.return_control()  # a handoff would refuse every later act: give the screen back


@FUZZ
@given(tool=st.sampled_from([*TOOLS, "approve", "no_such_tool", "merchant__find_cancellations"]),
       args=st.dictionaries(st.sampled_from(["task_id", "text", "act", "subscription", "title", "x"]), JSON,
                            max_size=4))
def test_arguments_that_break_the_schema_and_unknown_tools_are_refused_with_a_code(
        fuzzing: Fuzzing, tool: str, args: dict[str, Any]) -> None:
    result = fuzzing.call(tool, args)
    assert_result_or_coded_error(tool, args, result)
