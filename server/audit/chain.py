"""The checks a ledger must pass, pure: over its entries (from the database or an export) and its checkpoints.

In position order, each entry's row must still hash to the hash sealed for it (else `edited`), its row must still be
there (`deleted`; also a position missing from the sequence), its chain hash must follow from the one before it
(`reordered`), and each checkpoint must carry the key's valid signature over the chain hash recomputed from the rows
(`checkpoint`). Entries past the last signed checkpoint and rows with no entry at all are `inserted`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from wakeful.server.audit.canonical import GENESIS, chain_link
from wakeful.server.audit.signing import Checkpoint, PublicKey
from wakeful.server.store.tables import CHAIN_KEY_SEPARATOR

__all__ = ["Entry", "Problem", "ProblemKind", "Verdict", "check"]

class ProblemKind(StrEnum):
    EDITED = "edited"
    DELETED = "deleted"
    INSERTED = "inserted"
    REORDERED = "reordered"
    CHECKPOINT = "checkpoint"


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One sealed entry, with the hash its row has now (`computed`; None when the row is gone)."""

    pos: int
    table: str
    key: str
    part: str
    row_hash: str
    chain_hash: str
    computed: str | None


@dataclass(frozen=True, kw_only=True)
class Problem:
    kind: ProblemKind
    pos: int | None  # None for a row the chain never had
    table: str | None
    key: str | None
    part: str = "row"
    detail: str

    def describe(self) -> str:
        where = "" if self.pos is None else f"pos {self.pos}: "
        row = "" if self.table is None else f"{self.table} {(self.key or '').replace(CHAIN_KEY_SEPARATOR, '/')}"
        if row and self.part != "row":
            row += f" ({self.part})"
        return f"{where}{row}{': ' if row else ''}{self.kind.value}: {self.detail}"


@dataclass(frozen=True, kw_only=True)
class Verdict:
    entries: int
    checkpoints: int
    head_pos: int
    head_hash: str
    pending: int = 0  # entries not sealed yet (written after the seal this check began with)
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check(entries: Iterable[Entry], checkpoints: Sequence[Checkpoint], key: PublicKey) -> Verdict:
    """Every check of the module docstring, problems in position order (rows outside the chain are the caller's)."""
    signed = {checkpoint.pos: checkpoint for checkpoint in checkpoints}
    problems: list[Problem] = []
    recomputed = previous = GENESIS  # the chain from the rows themselves; the chain hash stored before this entry
    expected, count, last_signed = 1, 0, 0
    last: Entry | None = None
    for entry in entries:
        count += 1
        if entry.pos < expected:
            problems.append(_problem(ProblemKind.INSERTED, entry, "a second entry at this position"))
        elif entry.pos > expected:
            problems.append(Problem(kind=ProblemKind.DELETED, pos=expected, table=None, key=None,
                                    detail=f"entries {expected}..{entry.pos - 1} are missing from the chain"))
        if entry.computed is None:
            problems.append(_problem(ProblemKind.DELETED, entry, "the row is gone"))
        elif entry.computed != entry.row_hash:
            problems.append(_problem(ProblemKind.EDITED, entry, "the row no longer hashes to the hash sealed for it"))
        elif chain_link(previous, entry.row_hash) != entry.chain_hash:
            problems.append(_problem(ProblemKind.REORDERED, entry, "its chain hash does not follow from the entry "
                                                                   "before it: moved, or an entry was taken out"))
        recomputed = chain_link(recomputed, entry.computed or entry.row_hash)
        previous, expected, last = entry.chain_hash, entry.pos + 1, entry
        checkpoint = signed.pop(entry.pos, None)
        if checkpoint is not None:
            if not key.signed(checkpoint):
                problems.append(_problem(ProblemKind.CHECKPOINT, entry, "its checkpoint's signature is not this "
                                                                        "key's: forged, or signed by another key"))
            elif checkpoint.chain_hash != recomputed:
                problems.append(_problem(ProblemKind.CHECKPOINT, entry, "the rows up to here do not hash to the "
                                                                        "chain hash its checkpoint signed"))
            else:
                last_signed = entry.pos
    problems.extend(  # checkpoints past the chain's end: entries were taken off the end
        Problem(kind=ProblemKind.DELETED, pos=pos, table=None, key=None,
                detail="a checkpoint covers this position, but the chain ends before it") for pos in sorted(signed))
    # An unsigned tail is what a forged checkpoint, or one past the end (entries taken off), already explains.
    explained = bool(signed) or any(p.kind is ProblemKind.CHECKPOINT and (p.pos or 0) > last_signed
                                    for p in problems)
    if last is not None and last.pos > last_signed and not explained:
        problems.append(Problem(kind=ProblemKind.INSERTED, pos=last_signed + 1, table=None, key=None,
                                detail=f"entries {last_signed + 1}..{last.pos} come after the last valid signed "
                                       "checkpoint"))
    problems.sort(key=lambda problem: problem.pos if problem.pos is not None else 0)
    return Verdict(entries=count, checkpoints=len(checkpoints), head_pos=0 if last is None else last.pos,
                   head_hash=GENESIS if last is None else last.chain_hash, problems=problems)


def _problem(kind: ProblemKind, entry: Entry, detail: str) -> Problem:
    return Problem(kind=kind, pos=entry.pos, table=entry.table, key=entry.key, part=entry.part, detail=detail)
