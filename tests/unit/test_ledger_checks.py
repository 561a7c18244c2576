"""The ledger's checks as pure functions: a chain built here, then each kind of damage named at its position."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from wakeful.server.audit.canonical import GENESIS, chain_link, row_hash
from wakeful.server.audit.chain import Entry, ProblemKind, check
from wakeful.server.audit.signing import Checkpoint, LedgerKey, load_or_create_key

NOW = datetime(2026, 12, 2, 18, 0, tzinfo=UTC)


def chain(key: LedgerKey, count: int, *, checkpoint_at: tuple[int, ...]) -> tuple[list[Entry], list[Checkpoint]]:
    entries, checkpoints, running = [], [], GENESIS
    for pos in range(1, count + 1):
        digest = row_hash("control", "row", {"id": f"ctl_{pos}", "reason": "r"})
        running = chain_link(running, digest)
        entries.append(Entry(pos=pos, table="control", key=f"ctl_{pos}", part="row", row_hash=digest,
                             chain_hash=running, computed=digest))
        if pos in checkpoint_at:
            checkpoints.append(key.checkpoint(pos=pos, chain_hash=running, now=NOW))
    return entries, checkpoints


def test_a_whole_chain_holds_and_its_head_is_the_last_entry(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "ledger.key")
    entries, checkpoints = chain(key, 5, checkpoint_at=(2, 5))
    verdict = check(entries, checkpoints, key.public)
    assert verdict.ok and (verdict.entries, verdict.checkpoints, verdict.head_pos) == (5, 2, 5)


def test_entries_after_the_last_signed_checkpoint_are_inserted(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "ledger.key")
    entries, checkpoints = chain(key, 5, checkpoint_at=(3,))
    (problem,) = check(entries, checkpoints, key.public).problems
    assert (problem.kind, problem.pos) == (ProblemKind.INSERTED, 4)


def test_a_second_entry_at_one_position_is_inserted(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "ledger.key")
    entries, checkpoints = chain(key, 3, checkpoint_at=(3,))
    problems = check([entries[0], entries[1], replace(entries[1], key="ctl_x"), entries[2]], checkpoints,
                     key.public).problems
    assert (problems[0].kind, problems[0].pos, problems[0].key) == (ProblemKind.INSERTED, 2, "ctl_x")


def test_a_checkpoint_past_the_end_means_entries_were_taken_off_the_end(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "ledger.key")
    entries, checkpoints = chain(key, 4, checkpoint_at=(2, 4))
    problems = check(entries[:3], checkpoints, key.public).problems
    assert (problems[0].kind, problems[0].pos) == (ProblemKind.DELETED, 4)


def test_a_checkpoint_signed_by_another_key_is_named(tmp_path: Path) -> None:
    key, other = load_or_create_key(tmp_path / "a.key"), load_or_create_key(tmp_path / "b.key")
    entries, checkpoints = chain(key, 3, checkpoint_at=(3,))
    (problem,) = check(entries, checkpoints, other.public).problems
    assert (problem.kind, problem.pos) == (ProblemKind.CHECKPOINT, 3)
    assert "signature is not this key's" in problem.describe()


def test_the_key_file_is_created_once_owner_only_and_kept(tmp_path: Path) -> None:
    first = load_or_create_key(tmp_path / "ledger.key")
    assert (tmp_path / "ledger.key").stat().st_mode & 0o777 == 0o600
    assert load_or_create_key(tmp_path / "ledger.key").public.text() == first.public.text()
    assert first.public.text().startswith("ed25519:") and len(first.public.text()) == 8 + 44
