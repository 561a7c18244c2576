"""The sealer: hashes new chain entries, in the order they were written, into the chain, and signs a checkpoint.

Run by the sweeper's loop and before `wakeful ledger verify` and `export`. Each batch is one write transaction
(on PostgreSQL under an advisory lock, so two sealers take turns): it reads the chain's head, gives each unsealed
entry (oldest `seq` first) the next position, its row's hash and the chain hash, and ends with a checkpoint signed
at the new head. An entry's position is given when it is sealed, not when it is written: on PostgreSQL a
transaction may commit its entries after a later one's were sealed, and they simply follow them in the chain.

What a seal cannot see: a row changed between its insert and its seal is sealed as it then was. The history tables
refuse updates by trigger, so that takes someone who can drop triggers, within one sweep interval.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime

from sqlalchemy import Connection, Engine, and_, bindparam, insert, select, text, update

from wakeful.server.audit.canonical import GENESIS, MISSING_ROW, Part, chain_link, row_hash
from wakeful.server.audit.rows import parts, rows_with_keys
from wakeful.server.audit.signing import LedgerKey
from wakeful.server.errors import Conflict
from wakeful.server.store.db import write
from wakeful.server.store.tables import ledger_chain, ledger_checkpoints, metadata

__all__ = ["seal"]

log = logging.getLogger(__name__)

_LOCK = 0x6C6564676572  # the advisory lock sealers take on PostgreSQL ("ledger")


def seal(engine: Engine, key: LedgerKey, *, now: datetime, batch: int = 500) -> int:
    """Seal every entry written so far, `batch` per transaction; returns how many were sealed.

    Small batches: each holds SQLite's write lock while it hashes (about a millisecond per 4 rows here), and the
    inbox's acknowledgements wait behind it."""
    total = 0
    while True:
        with write(engine) as conn:
            sealed = _seal_batch(conn, key, now=now, batch=batch)
        total += sealed
        if sealed < batch:
            return total


def _seal_batch(conn: Connection, key: LedgerKey, *, now: datetime, batch: int) -> int:
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:lock)"), {"lock": _LOCK})
    head = conn.execute(select(ledger_chain.c.pos, ledger_chain.c.chain_hash).where(ledger_chain.c.pos.is_not(None))
                        .order_by(ledger_chain.c.pos.desc()).limit(1)).first()
    pos, chain = (0, GENESIS) if head is None else (int(head.pos), str(head.chain_hash))
    pending = conn.execute(select(ledger_chain.c.seq, ledger_chain.c.tbl, ledger_chain.c.row_key, ledger_chain.c.part)
                           .where(ledger_chain.c.pos.is_(None)).order_by(ledger_chain.c.seq).limit(batch)).all()
    if not pending:
        return 0
    keys: dict[str, list[str]] = defaultdict(list)
    for entry in pending:
        keys[entry.tbl].append(entry.row_key)
    rows = {name: rows_with_keys(conn, metadata.tables[name], wanted) for name, wanted in keys.items()}
    sealed = []
    for entry in pending:
        table, part = metadata.tables[entry.tbl], Part(entry.part)
        row = rows[entry.tbl].get(entry.row_key)
        hashed = dict(parts(table, row)) if row is not None else {}
        if part not in hashed:  # only where someone removed a row, or an attempt's outcome, behind the triggers
            log.warning("ledger: %s %s (%s) is gone before its seal", entry.tbl, entry.row_key, part)
        digest = row_hash(entry.tbl, part, hashed[part]) if part in hashed else MISSING_ROW
        pos, chain = pos + 1, chain_link(chain, digest)
        sealed.append({"b_seq": entry.seq, "b_pos": pos, "b_row": digest, "b_chain": chain})
    moved = conn.execute(update(ledger_chain).where(and_(ledger_chain.c.seq == bindparam("b_seq"),
                                                         ledger_chain.c.pos.is_(None)))
                         .values(pos=bindparam("b_pos"), row_hash=bindparam("b_row"),
                                 chain_hash=bindparam("b_chain")), sealed).rowcount
    if moved != len(sealed):
        raise Conflict("ledger_seal_raced", f"sealed {moved} of {len(sealed)} ledger entries: another sealer took "
                                            "some; this batch is rolled back")
    checkpoint = key.checkpoint(pos=pos, chain_hash=chain, now=now)
    conn.execute(insert(ledger_checkpoints).values(pos=checkpoint.pos, chain_hash=checkpoint.chain_hash,
                                                   signed_at=checkpoint.signed_at, key_id=checkpoint.key_id,
                                                   signature=checkpoint.signature))
    return len(sealed)
