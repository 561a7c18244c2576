"""The speaking gate as a pure function: quiet hours in the user's zone (across midnight or not), the budget, and
urgency that breaks through only with a deadline still ahead and before the hold ends."""

from __future__ import annotations

from datetime import UTC, datetime, time
from zoneinfo import ZoneInfo

import pytest

from wakeful.server.core.speaking import Preferences, QuietHours, Urgency, decide, next_summary
from wakeful.server.errors import BadRequest

HK = ZoneInfo("Asia/Hong_Kong")
NIGHT = QuietHours(start=time(23, 0), end=time(7, 30))


def at(day: int, hour: int, minute: int = 0, zone: ZoneInfo = HK) -> datetime:
    return datetime(2026, 12, day, hour, minute, tzinfo=zone).astimezone(UTC)


@pytest.mark.parametrize(("hour", "minute", "held_until"), [
    (23, 0, at(4, 7, 30)), (2, 12, at(3, 7, 30)), (7, 29, at(3, 7, 30)), (7, 30, None), (22, 59, None), (12, 0, None)])
def test_quiet_hours_across_midnight_hold_until_they_end(hour: int, minute: int, held_until: datetime | None) -> None:
    gate = decide(Preferences(zone=HK, quiet=NIGHT), now=at(3, hour, minute), urgency=None, sent_today=0)
    assert gate.hold_until == held_until


def test_quiet_hours_within_one_day_and_no_preferences_at_all() -> None:
    nap = Preferences(zone=HK, quiet=QuietHours(start=time(13, 0), end=time(14, 0)))
    assert decide(nap, now=at(3, 13, 30), urgency=None, sent_today=0).hold_until == at(3, 14, 0)
    assert decide(nap, now=at(3, 14, 0), urgency=None, sent_today=0).hold_until is None
    assert decide(Preferences(zone=HK), now=at(3, 2, 0), urgency=None, sent_today=10**6).hold_until is None


def test_urgency_counts_only_with_a_deadline_ahead_and_before_the_hold_ends() -> None:
    prefs = Preferences(zone=HK, quiet=NIGHT)
    now = at(3, 2, 12)

    def held(deadline: datetime) -> bool:
        gate = decide(prefs, now=now, urgency=Urgency(reason="hold expires", deadline=deadline), sent_today=0)
        assert gate.why is not None and "hold expires" in gate.why
        return gate.hold_until is not None

    assert not held(at(3, 6, 0))
    assert held(at(3, 7, 30)) and held(at(3, 9, 0))  # it can wait for the summary
    assert held(now) and held(at(3, 1, 0))  # a deadline already past: waking the user helps no one


def test_past_the_budget_messages_wait_for_the_end_of_the_next_quiet_hours_or_local_midnight() -> None:
    with_night = Preferences(zone=HK, quiet=NIGHT, budget=3)
    assert decide(with_night, now=at(3, 12), urgency=None, sent_today=2).hold_until is None
    gate = decide(with_night, now=at(3, 12), urgency=None, sent_today=3)
    assert gate.hold_until == at(4, 7, 30) and gate.why is not None and "budget of 3" in gate.why
    assert next_summary(Preferences(zone=HK, budget=3), at(3, 12)) == at(4, 0, 0)


def test_quiet_hours_are_two_different_local_times() -> None:
    assert QuietHours.parse("23:00", "07:30") == NIGHT
    for start, end in (("23:00", "23:00"), ("24:00", "07:00"), ("7:00", "08:00"), ("23:00", ""), ("23:00:00", "1")):
        with pytest.raises(BadRequest) as refused:
            QuietHours.parse(start, end)
        assert refused.value.code == "invalid_quiet_hours"
