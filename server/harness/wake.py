"""The always-on harness: one wake of the model, from records to exactly one ending.

    assemble the context from records (stable prefix, the task snapshot, this wake's tail) and record it
    loop: step budget → the model proposes (persisted as a decision before anything acts on it; a resumed run
          replays the stored one) → each tool call goes through the same tool layer and admission as MCP calls,
          and its result is recorded
    end in exactly one of: a message through the outbox, an explicit silence with a reason, or a wait
Plain model text is stored with its decision and never reaches the user. A helper task's run (`helper_run`) goes
the same way with its own context and tools, and ends in its result or its failure, told to the main task.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Table

from wakeful.server.acting.connectors import Registry
from wakeful.server.core import agenda, attach, keys, triage
from wakeful.server.core.schedule import Misfire
from wakeful.server.core.worker import RunContext, RunInterrupted
from wakeful.server.errors import Conflict, WakefulError
from wakeful.server.harness import history
from wakeful.server.harness.context import Context, assemble, render_tail
from wakeful.server.harness.helper_run import HelperRun
from wakeful.server.harness.model import ModelAdapter, ModelReply, ModelRequest, ToolCall
from wakeful.server.memory import Actor, ActorKind, Proposal, Stored
from wakeful.server.memory import committer as memory
from wakeful.server.memory.recall import record_uses
from wakeful.server.store.db import read
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import OnTimeout, RunOutcome, run_contexts, tool_results
from wakeful.server.tools.specs import Face, spec, urgency_of

__all__ = ["HARNESS_VERSION", "Harness"]

HARNESS_VERSION = "1"
_OWN = frozenset({"send_to_user", "stay_quiet", "schedule_followup", "read_record", "wait_for_reply", "keep_checking",
                  "list_timers", "cancel_timer", "confirm_pause", "add_task_key", "attach_event", "start_helper",
                  "remember"})


class Harness:
    def __init__(self, model: ModelAdapter, *, registry: Registry, instructions: Path | None,
                 max_tokens_per_run: int, computers: bool = False) -> None:
        self.model = model
        self.computers = computers
        self.registry = registry
        self.instructions = instructions
        self.max_tokens = max_tokens_per_run

    def __call__(self, ctx: RunContext) -> None:
        engine = ctx.engine
        with read(engine) as conn:
            context = assemble(conn, registry=self.registry, instructions=self.instructions, user_id=ctx.user_id,
                               session_id=ctx.session_id, run_id=ctx.run_id, events=ctx.events,
                               computers=self.computers)

        def record(conn: Connection) -> None:  # the context, and which memory versions it recalled
            conn.execute(run_contexts.insert().values(
                run_id=ctx.run_id, prefix_sha256=context.prefix_sha256, prefix=context.prefix,
                tail=json.dumps(context.tail, sort_keys=True, default=str), model=self.model.name,
                harness_version=HARNESS_VERSION, created_at=ctx.now()))
            record_uses(conn, run_id=ctx.run_id, memory_ids=context.memory_ids)

        ctx.persist(record)
        helper = HelperRun.of(ctx)
        if helper is not None and not helper.running:
            ctx.silence(f"helper {helper.helper.id} is {helper.helper.state.value}: nothing more to do")
            return
        try:
            self._loop(ctx, context, helper)
        except RunInterrupted as stop:
            if helper is None or stop.outcome is not RunOutcome.BUDGET_EXHAUSTED:
                raise
            helper.fail(ctx, stop.reason)  # the main task is told, not the user
            return
        if helper is not None and not helper.returned:
            helper.fail(ctx, "it ended without return_result")

    def _loop(self, ctx: RunContext, context: Context, helper: HelperRun | None) -> None:
        task: dict[str, Any] | None = context.tail["task"]
        messages: list[dict[str, Any]] = [{"role": "user", "content": render_tail(context.tail)}]
        tokens = 0
        while True:
            if helper is not None:
                helper.check_budget(ctx)
            ctx.step()
            request = ModelRequest(prefix=context.prefix, snapshot=context.snapshot, tools=context.tools,
                                   messages=tuple(messages))
            decision_id, proposal = ctx.propose(partial(self._ask, request))
            reply = ModelReply.from_json(proposal)
            tokens += reply.input_tokens + reply.output_tokens
            if not reply.tool_calls:
                if ctx.ended_by is None:
                    ctx.silence(f"the model ended without a message ({reply.text[:80]!r} is not shown to anyone)")
                return
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": c.id, "name": c.name, "input": c.args} for c in reply.tool_calls]})
            results = []
            for index, call in enumerate(reply.tool_calls):
                result = self._execute(ctx, task, call, f"{decision_id}:{index}", helper)
                row = {"id": new_id("tr"), "run_id": ctx.run_id, "step": ctx.decisions - 1, "call_id": call.id,
                       "tool": call.name, "args": json.dumps(call.args, sort_keys=True),
                       "result": json.dumps(result, sort_keys=True, default=str), "created_at": ctx.now()}
                ctx.persist(partial(_insert, tool_results, row))
                results.append({"type": "tool_result", "tool_use_id": call.id,
                                "content": json.dumps(result, sort_keys=True, default=str),
                                "is_error": "error" in result})
                if helper.returned if helper is not None else call.name == "stay_quiet":
                    return
            messages.append({"role": "user", "content": results})
            if tokens > self.max_tokens:
                raise RunInterrupted(RunOutcome.BUDGET_EXHAUSTED, f"token budget of {self.max_tokens} used")

    def _ask(self, request: ModelRequest) -> dict[str, Any]:
        return self.model.complete(request).to_json()

    def _execute(self, ctx: RunContext, task: dict[str, Any] | None, call: ToolCall, decision_id: str,
                 helper: HelperRun | None) -> dict[str, Any]:
        """One tool call's result; `task` is the task as this wake's context shows it."""
        try:
            if helper is not None:
                return helper.execute(ctx, call.name, dict(call.args), decision_id)
            # The run's own tools, checked against their specs like every other (the tool layer checks the rest).
            args: Any = spec(call.name).validate(Face.HARNESS, call.args) if call.name in _OWN else None
            if call.name == "send_to_user":
                ctx.send_to_user(args.text, level=args.level, urgency=urgency_of(args))
                return {"sent": True}
            if call.name == "stay_quiet":
                ctx.silence(args.reason or "no reason given")
                return {"quiet": True}
            if call.name == "attach_event":
                return _attach(ctx, args)
            if task is None:
                raise WakefulError("no_task", "this wake belongs to no task; only send_to_user, stay_quiet and (in "
                                              "triage) attach_event work")
            task_id: str = task["task_id"]
            if call.name == "add_task_key":
                return _add_key(ctx, task_id, args)
            if call.name == "remember":
                return _remember(ctx, task_id, args)
            if call.name == "read_record":
                with read(ctx.engine) as conn:
                    return history.record(conn, user_id=ctx.user_id, task_id=task_id, session_id=ctx.session_id,
                                          record_id=args.record_id)
            if call.name == "confirm_pause":
                ctx.confirm_pause(task_id=task_id, reason=args.reason)
                return {"paused": True}
            if call.name == "start_helper":
                helper_id = ctx.start_helper(task_id=task_id, task_version=task["version"],
                                             goal=args.goal, constraints=list(args.constraints),
                                             output_form=args.output_form)
                return {"helper_id": helper_id, "state": "starting when this wake ends"}
            if call.name in _TIMEKEEPING:
                return _TIMEKEEPING[call.name](ctx, task_id, args)
            result: dict[str, Any] = ctx.call_tool(task_id=task_id, tool=call.name, args=dict(call.args),
                                                   decision_id=decision_id)
            if result.pop("screenshot_png_base64", None) is not None:
                # The model reads the observation's text (roles, names, refs); the picture stays out of the records.
                result["screenshot"] = "omitted: the element list above is what to act on"
            if result.get("status") == "needs_approval" and ctx.ended_by is None:
                ctx.ended_by = f"wait: approval of {result['action_id']}"
            return result
        except WakefulError as exc:
            return {"error": {"code": exc.code, "message": exc.message}}
        except (KeyError, ValueError, TypeError) as exc:
            return {"error": {"code": "invalid_arguments", "message": f"{call.name}: {exc}"}}


def _follow_up(ctx: RunContext, task_id: str, args: Any) -> dict[str, Any]:
    at = ctx.now() + timedelta(seconds=args.in_seconds)
    ctx.follow_up(task_id=task_id, at=at, note=args.note)
    return {"scheduled_for": at.isoformat()}


def _wait_for_reply(ctx: RunContext, task_id: str, args: Any) -> dict[str, Any]:
    deadline = args.until or ctx.now() + timedelta(seconds=args.within_seconds)
    ctx.wait_for_reply(args.key, task_id=task_id, deadline=deadline, on_timeout=OnTimeout(args.on_timeout),
                       note=args.note, source=args.source)
    return {"waiting_for": args.key, "until": deadline.isoformat(), "on_timeout": args.on_timeout}


def _keep_checking(ctx: RunContext, task_id: str, args: Any) -> dict[str, Any]:
    every = timedelta(seconds=args.every_seconds) if args.every_seconds is not None else None
    first = ctx.schedule(task_id=task_id, note=args.note, every=every, cron=args.cron, misfire=Misfire(args.misfire))
    return {"checking": args.note, "first_at": first.isoformat()}


def _list_timers(ctx: RunContext, task_id: str, args: Any) -> dict[str, Any]:
    with read(ctx.engine) as conn:
        return agenda.listing(conn, user_id=ctx.user_id, task_id=task_id)


def _cancel_timer(ctx: RunContext, task_id: str, args: Any) -> dict[str, Any]:
    ctx.cancel_timer(task_id=task_id, item_id=args.id)
    return {"cancelled": args.id}


_TIMEKEEPING: dict[str, Callable[[RunContext, str, Any], dict[str, Any]]] = {
    "schedule_followup": _follow_up, "wait_for_reply": _wait_for_reply, "keep_checking": _keep_checking,
    "list_timers": _list_timers, "cancel_timer": _cancel_timer,
}
"""The task's timers and waits (`server.core.agenda`): set when the run commits, listed from the records."""
def _harness_actor(ctx: RunContext) -> str:
    """Who the harness's records name: the user's agent in this run, never the user."""
    return f"agent:{ctx.user_id} run {ctx.run_id}"


def _add_key(ctx: RunContext, task_id: str, args: Any) -> dict[str, Any]:
    """Bind the key now, under the run's token, so that a delivery arriving while the run goes on finds the task."""
    def bind(conn: Connection) -> None:
        keys.bind(conn, user_id=ctx.user_id, task_id=task_id, keys=[args.key], actor=_harness_actor(ctx),
                  reason=args.reason, now=ctx.now())

    ctx.persist(bind)
    return {"task_id": task_id, "key": args.key, "bound": True}


def _remember(ctx: RunContext, task_id: str, args: Proposal) -> dict[str, Any]:
    """Propose a record through the committer, under the run's token; a refusal is committed (it is history) and
    answered with its code."""
    actor = Actor(kind=ActorKind.AGENT, run_id=ctx.run_id, task_id=task_id, name=f"run:{ctx.run_id}")
    outcome: list[Stored | WakefulError] = []
    ctx.persist(lambda conn: outcome.append(memory.try_propose(conn, user_id=ctx.user_id, actor=actor,
                                                               proposal=args, now=ctx.now())))
    if isinstance(outcome[0], WakefulError):
        raise outcome[0]
    return outcome[0].to_json()


def _attach(ctx: RunContext, args: Any) -> dict[str, Any]:
    """Only from the triage session, and only its own events (`core.attach` checks the event is there)."""
    answer: dict[str, Any] = {}

    def attach_it(conn: Connection) -> None:
        if not triage.is_triage(conn, ctx.session_id):
            raise Conflict("not_in_triage", "attach_event works only in the triage session")
        answer.update(attach.attach(conn, user_id=ctx.user_id, event_id=args.event_id, task_id=args.task_id,
                                    actor=_harness_actor(ctx), reason=args.reason, now=ctx.now()))

    ctx.persist(attach_it)
    return answer


def _insert(table: Table, row: dict[str, Any], conn: Connection) -> None:
    conn.execute(table.insert().values(**row))
