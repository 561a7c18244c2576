"""The always-on harness: one wake of the model, from records to exactly one ending.

    assemble the context from records (stable prefix, this wake's tail) and record it
    loop: step budget → the model proposes (persisted as a decision before anything acts on it; a resumed run
          replays the stored one) → each tool call goes through the same tool layer and admission as MCP calls,
          and its result is recorded
    end in exactly one of: a message through the outbox, an explicit silence with a reason, or a wait
Plain model text is stored with its decision and never reaches the user. A helper task's run (`helper_run`) goes
the same way with its own context and tools, and ends in its result or its failure, told to the main task.
"""

from __future__ import annotations

import json
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Table

from wakeful.server.acting.connectors import Registry
from wakeful.server.core.worker import RunContext, RunInterrupted
from wakeful.server.errors import WakefulError
from wakeful.server.harness.context import Context, assemble, render_tail
from wakeful.server.harness.helper_run import HelperRun
from wakeful.server.harness.model import ModelAdapter, ModelReply, ModelRequest, ToolCall
from wakeful.server.store.db import read
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import RunOutcome, run_contexts, tool_results
from wakeful.server.tools.specs import Face, spec

__all__ = ["HARNESS_VERSION", "Harness"]

HARNESS_VERSION = "1"
_OWN = frozenset({"send_to_user", "stay_quiet", "schedule_followup", "start_helper"})


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
                               session_id=ctx.session_id, events=ctx.events, now=ctx.now(),
                               computers=self.computers)
        ctx.persist(lambda conn: conn.execute(run_contexts.insert().values(
            run_id=ctx.run_id, prefix_sha256=context.prefix_sha256, prefix=context.prefix,
            tail=json.dumps(context.tail, sort_keys=True, default=str), model=self.model.name,
            harness_version=HARNESS_VERSION, created_at=ctx.now())))
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
            request = ModelRequest(prefix=context.prefix, tools=context.tools, messages=tuple(messages))
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
                ctx.send_to_user(args.text)
                return {"sent": True}
            if call.name == "stay_quiet":
                ctx.silence(args.reason or "no reason given")
                return {"quiet": True}
            if task is None:
                raise WakefulError("no_task", "this wake belongs to no task; only send_to_user and stay_quiet work")
            task_id: str = task["task_id"]
            if call.name == "schedule_followup":
                at = ctx.now() + timedelta(seconds=args.in_seconds)
                ctx.follow_up(task_id=task_id, at=at, note=args.note)
                return {"scheduled_for": at.isoformat()}
            if call.name == "start_helper":
                helper_id = ctx.start_helper(task_id=task_id, task_version=task["version"],
                                             goal=args.goal, constraints=list(args.constraints),
                                             output_form=args.output_form)
                return {"helper_id": helper_id, "state": "starting when this wake ends"}
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


def _insert(table: Table, row: dict[str, Any], conn: Connection) -> None:
    conn.execute(table.insert().values(**row))
