"""JSON from outside, parsed within bounds: depth, number length and duplicate keys are checked as the text is read,
so a hostile body (50,000 levels of nesting, a 5,000-digit integer, `NaN`, `1e999`, two values for one key) is a 400
with a stable code instead of a `RecursionError` or a `ValueError` deep in the parser, or an infinity stored where
JSON was promised. Where the strings go to columns as they are (`COLUMN_TEXT`: the control channel, cursors), text a
column cannot keep is refused the same way: half a surrogate pair (`"\\ud800"`, which no database driver encodes)
and NUL (`"\\u0000"`, which PostgreSQL stores in no text). A webhook's payload is stored as JSON, escaped; the
inbox checks the values it reads out of it itself.

The size is bounded before this is called (the caller reads at most `max_body_bytes`). The depth is measured on the
raw text with one regular expression (strings skipped, and looked into only for `\\u` escapes), before `json.loads`
could recurse on it.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final

from starlette.types import Receive

from wakeful.server.errors import BadRequest, PayloadTooLarge

__all__ = ["COLUMN_TEXT", "Disconnected", "JsonLimits", "loads", "read", "refuse_declared"]

# A JSON string (with its escapes), or one bracket. Everything else cannot change the depth.
_TOKENS: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)
# One escape inside a string: a `\uXXXX` (its code unit captured) or any other.
_ESCAPES: Final = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.S)


@dataclass(frozen=True, kw_only=True)
class JsonLimits:
    max_depth: int = 64
    """Arrays and objects nested deeper than this are refused (`json_too_deep`)."""
    max_number_chars: int = 64
    """A number written with more characters than this is refused (`number_too_long`)."""
    column_text: bool = False
    """Refuse a string no text column can keep as it is: NUL, or half a surrogate pair (`malformed_body`)."""


COLUMN_TEXT: Final = JsonLimits(column_text=True)
"""The limits for a body whose strings are stored as they are."""


def loads(raw: bytes, limits: JsonLimits = JsonLimits()) -> Any:
    """The JSON value in `raw` (UTF-8), or BadRequest with one of: `malformed_body`, `json_too_deep`,
    `number_too_long`, `number_out_of_range`, `duplicate_key`."""
    _check_text(raw, limits)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("malformed_body", "the body is not UTF-8") from None
    try:
        return _decoder(limits).decode(text)
    except _Refused as exc:
        raise BadRequest(exc.code, exc.message) from None
    except (json.JSONDecodeError, ValueError, RecursionError):
        raise BadRequest("malformed_body", "the body is not valid JSON") from None


class Disconnected(Exception):
    """The client went away before its whole body arrived."""


def refuse_declared(declared: str | None, limit: int) -> None:
    """Refuse (`payload_too_large`) a body whose `Content-Length` says it is over `limit`, before reading any of it."""
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise PayloadTooLarge("payload_too_large", f"bodies over {limit} bytes are refused")


async def read(receive: Receive, limit: int) -> bytes:
    """A request's whole body from its ASGI messages, refused (`payload_too_large`) as soon as it passes `limit`."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge("payload_too_large", f"bodies over {limit} bytes are refused")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class _Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _check_text(raw: bytes, limits: JsonLimits) -> None:
    """The depth, and the strings' escapes where the limits ask, before anything is parsed."""
    max_depth, depth = limits.max_depth, 0
    for match in _TOKENS.finditer(raw):
        token = match.group()
        first = token[:1]
        if first == b'"':
            problem = _not_text(token) if limits.column_text and b"\\u" in token else None
            if problem is not None:
                raise BadRequest("malformed_body", f"a string in the body {problem}")
        elif first in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise BadRequest("json_too_deep", f"the body nests arrays and objects deeper than {max_depth} levels")
        elif first in (b"]", b"}"):
            depth -= 1


_HALF_A_PAIR: Final = "escapes half of a surrogate pair: it is not text"


def _not_text(string: bytes) -> str | None:
    """Why a JSON string token's escapes make it text the server cannot keep (NUL, or a surrogate that is not half of
    an adjacent high-low pair); None when they do not."""
    awaiting_low_at = None  # where a high surrogate's escape ended: its low one must start right there
    for escape in _ESCAPES.finditer(string):
        unit = int(escape.group(1), 16) if escape.group(1) else None
        low = unit is not None and 0xDC00 <= unit <= 0xDFFF
        if awaiting_low_at is not None:
            if escape.start() != awaiting_low_at or not low:
                return _HALF_A_PAIR
            awaiting_low_at = None
        elif unit == 0:
            return "holds NUL (\\u0000), which the database stores in no text"
        elif unit is not None and 0xD800 <= unit <= 0xDBFF:
            awaiting_low_at = escape.end()
        elif low:
            return _HALF_A_PAIR
    return _HALF_A_PAIR if awaiting_low_at is not None else None


@functools.cache
def _decoder(limits: JsonLimits) -> json.JSONDecoder:
    """The decoder for `limits`, built once: `json.loads` with hooks builds one (and its scanner) per call. It keeps
    no state between documents, so every request may share it."""
    return json.JSONDecoder(parse_int=_number(int, limits), parse_float=_number(float, limits),
                            parse_constant=_no_constant, object_pairs_hook=_unique_keys)


def _number(kind: type, limits: JsonLimits) -> Any:
    def parse(text: str) -> Any:
        if len(text) > limits.max_number_chars:
            raise _Refused("number_too_long", f"a number in the body is longer than {limits.max_number_chars} "
                                              "characters")
        number = kind(text)
        if not math.isfinite(number):  # 1e999 reads as infinity, which JSON cannot write back
            raise _Refused("number_out_of_range", f"the number {text} in the body is beyond a double's range")
        return number

    return parse


def _no_constant(name: str) -> Any:
    raise _Refused("malformed_body", f"{name} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:  # which one wins differs between parsers: the sender's meaning is unclear, so refuse
            raise _Refused("duplicate_key", f"the key {key!r} appears twice in one object")
        result[key] = value
    return result
