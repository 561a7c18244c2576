"""Fallback polling slows down while idle and snaps back when woken."""

from __future__ import annotations

import threading

from wakeful.server.core.worker import IdlePoll


def test_idle_polling_doubles_up_to_the_ceiling_and_a_wakeup_resets_it() -> None:
    poll = IdlePoll(0.001, 0.004)
    never = threading.Event()
    for _ in range(4):
        poll.wait(never)
    assert poll._delay == 0.004  # 0.001 → 0.002 → 0.004, and no further
    woken = threading.Event()
    woken.set()
    poll.wait(woken)
    assert poll._delay == 0.001 and not woken.is_set()


def test_a_cap_shortens_one_wait_without_changing_the_backoff() -> None:
    poll = IdlePoll(0.001, 1.0)
    poll.wait(threading.Event(), at_most=0.0)
    assert poll._delay == 0.002
