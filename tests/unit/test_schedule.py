from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

import pytest
from croniter import croniter  # type: ignore[import-untyped,unused-ignore]
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.server.core.schedule import (
    CRON_SCAN_CAP,
    Decision,
    Misfire,
    Recurrence,
    ScheduleError,
    decide,
    min_gap,
)

T0 = datetime(2024, 3, 4, 9, 0, tzinfo=UTC)  # a Monday, 09:00 UTC
HOUR = timedelta(hours=1)
DAY = timedelta(days=1)
HOURLY = Recurrence(interval=HOUR)
DAILY_9 = Recurrence(cron="0 9 * * *")


def _decide(
    *,
    due_at: datetime,
    now: datetime,
    recurrence: Recurrence | None,
    anchor: datetime = T0,
    misfire: Misfire = Misfire.SKIP,
    grace: timedelta = timedelta(0),
) -> Decision | None:
    return decide(due_at=due_at, now=now, recurrence=recurrence, anchor=anchor, misfire=misfire, grace=grace)


# --- follow-ups -------------------------------------------------------------------------------------------------


def test_a_follow_up_is_not_due_before_its_time() -> None:
    assert _decide(due_at=T0, now=T0 - timedelta(microseconds=1), recurrence=None) is None


def test_a_follow_up_fires_once_at_its_due_time_and_is_then_done() -> None:
    assert _decide(due_at=T0, now=T0, recurrence=None) == Decision(fire_slot=T0, next_due=None, missed=0)


@pytest.mark.parametrize("misfire", list(Misfire))
def test_a_follow_up_still_fires_once_when_very_late(misfire: Misfire) -> None:
    decision = _decide(due_at=T0, now=T0 + timedelta(days=400), recurrence=None, misfire=misfire)
    assert decision == Decision(fire_slot=T0, next_due=None, missed=0)


# --- on-time schedules ------------------------------------------------------------------------------------------


def test_an_interval_schedule_is_not_due_before_its_slot() -> None:
    assert _decide(due_at=T0 + HOUR, now=T0 + HOUR - timedelta(seconds=1), recurrence=HOURLY) is None


def test_an_interval_schedule_fires_on_time_and_moves_to_the_next_slot() -> None:
    decision = _decide(due_at=T0 + HOUR, now=T0 + HOUR, recurrence=HOURLY)
    assert decision == Decision(fire_slot=T0 + HOUR, next_due=T0 + 2 * HOUR, missed=0)


@pytest.mark.parametrize("misfire", list(Misfire))
def test_an_interval_slot_picked_up_late_but_before_the_next_slot_still_fires(misfire: Misfire) -> None:
    decision = _decide(due_at=T0 + HOUR, now=T0 + HOUR + timedelta(minutes=59), recurrence=HOURLY, misfire=misfire)
    assert decision == Decision(fire_slot=T0 + HOUR, next_due=T0 + 2 * HOUR, missed=0)


def test_a_daily_cron_fires_on_time_at_0900_utc() -> None:
    decision = _decide(due_at=T0, now=T0 + timedelta(seconds=2), recurrence=DAILY_9)
    assert decision == Decision(fire_slot=T0, next_due=T0 + DAY, missed=0)


def test_a_cron_is_evaluated_in_utc_even_when_inputs_carry_another_offset() -> None:
    ist = timezone(timedelta(hours=5, minutes=30))
    now = T0.astimezone(ist)  # 14:30 local, 09:00 UTC
    decision = _decide(due_at=now, now=now, recurrence=DAILY_9, anchor=now)
    assert decision is not None
    assert decision.fire_slot == T0
    assert decision.next_due == T0 + DAY
    assert decision.next_due.utcoffset() == timedelta(0)


def test_interval_slots_are_spaced_in_real_time_across_a_dst_change() -> None:
    zoneinfo = pytest.importorskip("zoneinfo")
    try:
        new_york = zoneinfo.ZoneInfo("America/New_York")
    except zoneinfo.ZoneInfoNotFoundError:
        pytest.skip("no tz database")
    anchor = datetime(2024, 3, 10, 0, 0, tzinfo=new_york)  # DST starts 02:00 local that night
    now = datetime(2024, 3, 10, 12, 0, tzinfo=new_york)
    recurrence = Recurrence(interval=HOUR)
    assert recurrence.next_after(now, anchor=anchor) - now.astimezone(UTC) == HOUR
    decision = _decide(due_at=anchor, now=anchor, recurrence=recurrence, anchor=anchor)
    assert decision is not None and decision.next_due == anchor.astimezone(UTC) + HOUR


def test_a_due_time_off_the_interval_grid_fires_and_rejoins_the_grid() -> None:
    due = T0 + timedelta(minutes=20)
    decision = _decide(due_at=due, now=due, recurrence=HOURLY)
    assert decision == Decision(fire_slot=due, next_due=T0 + HOUR, missed=0)


# --- downtime ---------------------------------------------------------------------------------------------------

THREE_DAYS_LATER = T0 + timedelta(days=3, hours=2, minutes=30)  # 2024-03-07 11:30 UTC


def test_a_daily_cron_down_for_three_days_under_skip_fires_nothing_and_jumps_to_the_next_future_slot() -> None:
    decision = _decide(due_at=T0, now=THREE_DAYS_LATER, recurrence=DAILY_9, misfire=Misfire.SKIP)
    # missed: 03-04, 03-05, 03-06, 03-07 09:00; next: 03-08 09:00
    assert decision == Decision(fire_slot=None, next_due=T0 + 4 * DAY, missed=4)


def test_a_daily_cron_down_for_three_days_under_catch_up_once_fires_only_the_most_recent_missed_slot() -> None:
    decision = _decide(due_at=T0, now=THREE_DAYS_LATER, recurrence=DAILY_9, misfire=Misfire.CATCH_UP_ONCE)
    assert decision == Decision(fire_slot=T0 + 3 * DAY, next_due=T0 + 4 * DAY, missed=3)
    assert decision.next_due is not None
    # Applying next_due: nothing more until the next future slot, which then fires normally.
    assert _decide(due_at=decision.next_due, now=THREE_DAYS_LATER, recurrence=DAILY_9) is None
    again = _decide(due_at=decision.next_due, now=T0 + 4 * DAY, recurrence=DAILY_9, misfire=Misfire.CATCH_UP_ONCE)
    assert again == Decision(fire_slot=T0 + 4 * DAY, next_due=T0 + 5 * DAY, missed=0)


def test_an_hourly_interval_down_for_three_days_under_skip_fires_nothing_and_jumps_to_the_next_future_slot() -> None:
    decision = _decide(due_at=T0 + HOUR, now=THREE_DAYS_LATER, recurrence=HOURLY, misfire=Misfire.SKIP)
    # slots T0+1h .. T0+74h (= 11:00 on day 3) are all missed; next is 12:00
    assert decision == Decision(fire_slot=None, next_due=T0 + 75 * HOUR, missed=74)


def test_an_hourly_interval_down_for_three_days_under_catch_up_once_fires_the_most_recent_slot_once() -> None:
    decision = _decide(due_at=T0 + HOUR, now=THREE_DAYS_LATER, recurrence=HOURLY, misfire=Misfire.CATCH_UP_ONCE)
    assert decision == Decision(fire_slot=T0 + 74 * HOUR, next_due=T0 + 75 * HOUR, missed=73)
    assert decision.next_due is not None
    assert _decide(due_at=decision.next_due, now=THREE_DAYS_LATER, recurrence=HOURLY) is None


def test_a_slot_falling_exactly_on_now_counts_as_passed() -> None:
    decision = _decide(due_at=T0 + HOUR, now=T0 + 3 * HOUR, recurrence=HOURLY, misfire=Misfire.CATCH_UP_ONCE)
    assert decision == Decision(fire_slot=T0 + 3 * HOUR, next_due=T0 + 4 * HOUR, missed=2)


def test_under_skip_a_slot_that_became_due_within_grace_still_fires() -> None:
    now = T0 + 5 * HOUR + timedelta(seconds=30)
    decision = _decide(due_at=T0 + HOUR, now=now, recurrence=HOURLY, grace=timedelta(minutes=1))
    assert decision == Decision(fire_slot=T0 + 5 * HOUR, next_due=T0 + 6 * HOUR, missed=4)


def test_under_skip_a_slot_older_than_grace_does_not_fire() -> None:
    now = T0 + 5 * HOUR + timedelta(seconds=61)
    decision = _decide(due_at=T0 + HOUR, now=now, recurrence=HOURLY, grace=timedelta(minutes=1))
    assert decision == Decision(fire_slot=None, next_due=T0 + 6 * HOUR, missed=5)


def test_a_one_microsecond_interval_down_for_a_century_is_counted_arithmetically() -> None:
    recurrence = Recurrence(interval=timedelta(microseconds=1))
    now = T0 + timedelta(days=36_525)
    decision = _decide(due_at=T0, now=now, recurrence=recurrence, misfire=Misfire.CATCH_UP_ONCE)
    slots = (now - T0) // timedelta(microseconds=1) + 1
    assert decision == Decision(fire_slot=now, next_due=now + timedelta(microseconds=1), missed=slots - 1)


def test_a_one_minute_interval_down_for_three_days_counts_every_missed_minute() -> None:
    recurrence = Recurrence(interval=timedelta(minutes=1))
    now = T0 + timedelta(days=3, seconds=30)
    decision = _decide(due_at=T0, now=now, recurrence=recurrence)
    assert decision == Decision(fire_slot=None, next_due=T0 + timedelta(days=3, minutes=1), missed=3 * 24 * 60 + 1)


@pytest.mark.parametrize("late_by", [timedelta(0), timedelta(seconds=59)], ids=["now on a slot", "now between slots"])
def test_an_every_minute_cron_down_for_a_year_caps_the_count_but_keeps_the_slots_exact(late_by: timedelta) -> None:
    recurrence = Recurrence(cron="* * * * *")
    now = T0 + timedelta(days=365) + late_by
    decision = _decide(due_at=T0, now=now, recurrence=recurrence, misfire=Misfire.CATCH_UP_ONCE)
    assert decision is not None
    assert decision.fire_slot == T0 + timedelta(days=365)
    assert decision.next_due == T0 + timedelta(days=365, minutes=1)
    assert decision.missed >= CRON_SCAN_CAP


# --- validation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"cron": "not a cron"}, id="garbage cron"),
        pytest.param({"cron": "61 * * * *"}, id="minute out of range"),
        pytest.param({"cron": "* * * * * *"}, id="six fields"),
        pytest.param({"cron": "@daily"}, id="macro is not five fields"),
        pytest.param({"cron": ""}, id="empty cron"),
        pytest.param({"cron": "0 0 30 2 *"}, id="cron that never fires"),
        pytest.param({"interval": timedelta(0)}, id="zero interval"),
        pytest.param({"interval": timedelta(seconds=-5)}, id="negative interval"),
        pytest.param({"interval": HOUR, "cron": "* * * * *"}, id="both set"),
        pytest.param({}, id="neither set"),
    ],
)
def test_an_invalid_recurrence_is_rejected_as_invalid_schedule(kwargs: dict[str, object]) -> None:
    with pytest.raises(ScheduleError) as info:
        Recurrence(**kwargs)  # type: ignore[arg-type]
    assert info.value.code == "invalid_schedule"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("field", ["due_at", "now", "anchor"])
@pytest.mark.parametrize("recurrence", [None, HOURLY, DAILY_9], ids=["follow-up", "interval", "cron"])
def test_a_naive_datetime_is_rejected(field: str, recurrence: Recurrence | None) -> None:
    times = {"due_at": T0, "now": T0, "anchor": T0, field: T0.replace(tzinfo=None)}
    with pytest.raises(ScheduleError) as info:
        decide(
            due_at=times["due_at"],
            now=times["now"],
            anchor=times["anchor"],
            recurrence=recurrence,
            misfire=Misfire.SKIP,
        )
    assert info.value.code == "naive_datetime"


def test_a_naive_datetime_is_rejected_by_next_after_and_min_gap() -> None:
    naive = T0.replace(tzinfo=None)
    for call in (
        lambda: HOURLY.next_after(naive, anchor=T0),
        lambda: DAILY_9.next_after(T0, anchor=naive),
        lambda: min_gap(DAILY_9, anchor=naive),
    ):
        with pytest.raises(ScheduleError) as info:
            call()
        assert info.value.code == "naive_datetime"


def test_a_negative_grace_and_an_unknown_misfire_policy_are_rejected() -> None:
    with pytest.raises(ScheduleError) as info:
        _decide(due_at=T0, now=T0, recurrence=HOURLY, grace=timedelta(seconds=-1))
    assert info.value.code == "invalid_grace"
    with pytest.raises(ScheduleError) as info:
        _decide(due_at=T0, now=T0, recurrence=HOURLY, misfire="fire_all")  # type: ignore[arg-type]
    assert info.value.code == "invalid_misfire"


def test_a_misfire_policy_given_as_its_string_value_is_accepted() -> None:
    decision = _decide(due_at=T0, now=T0 + 3 * HOUR, recurrence=HOURLY, misfire="catch_up_once")  # type: ignore[arg-type]
    assert decision is not None and decision.fire_slot == T0 + 3 * HOUR


def test_decisions_and_recurrences_are_frozen() -> None:
    decision = Decision(fire_slot=None, next_due=None, missed=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.missed = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        HOURLY.interval = DAY  # type: ignore[misc]


# --- next_after / min_gap ---------------------------------------------------------------------------------------


def test_next_after_is_strictly_after_and_starts_at_the_anchor() -> None:
    assert HOURLY.next_after(T0 - DAY, anchor=T0) == T0
    assert HOURLY.next_after(T0, anchor=T0) == T0 + HOUR
    assert HOURLY.next_after(T0 + timedelta(minutes=59), anchor=T0) == T0 + HOUR
    assert DAILY_9.next_after(T0, anchor=T0) == T0 + DAY
    assert DAILY_9.next_after(T0 - timedelta(microseconds=1), anchor=T0) == T0


def test_latest_at_or_before_includes_a_slot_exactly_at_t() -> None:
    assert DAILY_9.latest_at_or_before(T0, anchor=T0) == T0
    assert DAILY_9.latest_at_or_before(T0 - timedelta(microseconds=1), anchor=T0) == T0 - DAY
    assert HOURLY.latest_at_or_before(T0 + HOUR, anchor=T0) == T0 + HOUR
    assert HOURLY.latest_at_or_before(T0 - timedelta(microseconds=1), anchor=T0) is None


def test_min_gap_of_every_five_minutes_is_five_minutes() -> None:
    assert min_gap(Recurrence(cron="*/5 * * * *"), anchor=T0) == timedelta(minutes=5)


def test_min_gap_finds_the_shortest_gap_even_when_it_wraps_an_hour() -> None:
    # */7 fires at :00, :07, ..., :56, then :00 again -- a 4 minute gap.
    assert min_gap(Recurrence(cron="*/7 * * * *"), anchor=T0) == timedelta(minutes=4)
    assert min_gap(Recurrence(cron="0,10 9 * * *"), anchor=T0) == timedelta(minutes=10)


def test_min_gap_of_an_interval_is_the_interval() -> None:
    assert min_gap(Recurrence(interval=timedelta(seconds=90)), anchor=T0) == timedelta(seconds=90)


# --- properties -------------------------------------------------------------------------------------------------


def _interval_slots(anchor: datetime, interval: timedelta, start: datetime, end: datetime) -> list[datetime]:
    """Brute force: the grid slots s with start <= s <= end."""
    slots = []
    slot = anchor
    while slot <= end:
        if slot >= start:
            slots.append(slot)
        slot += interval
    return slots


def _cron_slots(expr: str, start: datetime, end: datetime) -> list[datetime]:
    """Brute force: cron slots s with start <= s <= end."""
    it = croniter(expr, start - timedelta(microseconds=1))
    slots = []
    while (slot := it.get_next(datetime)) <= end:
        slots.append(slot)
    return slots


def _simulate(
    *,
    recurrence: Recurrence,
    anchor: datetime,
    first_due: datetime,
    nows: list[datetime],
    misfire: Misfire,
    grace: timedelta,
    slots_between: Callable[[datetime, datetime], list[datetime]],
) -> None:
    """Drive decide() like a scheduler does, applying next_due after each decision, and check invariants."""
    due = first_due
    fired: list[datetime] = []
    total_missed = 0
    for now in nows:
        decision = decide(due_at=due, now=now, recurrence=recurrence, anchor=anchor, misfire=misfire, grace=grace)
        if now < due:
            assert decision is None
            continue
        assert decision is not None
        passed = slots_between(due, now)  # every slot in [due, now]: the oracle
        assert passed and passed[0] == due
        assert decision.next_due is not None and decision.next_due > now
        assert decision.next_due == slots_between(now + timedelta(microseconds=1), decision.next_due)[0]
        if decision.fire_slot is not None:
            slot = decision.fire_slot
            assert slot == passed[-1], "only the most recent passed slot ever fires"
            assert slot <= now
            assert not fired or slot > fired[-1], "fired slots strictly increase: no slot fires twice"
            if misfire is Misfire.SKIP and len(passed) > 1:
                assert now - slot <= grace, "under skip a late slot fires only within grace"
            fired.append(slot)
        else:
            assert misfire is Misfire.SKIP and len(passed) > 1 and now - passed[-1] > grace
        if misfire is Misfire.CATCH_UP_ONCE or len(passed) == 1:
            assert decision.fire_slot is not None
        assert decision.missed == len(passed) - (decision.fire_slot is not None)
        total_missed += decision.missed
        due = decision.next_due
    # Conservation: every slot that has come and gone was either fired once or counted as missed once.
    accounted = slots_between(first_due, due - timedelta(microseconds=1))
    assert len(fired) + total_missed == len(accounted)
    assert set(fired) <= set(accounted)


def _nows(start: datetime, steps: list[timedelta]) -> list[datetime]:
    out = []
    now = start
    for step in steps:
        now += step
        out.append(now)
    return out


@st.composite
def _interval_case(draw: st.DrawFn) -> tuple[timedelta, datetime, list[datetime], timedelta]:
    interval = timedelta(seconds=draw(st.integers(min_value=1, max_value=6 * 3600)))
    anchor = T0 + timedelta(seconds=draw(st.integers(min_value=-(10**8), max_value=10**8)))
    # Steps are either exact multiples of the interval (landing on slot boundaries) or arbitrary, up to ~6 slots.
    step = st.one_of(
        st.integers(min_value=0, max_value=6).map(lambda k: k * interval),
        st.integers(min_value=0, max_value=int(6 * interval.total_seconds() * 10**6)).map(
            lambda us: timedelta(microseconds=us)
        ),
    )
    steps = draw(st.lists(step, min_size=1, max_size=25))
    start_offset = timedelta(microseconds=draw(st.integers(min_value=-(10**7), max_value=10**7)))
    grace = draw(st.one_of(st.just(timedelta(0)), st.timedeltas(min_value=timedelta(0), max_value=2 * interval)))
    return interval, anchor, _nows(anchor + start_offset, steps), grace


@settings(max_examples=300, deadline=None)
@given(case=_interval_case(), misfire=st.sampled_from(list(Misfire)))
def test_an_interval_schedule_driven_by_increasing_nows_never_fires_a_slot_twice_and_accounts_for_every_slot(
    case: tuple[timedelta, datetime, list[datetime], timedelta], misfire: Misfire
) -> None:
    interval, anchor, nows, grace = case
    _simulate(
        recurrence=Recurrence(interval=interval),
        anchor=anchor,
        first_due=anchor,
        nows=nows,
        misfire=misfire,
        grace=grace,
        slots_between=lambda a, b: _interval_slots(anchor, interval, a, b),
    )


CRONS = ["*/5 * * * *", "0 9 * * *", "0 */6 * * *", "30 2 * * 1-5", "0,7,8 * * * *", "15 10 1 * *"]


@settings(max_examples=150, deadline=None)
@given(
    expr=st.sampled_from(CRONS),
    start=st.datetimes(min_value=datetime(2020, 1, 1), max_value=datetime(2030, 1, 1), timezones=st.just(UTC)),
    steps=st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=5).map(lambda m: timedelta(minutes=5 * m)),
            st.timedeltas(min_value=timedelta(0), max_value=timedelta(days=3)),
        ),
        min_size=1,
        max_size=12,
    ),
    grace=st.one_of(st.just(timedelta(0)), st.timedeltas(min_value=timedelta(0), max_value=timedelta(hours=2))),
    misfire=st.sampled_from(list(Misfire)),
)
def test_a_cron_schedule_driven_by_increasing_nows_never_fires_a_slot_twice_and_accounts_for_every_slot(
    expr: str, start: datetime, steps: list[timedelta], grace: timedelta, misfire: Misfire
) -> None:
    recurrence = Recurrence(cron=expr)
    first_due = recurrence.next_after(start, anchor=start)
    _simulate(
        recurrence=recurrence,
        anchor=start,
        first_due=first_due,
        nows=_nows(start, steps),
        misfire=misfire,
        grace=grace,
        slots_between=lambda a, b: _cron_slots(expr, a, b),
    )


@settings(max_examples=200, deadline=None)
@given(
    interval_s=st.integers(min_value=1, max_value=10**6),
    anchor_s=st.integers(min_value=-(10**9), max_value=10**9),
    t_us=st.integers(min_value=-(10**15), max_value=10**15),
)
def test_next_after_an_interval_is_the_first_grid_slot_strictly_after_t(
    interval_s: int, anchor_s: int, t_us: int
) -> None:
    interval = timedelta(seconds=interval_s)
    anchor = T0 + timedelta(seconds=anchor_s)
    t = T0 + timedelta(microseconds=t_us)
    nxt = Recurrence(interval=interval).next_after(t, anchor=anchor)
    assert nxt > t
    assert nxt >= anchor
    assert (nxt - anchor) % interval == timedelta(0)
    assert nxt == anchor or nxt - interval <= t


def test_a_schedule_error_is_both_a_value_error_and_a_bad_request() -> None:
    from wakeful.server.errors import BadRequest

    error = ScheduleError("invalid_schedule", "interval must be positive")
    assert isinstance(error, ValueError) and isinstance(error, BadRequest)
    assert error.code == "invalid_schedule" and error.http_status == 400
    assert error.to_json() == {"error": {"code": "invalid_schedule", "message": "interval must be positive"}}


# --- cron in the user's time zone ---------------------------------------------------------------------------------

NEW_YORK = "America/New_York"  # DST: 2027-03-14 02:00 → 03:00, 2027-11-07 02:00 → 01:00


def _slots(recurrence: Recurrence, start: datetime, count: int) -> list[datetime]:
    found, t = [], start
    for _ in range(count):
        t = recurrence.next_after(t, anchor=start)
        found.append(t)
    return found


def test_a_daily_0900_check_in_hong_kong_fires_at_0100_utc() -> None:
    recurrence = Recurrence(cron="0 9 * * *", tz="Asia/Hong_Kong")
    assert recurrence.next_after(datetime(2026, 12, 2, 12, 0, tzinfo=UTC), anchor=T0) == \
        datetime(2026, 12, 3, 1, 0, tzinfo=UTC)


def test_a_daily_0900_check_stays_at_0900_local_across_both_dst_changes() -> None:
    spring = _slots(Recurrence(cron="0 9 * * *", tz=NEW_YORK), datetime(2027, 3, 13, 0, 0, tzinfo=UTC), 2)
    assert spring == [datetime(2027, 3, 13, 14, 0, tzinfo=UTC), datetime(2027, 3, 14, 13, 0, tzinfo=UTC)]
    autumn = _slots(Recurrence(cron="0 9 * * *", tz=NEW_YORK), datetime(2027, 11, 6, 0, 0, tzinfo=UTC), 2)
    assert autumn == [datetime(2027, 11, 6, 13, 0, tzinfo=UTC), datetime(2027, 11, 7, 14, 0, tzinfo=UTC)]


def test_a_slot_in_the_skipped_hour_fires_once_when_the_clock_jumps() -> None:
    slots = _slots(Recurrence(cron="30 2 * * *", tz=NEW_YORK), datetime(2027, 3, 13, 12, 0, tzinfo=UTC), 2)
    # 02:30 does not exist on 14 March: it fires at 03:00 EDT (07:00 UTC), the moment the clock jumps past it.
    assert slots == [datetime(2027, 3, 14, 7, 0, tzinfo=UTC), datetime(2027, 3, 15, 6, 30, tzinfo=UTC)]


def test_a_slot_in_the_repeated_hour_fires_once_at_its_first_occurrence() -> None:
    slots = _slots(Recurrence(cron="30 1 * * *", tz=NEW_YORK), datetime(2027, 11, 6, 12, 0, tzinfo=UTC), 2)
    assert slots == [datetime(2027, 11, 7, 5, 30, tzinfo=UTC), datetime(2027, 11, 8, 6, 30, tzinfo=UTC)]


def test_slots_stay_strictly_increasing_through_the_repeated_hour() -> None:
    recurrence = Recurrence(cron="*/30 * * * *", tz=NEW_YORK)
    start = datetime(2027, 11, 7, 4, 50, tzinfo=UTC)  # 00:50 EDT
    slots = _slots(recurrence, start, 4)
    assert slots == [datetime(2027, 11, 7, 5, 0, tzinfo=UTC), datetime(2027, 11, 7, 5, 30, tzinfo=UTC),
                     datetime(2027, 11, 7, 7, 0, tzinfo=UTC), datetime(2027, 11, 7, 7, 30, tzinfo=UTC)]
    inside = datetime(2027, 11, 7, 6, 10, tzinfo=UTC)  # 01:10 EST, the hour's second pass
    assert recurrence.latest_at_or_before(inside, anchor=start) == datetime(2027, 11, 7, 5, 30, tzinfo=UTC)
    assert recurrence.next_after(inside, anchor=start) == datetime(2027, 11, 7, 7, 0, tzinfo=UTC)


def test_a_missed_week_of_a_local_daily_check_counts_seven_slots() -> None:
    recurrence = Recurrence(cron="0 9 * * *", tz=NEW_YORK)
    due = datetime(2027, 3, 10, 14, 0, tzinfo=UTC)
    decision = _decide(due_at=due, now=due + 7 * DAY, recurrence=recurrence, misfire=Misfire.CATCH_UP_ONCE)
    assert decision == Decision(fire_slot=datetime(2027, 3, 17, 13, 0, tzinfo=UTC),
                                next_due=datetime(2027, 3, 18, 13, 0, tzinfo=UTC), missed=7)


def test_min_gap_of_a_local_cron_sees_the_short_day() -> None:
    recurrence = Recurrence(cron="0 9 * * *", tz=NEW_YORK)
    assert min_gap(recurrence, anchor=datetime(2027, 3, 12, tzinfo=UTC)) == timedelta(hours=23)


def test_an_unknown_zone_is_rejected() -> None:
    with pytest.raises(ScheduleError) as info:
        Recurrence(cron="0 9 * * *", tz="Mars/Olympus")
    assert info.value.code == "unknown_timezone"
    with pytest.raises(ScheduleError):
        Recurrence(interval=HOUR, tz="Asia/Hong_Kong")  # an interval is elapsed time: no zone to read it in
