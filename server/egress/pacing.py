"""When to read the provider again about one action: an unknown outcome (reconcile) or an unverified effect (verify).

    read 1        at once (when the outcome became unknown, or the effect was accepted)
    read n + 1    delay(n) after read n:  min(cap, first · 2^(n-1)), less up to a quarter of it as jitter

The jitter is drawn from the action's ID and the read's number, not from a random source: the same action is paced
the same way on every server and in every test, while different actions spread out. A read that changed nothing
never makes the next one due sooner, so a provider that keeps answering the same thing is asked at most once per
delay, however often the reconciler wakes. Pure: the caller counts the reads from its evidence rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta

__all__ = ["JITTER", "Pacing"]

JITTER = 0.25
"""The largest share of a delay the jitter takes off it: a delay lies in [(1 - JITTER) · d, d]."""


@dataclass(frozen=True, kw_only=True)
class Pacing:
    first: timedelta
    """The delay between the first read and the second (`reconcile_interval`)."""
    cap: timedelta
    """The longest delay between two reads (`reconcile_backoff_max`)."""

    def delay(self, action_id: str, reads: int) -> timedelta:
        """How long after read number `reads` (1 for the first) the next one is due."""
        if reads < 1:
            return timedelta(0)
        # In float seconds: doubling a timedelta overflows it long before the cap would stop a long unknown.
        ceiling = min(self.cap.total_seconds(), self.first.total_seconds() * 2.0 ** min(reads - 1, 64))
        return timedelta(seconds=ceiling * (1 - JITTER * _unit(f"{action_id}:{reads}")))

    def due_at(self, action_id: str, *, since: datetime, reads: int, last: datetime | None) -> datetime:
        """When the next read is due: at `since` before any read, else `delay` after the `last` one."""
        if reads < 1 or last is None:
            return since
        return last + self.delay(action_id, reads)


def _unit(seed: str) -> float:
    """A number in [0, 1) fixed by `seed`."""
    return int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big") / 2**64
