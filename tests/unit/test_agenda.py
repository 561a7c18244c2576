"""A task's agenda in plain words, and how often a check is expected to wake its task (the wake budget's measure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest

from wakeful.server.core.agenda import said_of_timer, said_of_wait, wakes_per_day
from wakeful.server.core.schedule import Recurrence

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
HONG_KONG = ZoneInfo("Asia/Hong_Kong")


@pytest.mark.parametrize(("recurrence", "expected"), [
    (Recurrence(interval=timedelta(hours=1)), 24.0),
    (Recurrence(interval=timedelta(days=2)), 0.5),
    (Recurrence(cron="0 9,18 * * *", tz="Asia/Hong_Kong"), 2.0),
    (Recurrence(cron="0 9 * * 1"), 1 / 7),
    (Recurrence(cron="*/30 9-10 * * *", tz="America/New_York"), 4.0),
], ids=["hourly", "every other day", "twice a day", "weekly", "four in a morning"])
def test_a_checks_expected_wakes_per_day(recurrence: Recurrence, expected: float) -> None:
    assert wakes_per_day(recurrence, now=NOW) == pytest.approx(expected)


def _check(**row: object) -> SimpleNamespace:
    return SimpleNamespace(**{"kind": "schedule", "note": "prices", "interval_seconds": None, "cron": None,
                              "tz": None, "due_at": datetime(2026, 12, 3, 1, 0, tzinfo=UTC), **row})


@pytest.mark.parametrize(("row", "said"), [
    (_check(cron="0 9 * * *", tz="Asia/Hong_Kong"),
     "checks prices every day at 09:00 Asia/Hong_Kong; next 2026-12-03 09:00"),
    (_check(cron="30 7 * * 1", tz="Asia/Hong_Kong"),
     "checks prices every Monday at 07:30 Asia/Hong_Kong; next 2026-12-03 09:00"),
    (_check(cron="0 */6 * * *"),  # the schedule's zone is not the user's: the next time names the user's
     "checks prices on the schedule '0 */6 * * *' (UTC); next 2026-12-03 09:00 Asia/Hong_Kong"),
    (_check(interval_seconds=7200), "checks prices every 2 hours; next 2026-12-03 09:00 Asia/Hong_Kong"),
    (_check(interval_seconds=90), "checks prices every 90 seconds; next 2026-12-03 09:00 Asia/Hong_Kong"),
    (_check(kind="followup", note="the refund"), "follows up on the refund at 2026-12-03 09:00 Asia/Hong_Kong"),
], ids=["daily", "weekly", "other cron", "interval", "odd interval", "follow-up"])
def test_a_timer_is_said_in_the_users_time_zone(row: SimpleNamespace, said: str) -> None:
    assert said_of_timer(row, HONG_KONG) == said


def test_only_the_agents_reply_waits_are_said_and_the_servers_own_are_not() -> None:
    deadline = datetime(2026, 12, 4, 1, 0, tzinfo=UTC)
    reply = SimpleNamespace(on_timeout="tell_user", note=None, match_key="thread-9", deadline=deadline)
    approval = SimpleNamespace(on_timeout=None, note=None, match_key="approval:act_1", deadline=deadline)
    said = "waits for a reply carrying thread-9 until 2026-12-04 09:00 Asia/Hong_Kong; then tells you"
    assert said_of_wait(reply, HONG_KONG) == said
    assert said_of_wait(approval, HONG_KONG) is None
