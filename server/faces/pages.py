"""Cursor pagination for the list endpoints: a bounded `limit` and an opaque `cursor` that names the last row seen.

A cursor is the sort key of the last row of a page (base64url of its JSON), so the next page starts strictly after
it however many rows were added meanwhile; a cursor the server did not write is a 400 `bad_cursor`.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Annotated, Any

from fastapi import Query

from wakeful.server.errors import BadRequest
from wakeful.server.faces import bodies

__all__ = ["MAX_LIMIT", "Cursor", "Limit", "decode_cursor", "encode_cursor"]

MAX_LIMIT = 1000
Limit = Annotated[int, Query(ge=1, le=MAX_LIMIT, description=f"rows per page, 1..{MAX_LIMIT}")]
Cursor = Annotated[str | None, Query(max_length=512, description="the `next` of the previous page")]


def encode_cursor(key: list[str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(key, separators=(",", ":")).encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None, *, parts: int) -> list[str] | None:
    """The sort key a cursor names, or None for the first page."""
    if cursor is None:
        return None
    try:  # parsed as a body is: half a surrogate pair, say, never reaches the query
        key: Any = bodies.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)), bodies.COLUMN_TEXT)
    except (binascii.Error, ValueError, BadRequest):
        key = None
    if not (isinstance(key, list) and len(key) == parts and all(isinstance(k, str) and len(k) <= 200 for k in key)):
        raise BadRequest("bad_cursor", "the cursor is not one this server gave out: pass the `next` of a page")
    return key
