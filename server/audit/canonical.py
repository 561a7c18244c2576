"""A chained row's canonical form and the hashes over it: pure, the same on SQLite and PostgreSQL.

A row's canonical form is JSON with sorted keys and no spaces, UTF-8, of `{"table", "part", "row"}`, where `row`
maps each column to its value as the store returns it (timestamps as ISO 8601 UTC with microseconds and `Z`).
The row hash is SHA-256 over that; each chain hash is SHA-256 over the previous chain hash's 32 bytes and the row
hash's 32 bytes, from `GENESIS`. An attempt is chained twice: `row` over what never changes (its request), then
`outcome` over the whole row once its outcome is written.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import Table

from wakeful.server.store.tables import CHAIN_KEY_SEPARATOR

__all__ = ["GENESIS", "MISSING_ROW", "Part", "canonical_row", "chain_link", "columns_of", "row_hash", "row_key"]

GENESIS = "0" * 64
"""The chain hash before the first entry."""

MISSING_ROW = "0" * 64
"""The row hash sealed for an entry whose row was already gone when it was sealed (only in a tampered database)."""


class Part(StrEnum):
    ROW = "row"
    OUTCOME = "outcome"  # an attempt's outcome, written once after its insert


_ATTEMPT_REQUEST = ("id", "action_id", "seq", "request", "created_at")  # what the schema lets no one change


def columns_of(table: Table, part: Part) -> list[str]:
    """The columns a part of a row covers."""
    if table.name == "attempts" and part is Part.ROW:
        return list(_ATTEMPT_REQUEST)
    return [column.name for column in table.columns]


def _value(value: Any) -> Any:
    kind = type(value)
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is datetime:
        if value.tzinfo is None:
            raise ValueError("a naive datetime in a chained row")
        if value.utcoffset():
            value = value.astimezone(UTC)
        return value.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"
    raise TypeError(f"a chained row holds a {kind.__name__}, which has no canonical form")


def canonical_row(row: Mapping[Any, Any], columns: list[str]) -> dict[str, Any]:
    """The row's values for `columns`, each in its canonical JSON form."""
    return {name: _value(row[name]) for name in columns}


_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def row_hash(table: str, part: Part | str, row: Mapping[str, Any]) -> str:
    """SHA-256 (hex) over the canonical form of a row already in canonical values (`canonical_row`, or an export's
    row as read back)."""
    document = {"table": table, "part": str(part), "row": dict(row)}
    return hashlib.sha256(_JSON.encode(document).encode()).hexdigest()


def chain_link(previous: str, row: str) -> str:
    """The chain hash after an entry: SHA-256 over the previous chain hash and the entry's row hash (32 bytes each)."""
    return hashlib.sha256(bytes.fromhex(previous) + bytes.fromhex(row)).hexdigest()


def row_key(table: Table, row: Mapping[Any, Any]) -> str:
    """The row's key as the insert triggers write it: its primary key's values joined by CHAIN_KEY_SEPARATOR."""
    return CHAIN_KEY_SEPARATOR.join(str(row[name]) for name in _key_columns(table))


@functools.cache
def _key_columns(table: Table) -> tuple[str, ...]:
    return tuple(column.name for column in table.primary_key)
