"""What the memory scenarios share: the scripted agent's reading of a wake's tail (its events with their IDs, the
recalled `<memory>` block, the record IDs the history names) and its one door to memory (the `remember` tool), and
the user's side over HTTP (`/v1/memory…`: write, list, show, correct).

The judges read memory only through the HTTP API (`GET /v1/memory`, `GET /v1/memory/{id}`, the task's ledger
entries of type `memory`), beside the simulators' own records.
"""

from __future__ import annotations

import json
import re
from typing import Any

from wakeful.server.evals.agents import Turn
from wakeful.server.evals.world import EvalWorld
from wakeful.server.harness.model import ModelReply, calls

__all__ = ["SEATS", "add_memory", "changes", "correct", "event_ids", "memories", "mentioned", "recalled",
           "remember", "runs_calling", "seat_recalled", "show", "tell"]

SEATS = ("aisle", "window", "middle")
_EVENT = re.compile(r'<event id="([^"]*)" source="([^"]*)"[^>]*>\n(.*?)\n</event>', re.S)
_MEMORY = re.compile(r"<memory\b[^>]*>(.*?)</memory>", re.S)


# -- the agent's side -------------------------------------------------------------------------------------------------


def event_ids(turn: Turn, source: str) -> list[tuple[str, Any]]:
    """This wake's events from `source`, each as (event ID, payload), in order."""
    return [(event_id, json.loads(payload)) for event_id, named, payload in _EVENT.findall(turn.tail)
            if named == source]


def recalled(turn: Turn) -> list[dict[str, Any]]:
    """The records recalled into this wake's `<memory>` block, one JSON object a line (each with at least its
    `text`); the wider records a narrower one overrides are named in a nested tag and are not recalled. Empty when
    nothing was recalled."""
    found: list[dict[str, Any]] = []
    for block in _MEMORY.findall(turn.tail):
        for line in block.splitlines():
            if not line.startswith(("{", "[")):
                continue
            try:
                _items(json.loads(line), found)
            except ValueError:
                continue
    return found


def _items(value: Any, found: list[dict[str, Any]]) -> None:
    if isinstance(value, dict):
        if isinstance(value.get("text"), str):
            found.append(value)
        else:
            for inner in value.values():
                _items(inner, found)
    elif isinstance(value, list):
        for inner in value:
            _items(inner, found)


def seat_recalled(turn: Turn) -> str | None:
    """The seat a recalled preference asks for (the first recalled record about a seat that names one), or None."""
    for item in recalled(turn):
        if item.get("form") not in (None, "preference", "instruction"):
            continue
        text = f"{item.get('value', '')} {item['text']}".lower()
        if "seat" in text or item.get("subject") == "seat":
            named = [s for s in SEATS if s in text]
            if named:
                return named[0]
    return None


def mentioned(turn: Turn, prefix: str) -> list[str]:
    """Record IDs with `prefix` ("apr", "act") the tail names (its changes and history digest), first seen first."""
    return list(dict.fromkeys(re.findall(rf"\b{prefix}_[0-9a-z]+\b", turn.tail)))


def remember(**proposal: Any) -> ModelReply:
    """Propose a memory record (the `remember` tool: the updater's only door; the committer decides)."""
    return calls(("remember", proposal))


def tell(turn: Turn, tool: str = "remember") -> dict[str, Any]:
    """The last call's result of `tool` ({} when it was not called)."""
    return turn.result_of(tool) if turn.after(tool) else {}


# -- the user's side, over HTTP ---------------------------------------------------------------------------------------


def add_memory(w: EvalWorld, **record: Any) -> dict[str, Any]:
    """The user writes a record (`POST /v1/memory`): active at once, spoken by the user."""
    answer = w.post("/v1/memory", record)
    answer.raise_for_status()
    return dict(answer.json())


def memories(w: EvalWorld, **query: Any) -> list[dict[str, Any]]:
    """The user's records, every version (`GET /v1/memory?...`), all pages."""
    found: list[dict[str, Any]] = []
    after: str | None = None
    while True:
        params = {k: str(v).lower() if isinstance(v, bool) else v for k, v in query.items()}
        page = w.api.get("/v1/memory", params={**params, "limit": 100, **({"after": after} if after else {})})
        page.raise_for_status()
        body = page.json()
        found.extend(body["records"])
        after = body.get("after") or body.get("next")
        if not after or not body["records"]:
            return found


def show(w: EvalWorld, memory_id: str) -> dict[str, Any]:
    """One record with its lineage, evidence, what was derived from it and the runs that recalled it."""
    return dict(w.get(f"/v1/memory/{memory_id}"))


def correct(w: EvalWorld, memory_id: str, reason: str, text: str | None = None) -> dict[str, Any]:
    answer = w.post(f"/v1/memory/{memory_id}/correct", {"reason": reason, **({"text": text} if text else {})})
    answer.raise_for_status()
    return dict(answer.json())


def changes(w: EvalWorld, task_id: str) -> list[dict[str, Any]]:
    """The task's memory changes as its ledger shows them (committed, refused with a code, expired, ...)."""
    return [e for e in w.ledger(task_id) if e["type"] == "memory"]


def runs_calling(w: EvalWorld, task_id: str, tool: str) -> list[str]:
    """The runs of the task whose model proposed `tool`, in order (its decisions in the ledger)."""
    steps = sorted((e for e in w.ledger(task_id) if e["type"] == "decision"), key=lambda e: (e["at"], e["step"]))
    return list(dict.fromkeys(e["run_id"] for e in steps
                              if tool in [c["name"] for c in e["proposal"]["tool_calls"]]))
