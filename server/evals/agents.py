"""The scripted models scenarios run with by default: each a small playbook that answers the harness's request from
what it shows (the wake's events, the last tool results), so it plays its part however the runs fall.

A playbook gets a `Turn` and returns the next reply. `scripted(playbook)` makes it the `ScriptedModel` a
scenario's harness calls; `--model anthropic` replaces it with the real model and the same scenario.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wakeful.server.harness.model import ModelReply, ModelRequest, ScriptedModel

__all__ = ["Playbook", "Turn", "end", "scripted"]

MAX_STEPS = 1000
"""More steps than any scenario takes: the script never runs out before the scenario ends."""
_EVENT = re.compile(r'<event id="[^"]*" source="([^"]*)"[^>]*>\n(.*?)\n</event>', re.S)
"""One event of the tail as `server.harness.context.render_tail` writes it: its source, then its payload's JSON."""


@dataclass(frozen=True)
class Turn:
    tail: str
    """The wake's tail as the model reads it: the task state and each event with its source."""
    called: tuple[str, ...]
    """The tools the previous step called, in order (empty on a wake's first step)."""
    results: tuple[dict[str, Any], ...]
    """Their results, in the same order."""
    args: tuple[dict[str, Any], ...] = ()
    """Their arguments, in the same order."""

    @property
    def woken_by_delegation(self) -> bool:
        return not self.called and 'source="delegation"' in self.tail

    def events(self, source: str) -> list[Any]:
        """The payloads of this wake's events from `source` (a webhook source, "timer", "wait"), in order."""
        return [json.loads(payload) for named, payload in _EVENT.findall(self.tail) if named == source]

    def result_of(self, tool: str) -> dict[str, Any]:
        return self.results[self.called.index(tool)]

    def args_of(self, tool: str) -> dict[str, Any]:
        return self.args[self.called.index(tool)]

    def after(self, tool: str) -> bool:
        return tool in self.called


Playbook = Callable[[Turn], ModelReply]


def end(text: str = "") -> ModelReply:
    """No tool call: the run ends (a silence, or whatever the run already said)."""
    return ModelReply(text=text)


def _turn(request: ModelRequest) -> Turn:
    tail = request.messages[0]["content"]
    last = request.messages[-1]
    if len(request.messages) == 1:
        return Turn(tail=tail, called=(), results=())
    asked = request.messages[-2]["content"]
    return Turn(tail=tail, called=tuple(c["name"] for c in asked),
                results=tuple(_loaded(r["content"]) for r in last["content"]),
                args=tuple(dict(c.get("args") or c.get("input") or {}) for c in asked))


def _loaded(content: Any) -> dict[str, Any]:
    try:
        value = json.loads(content) if isinstance(content, str) else content
    except ValueError:
        return {"text": content}
    return value if isinstance(value, dict) else {"value": value}


def scripted(playbook: Playbook) -> ScriptedModel:
    def step(request: ModelRequest) -> ModelReply:
        return playbook(_turn(request))
    return ScriptedModel([step] * MAX_STEPS)
