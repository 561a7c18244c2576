"""Bounded waiting for a condition: the only way tests synchronise with another process."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_until"]

T = TypeVar("T")


def wait_until(predicate: Callable[[], T | None], timeout: float, what: str, *, interval: float = 0.05) -> T:
    """Poll `predicate` every `interval` seconds until it returns something truthy, and return that.

    Raises AssertionError naming `what` after `timeout` seconds, so a hang reads as the condition that never held.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what}")
        time.sleep(interval)  # the poll tick, not a synchronisation: the loop re-checks the condition
