"""The database against its chain: every chained row, every entry and every checkpoint, read in one snapshot.

`snapshot` reads them (the export writes the same thing to a file); `verify_database` runs `chain.check` over the
sealed entries and adds the rows that have no entry at all (`inserted`: written with the triggers dropped).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Engine, select

from wakeful.server.audit.canonical import row_hash
from wakeful.server.audit.chain import Entry, Problem, ProblemKind, Verdict, check
from wakeful.server.audit.rows import chained_tables, parts, rows_of
from wakeful.server.audit.signing import Checkpoint, PublicKey
from wakeful.server.store.db import read
from wakeful.server.store.tables import ledger_chain, ledger_checkpoints

__all__ = ["Snapshot", "snapshot", "verify_database"]


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    entries: list[tuple[Entry, dict[str, Any] | None]]  # sealed, in position order, each with its row as it is now
    checkpoints: list[Checkpoint]
    outside: list[tuple[str, str, str]]                 # (table, key, part) of rows with no entry
    pending: int                                        # entries not sealed yet


@contextmanager
def _consistent(engine: Engine) -> Iterator[Connection]:
    """One snapshot for every read (PostgreSQL's READ COMMITTED would give each statement its own)."""
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn, conn.begin():
            yield conn
        return
    with read(engine) as conn:
        yield conn


def snapshot(engine: Engine) -> Snapshot:
    with _consistent(engine) as conn:
        current: dict[tuple[str, str, str], dict[str, Any]] = {}
        for table in chained_tables():
            for key, row in rows_of(conn, table):
                for part, values in parts(table, row):
                    current[(table.name, key, part.value)] = values
        listed = conn.execute(select(ledger_chain).order_by(ledger_chain.c.pos)).mappings().all()
        signed = conn.execute(select(ledger_checkpoints).order_by(ledger_checkpoints.c.pos)).mappings().all()
    entries: list[tuple[Entry, dict[str, Any] | None]] = []
    unsealed = set()
    for e in listed:
        ident = (e["tbl"], e["row_key"], e["part"])
        if e["pos"] is None:
            unsealed.add(ident)
            continue
        found = current.pop(ident, None)
        computed = None if found is None else row_hash(e["tbl"], e["part"], found)
        entries.append((Entry(pos=e["pos"], table=e["tbl"], key=e["row_key"], part=e["part"], row_hash=e["row_hash"],
                              chain_hash=e["chain_hash"], computed=computed), found))
    checkpoints = [Checkpoint(pos=c["pos"], chain_hash=c["chain_hash"], signed_at=c["signed_at"], key_id=c["key_id"],
                              signature=c["signature"]) for c in signed]
    return Snapshot(entries=entries, checkpoints=checkpoints, outside=[i for i in current if i not in unsealed],
                    pending=len(unsealed))


def verify_database(engine: Engine, key: PublicKey) -> Verdict:
    """Every check of `chain.check`, and every chained row must have an entry."""
    seen = snapshot(engine)
    verdict = check((entry for entry, _ in seen.entries), seen.checkpoints, key)
    stray = [Problem(kind=ProblemKind.INSERTED, pos=None, table=table, key=key_, part=part,
                     detail="the row has no entry in the chain: written behind the ledger's triggers")
             for table, key_, part in seen.outside]
    return Verdict(entries=verdict.entries, checkpoints=verdict.checkpoints, head_pos=verdict.head_pos,
                   head_hash=verdict.head_hash, pending=seen.pending, problems=verdict.problems + stray)
