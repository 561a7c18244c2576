"""The Anthropic model adapter: the only module that imports `anthropic`.

The stable prefix (system prompt, the user's instructions, tool definitions) and the task snapshot carry
prompt-caching breakpoints, so a wake re-reads them from the cache; the tail (task state, new events, time)
follows. The API key comes from settings and is never logged or stored.
"""

from __future__ import annotations

from typing import Any

import anthropic

from wakeful.server.harness.model import ModelError, ModelReply, ModelRequest, ToolCall

__all__ = ["AnthropicModel", "request_payload"]


def request_payload(request: ModelRequest, *, model: str, max_tokens: int) -> dict[str, Any]:
    """The Messages API call for a request (pure: tested without a network)."""
    tools = [dict(t) for t in request.tools]
    if tools:
        tools[-1] = {**tools[-1], "cache_control": {"type": "ephemeral"}}  # caches system + tools together
    system = [{"type": "text", "text": request.prefix, "cache_control": {"type": "ephemeral"}}]
    if request.snapshot:  # its own breakpoint: a new snapshot leaves the prefix's cache entry in use
        system.append({"type": "text", "text": request.snapshot, "cache_control": {"type": "ephemeral"}})
    return {
        "model": model,
        "max_tokens": max_tokens,
        "system": system,
        "tools": tools,
        "messages": list(request.messages),
    }


class AnthropicModel:
    def __init__(self, *, api_key: str, model: str, max_tokens: int = 2048, timeout: float = 60.0) -> None:
        self.name = model
        self._model = model
        self._max_tokens = max_tokens
        self._client = anthropic.Anthropic(api_key=api_key, timeout=timeout, max_retries=2)

    def complete(self, request: ModelRequest) -> ModelReply:
        try:
            message = self._client.messages.create(**request_payload(request, model=self._model,
                                                                     max_tokens=self._max_tokens))
        except anthropic.APIError as exc:  # the message never includes the key
            raise ModelError(f"{type(exc).__name__}: {getattr(exc, 'message', exc)}") from None
        text = "".join(b.text for b in message.content if b.type == "text")
        tool_calls = tuple(ToolCall(id=b.id, name=b.name, args=dict(b.input))
                           for b in message.content if b.type == "tool_use")
        usage = message.usage
        return ModelReply(text=text, tool_calls=tool_calls, model=message.model, input_tokens=usage.input_tokens,
                          output_tokens=usage.output_tokens,
                          cached_tokens=getattr(usage, "cache_read_input_tokens", 0) or 0)
