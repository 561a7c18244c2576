"""`wakeful replay RUN_ID`: re-run a recorded run from its records, with its recorded decisions, and show where
the outcome differs.

The run's context is re-assembled from the records, as of the run's start, and compared byte for byte with the
recorded one (a changed prefix means the instructions, the tool declarations or the system prompt changed since;
a changed snapshot or tail, that records the run could see changed — or that a timer fired since: timers keep no
history), the stored model replies are fed back in order, and
each tool call is answered with its recorded result — nothing is sent anywhere. The replayed ending (message,
silence or wait) is compared with the recorded one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from os.path import commonprefix
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, select

from wakeful.server.acting.connectors import Registry
from wakeful.server.core.worker import EventView
from wakeful.server.errors import NotFound
from wakeful.server.harness.context import assemble, sent_text
from wakeful.server.harness.model import ModelReply
from wakeful.server.store.tables import decisions, events, run_contexts, runs, tool_results

__all__ = ["ReplayReport", "ending_of", "replay"]


@dataclass(kw_only=True)
class ReplayReport:
    run_id: str
    recorded_ending: str
    replayed_ending: str
    prefix_same: bool
    context_same: bool
    steps: list[dict[str, Any]] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        prefix = "unchanged" if self.prefix_same else "DIFFERENT from the recorded one"
        context = "the same bytes" if self.context_same else "DIFFERENT from the recorded one"
        out = [f"run {self.run_id}", f"prefix: {prefix}", f"context: {context}"]
        for s in self.steps:
            calls = ", ".join(f"{c['tool']}→{c['result']}" for c in s["calls"]) or "(no tool calls)"
            out.append(f"step {s['step']}: {calls}")
        out.append(f"ending: recorded {self.recorded_ending!r}, replayed {self.replayed_ending!r}")
        out.extend(f"DIFFERS: {d}" for d in self.differences)
        out.append("outcome: same" if not self.differences else "outcome: differs")
        return out


def ending_of(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The ending the harness gives a run, from its tool calls and their results, in order."""
    if any(tool == "send_to_user" and "error" not in result for tool, result in calls):
        return "message"
    if any(result.get("status") == "needs_approval" for _, result in calls):
        return "wait"
    return "silence"


def replay(conn: Connection, run_id: str, *, registry: Registry, instructions: Path | None,
           computers: bool = False) -> ReplayReport:
    run = conn.execute(select(runs).where(runs.c.id == run_id)).first()
    context = conn.execute(select(run_contexts).where(run_contexts.c.run_id == run_id)).first()
    if run is None:
        raise NotFound("unknown_run", f"no run {run_id}")
    if context is None:
        raise NotFound("unknown_run", f"run {run_id} kept no model context to replay: it ran without a model (none "
                                      "was configured, or the echo handler ran)")
    handled = conn.execute(select(events).where(events.c.run_id == run_id)
                       .order_by(events.c.received_at, events.c.id)).all()  # the order the run was handed them in
    views = tuple(EventView(id=e.id, source=e.source, source_id=e.source_id, kind=e.kind, trust=e.trust,
                            corr_key=e.corr_key, payload=json.loads(e.payload), received_at=e.received_at)
                  for e in handled)
    now_context = assemble(conn, registry=registry, instructions=instructions, user_id=run.user_id,
                           session_id=run.session_id, run_id=run_id, events=views, computers=computers)
    recorded = sent_text(context.prefix, json.loads(context.tail))
    recorded_results = {(r.step, r.call_id): json.loads(r.result)
                        for r in conn.execute(select(tool_results).where(tool_results.c.run_id == run_id))}
    report = ReplayReport(run_id=run_id, recorded_ending=(run.reason or "").split(":")[0], replayed_ending="",
                          prefix_same=now_context.prefix_sha256 == context.prefix_sha256,
                          context_same=now_context.sent() == recorded)
    if not report.prefix_same:
        report.differences.append("the context prefix changed since the run (instructions, tools or prompt)")
    if not report.context_same:
        at = len(commonprefix([recorded, now_context.sent()]))
        report.differences.append(f"the context differs from the recorded one from character {at} on")
    answered: list[tuple[str, dict[str, Any]]] = []
    for d in conn.execute(select(decisions).where(decisions.c.run_id == run_id).order_by(decisions.c.step)):
        reply = ModelReply.from_json(json.loads(d.proposal))
        step_calls = []
        for call in reply.tool_calls:
            result = recorded_results.get((d.step, call.id))
            if result is None:
                report.differences.append(f"step {d.step}: {call.name} has no recorded result (the run stopped "
                                          "before it; a replay cannot know what it would return)")
                result = {"error": {"code": "not_recorded"}}
            answered.append((call.name, result))
            step_calls.append({"tool": call.name, "result": result.get("error", {}).get("code")
                               or result.get("status") or "ok"})
        report.steps.append({"step": d.step, "calls": step_calls})
    report.replayed_ending = ending_of(answered)
    if run.outcome == "completed" and report.replayed_ending != report.recorded_ending:
        report.differences.append(f"the run ended in {report.recorded_ending!r}; replayed, it ends in "
                                  f"{report.replayed_ending!r}")
    return report
