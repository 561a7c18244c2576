"""Reading chained rows in their canonical form: every row of a table, or the rows of given keys."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Table, select, tuple_

from wakeful.server.audit.canonical import Part, canonical_row, columns_of, row_key
from wakeful.server.store.tables import CHAIN_KEY_SEPARATOR, CHAINED, metadata

__all__ = ["chained_tables", "parts", "rows_of", "rows_with_keys"]

_CHUNK = 500  # keys per IN (…) when the sealer reads the rows of new entries


def chained_tables() -> list[Table]:
    return [metadata.tables[name] for name in CHAINED]


def parts(table: Table, row: Mapping[Any, Any]) -> Iterator[tuple[Part, dict[str, Any]]]:
    """The row's chained parts, each in canonical values: its `row`, and an attempt's `outcome` once written."""
    yield Part.ROW, canonical_row(row, columns_of(table, Part.ROW))
    if table.name == "attempts" and row["outcome"] is not None:
        yield Part.OUTCOME, canonical_row(row, columns_of(table, Part.OUTCOME))


def rows_of(conn: Connection, table: Table) -> Iterator[tuple[str, Mapping[Any, Any]]]:
    """Every row of `table`, with its chain key."""
    for row in conn.execute(select(table)).mappings():
        yield row_key(table, row), row


def rows_with_keys(conn: Connection, table: Table, keys: Sequence[str]) -> dict[str, Mapping[Any, Any]]:
    """The rows of `table` with these chain keys (a key whose row is gone is left out)."""
    pk = list(table.primary_key)
    found: dict[str, Mapping[Any, Any]] = {}
    for first in range(0, len(keys), _CHUNK):
        chunk = keys[first:first + _CHUNK]
        if len(pk) == 1:
            where = pk[0].in_(chunk)
        else:
            where = tuple_(*pk).in_([tuple(key.split(CHAIN_KEY_SEPARATOR)) for key in chunk])
        for row in conn.execute(select(table).where(where)).mappings():
            found[row_key(table, row)] = row
    return found
