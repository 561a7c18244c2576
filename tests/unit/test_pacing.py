"""The pace of reads about one action: at once, then doubling from the first delay to the cap, less a bounded and
repeatable jitter."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from wakeful.server.egress.pacing import JITTER, Pacing

PACING = Pacing(first=timedelta(seconds=5), cap=timedelta(minutes=10))
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_the_first_read_is_due_at_once_and_the_next_after_the_first_delay_less_its_jitter() -> None:
    assert PACING.due_at("act_1", since=T0, reads=0, last=None) == T0
    second = PACING.due_at("act_1", since=T0, reads=1, last=T0)
    assert T0 + timedelta(seconds=5) * (1 - JITTER) <= second <= T0 + timedelta(seconds=5)


@given(action=st.text(min_size=1, max_size=30), reads=st.integers(min_value=1, max_value=10_000))
def test_every_delay_doubles_up_to_the_cap_and_loses_at_most_a_quarter_to_jitter(action: str, reads: int) -> None:
    ceiling = min(PACING.cap, timedelta(seconds=5 * 2 ** min(reads - 1, 20)))
    delay = PACING.delay(action, reads)
    assert ceiling * (1 - JITTER) - timedelta(microseconds=1) <= delay <= ceiling
    assert PACING.delay(action, reads) == delay  # the same action and read: the same delay, on any server


def test_different_actions_spread_out() -> None:
    delays = {PACING.delay(f"act_{i}", 3) for i in range(50)}
    assert len(delays) > 40
