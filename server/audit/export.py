"""The chain and its rows as a file an auditor checks offline, with the ledger's public key and nothing else.

JSON Lines: a header `{"format": "wakeful-ledger-export/1", "key": ...}` (the key there is informational: the
auditor brings their own), then each sealed entry in position order `{"pos", "table", "key", "part", "row",
"row_hash", "chain_hash"}` (`row` in its canonical values, null when the row is gone), each checkpoint right after the
entry it covers: `{"checkpoint": {"pos", "chain_hash", "signed_at", "key_id", "signature"}}`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from typing import IO, Any

from wakeful.server.audit.canonical import row_hash
from wakeful.server.audit.chain import Entry, Verdict, check
from wakeful.server.audit.signing import Checkpoint, PublicKey
from wakeful.server.audit.verify import Snapshot
from wakeful.server.errors import BadRequest

__all__ = ["FORMAT", "read_export", "write_export"]

FORMAT = "wakeful-ledger-export/1"


def write_export(seen: Snapshot, out: IO[str], *, key: PublicKey) -> None:
    checkpoints = {checkpoint.pos: checkpoint for checkpoint in seen.checkpoints}
    out.write(_line({"format": FORMAT, "key": key.text()}))
    for entry, row in seen.entries:
        out.write(_line({"pos": entry.pos, "table": entry.table, "key": entry.key, "part": entry.part, "row": row,
                         "row_hash": entry.row_hash, "chain_hash": entry.chain_hash}))
        checkpoint = checkpoints.get(entry.pos)
        if checkpoint is not None:
            out.write(_line({"checkpoint": {
                "pos": checkpoint.pos, "chain_hash": checkpoint.chain_hash, "key_id": checkpoint.key_id,
                "signed_at": checkpoint.signed_at.isoformat(), "signature": checkpoint.signature}}))


def read_export(lines: Iterable[str], key: PublicKey) -> Verdict:
    """Check an export with `key` alone; BadRequest `invalid_export` when it is not one."""
    entries: list[Entry] = []
    checkpoints: list[Checkpoint] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if number == 1:
                if isinstance(item, dict) and "task_id" in item and "format" not in item:
                    raise ValueError("it is a task's history, as `wakeful ledger export -o FILE` writes; "
                                     "`wakeful ledger export FILE` writes the ledger export")
                if item.get("format") != FORMAT:
                    raise ValueError(f"not a {FORMAT} file")
            elif "checkpoint" in item:
                c = item["checkpoint"]
                checkpoints.append(Checkpoint(pos=int(c["pos"]), chain_hash=_hex(c["chain_hash"]),
                                              signed_at=_aware(datetime.fromisoformat(c["signed_at"])),
                                              key_id=str(c["key_id"]), signature=str(c["signature"])))
            else:
                entries.append(_entry(item))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BadRequest("invalid_export", f"line {number} is not part of a ledger export ({exc})") from None
    entries.sort(key=lambda entry: entry.pos)
    return check(entries, checkpoints, key)


def _entry(item: dict[str, Any]) -> Entry:
    row = item["row"]
    if row is not None and not isinstance(row, dict):
        raise ValueError("row is neither an object nor null")
    table, part = str(item["table"]), str(item["part"])
    return Entry(pos=int(item["pos"]), table=table, key=str(item["key"]), part=part, row_hash=_hex(item["row_hash"]),
                 chain_hash=_hex(item["chain_hash"]), computed=None if row is None else row_hash(table, part, row))


def _aware(value: datetime) -> datetime:
    if value.tzinfo is None:
        raise ValueError("signed_at has no time zone")
    return value


def _hex(value: object) -> str:
    """A SHA-256 in hex, or ValueError."""
    if not isinstance(value, str) or len(value) != 64:
        raise ValueError(f"{value!r} is not a SHA-256 in hex")
    bytes.fromhex(value)
    return value


def _line(item: dict[str, Any]) -> str:
    return json.dumps(item, sort_keys=True, ensure_ascii=False) + "\n"
