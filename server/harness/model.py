"""The model, behind one small interface: the harness sends a request and gets proposals back.

`ScriptedModel` replays fixed replies (tests and demos; no network). The Anthropic adapter lives in
`server.model_anthropic`, the only module that imports `anthropic`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = ["ModelAdapter", "ModelError", "ModelReply", "ModelRequest", "ScriptedModel", "ToolCall", "calls", "quiet"]


class ModelError(Exception):
    """The model could not be reached or answered unusably; the run fails and its events stay pending."""


@dataclass(frozen=True, kw_only=True)
class ToolCall:
    id: str
    name: str
    args: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class ModelRequest:
    """`prefix` is byte-identical across wakes for the same records and `snapshot` (the task as of the delegation's
    last compaction point) across the wakes between two compaction points: both cacheable; `messages` is the tail."""

    prefix: str
    tools: tuple[dict[str, Any], ...]
    messages: tuple[dict[str, Any], ...]
    snapshot: str = ""


@dataclass(frozen=True, kw_only=True)
class ModelReply:
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    model: str = "scripted"

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "model": self.model, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "cached_tokens": self.cached_tokens,
                "tool_calls": [{"id": c.id, "name": c.name, "args": c.args} for c in self.tool_calls]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelReply:
        return cls(text=data.get("text", ""), model=data.get("model", "?"),
                   input_tokens=data.get("input_tokens", 0), output_tokens=data.get("output_tokens", 0),
                   cached_tokens=data.get("cached_tokens", 0),
                   tool_calls=tuple(ToolCall(id=c["id"], name=c["name"], args=c["args"])
                                    for c in data.get("tool_calls", [])))


class ModelAdapter(Protocol):
    name: str

    def complete(self, request: ModelRequest) -> ModelReply: ...


Step = ModelReply | Callable[[ModelRequest], ModelReply]


@dataclass
class ScriptedModel:
    """Answers with the next scripted reply (or calls a function of the request for it); when the script runs
    out it stays quiet. Records every request it saw, so tests can look at the context it was given."""

    script: list[Step]
    name: str = "scripted"
    seen: list[ModelRequest] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def complete(self, request: ModelRequest) -> ModelReply:
        with self._lock:
            self.seen.append(request)
            step = self.script.pop(0) if self.script else quiet("the script is over")
        return step(request) if callable(step) else step


def quiet(reason: str) -> ModelReply:
    return ModelReply(tool_calls=(ToolCall(id="quiet", name="stay_quiet", args={"reason": reason}),))


def calls(*pairs: tuple[str, dict[str, Any]], text: str = "") -> ModelReply:
    """A reply proposing these tool calls, in order."""
    return ModelReply(text=text, tool_calls=tuple(ToolCall(id=f"c{i}", name=n, args=a)
                                                  for i, (n, a) in enumerate(pairs)))


