"""Pure timer due-ness for the always-on agent's scheduler.

No I/O and no clock reads: the caller always passes ``now``. Every datetime must be timezone-aware; results are
returned in UTC. Durations are :class:`datetime.timedelta`.

A timer is either a one-shot *follow-up* (``recurrence is None``: due once at ``due_at``) or a *schedule* (a
:class:`Recurrence`: every ``interval``, or a 5-field ``cron`` expression read on the wall clock of ``tz``, an IANA
zone, UTC when unset).

A cron read in a zone with daylight saving time keeps its wall-clock hour ("0 9 * * *" is 09:00 local in winter and
in summer). A slot the clock skips (02:30 on the spring-forward night) fires once, at the moment the clock jumps past
it; a slot the clock repeats (01:30 on the fall-back night) fires once, at its first occurrence.

Slots of an interval schedule are ``anchor + k * interval`` for ``k >= 0``; slots of a cron schedule are the
croniter matches (the anchor is not used for cron slots). ``due_at`` -- the timer's stored due time -- always counts
as a slot of its own, even if it is not on the grid (e.g. an explicit first due time).

Misfire policy, when the scheduler was down and more than one slot passed:

* :attr:`Misfire.SKIP` (default): the missed slots do not fire; the timer jumps to the next future slot. (A slot that
  became due no more than ``grace`` ago still counts as on time and fires.)
* :attr:`Misfire.CATCH_UP_ONCE`: fire exactly once, for the most recent missed slot, then continue with the next
  future slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from enum import StrEnum
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter  # type: ignore[import-untyped,unused-ignore]

from wakeful.server.errors import BadRequest

__all__ = [
    "CRON_SCAN_CAP",
    "MIN_GAP_FIRINGS",
    "Decision",
    "Misfire",
    "Recurrence",
    "ScheduleError",
    "decide",
    "min_gap",
]

#: Upper bound on cron slots enumerated when counting missed slots after a long downtime. Past the cap, ``missed``
#: is a lower bound (the fired slot and ``next_due`` stay exact). One croniter step costs ~40us, so the cap bounds a
#: single :func:`decide` call to well under a second.
CRON_SCAN_CAP = 10_000

#: How many upcoming cron firings :func:`min_gap` inspects.
MIN_GAP_FIRINGS = 50

_ZERO = timedelta(0)


class ScheduleError(BadRequest, ValueError):
    """A schedule or an input to the scheduling functions is invalid. ``code`` is machine-readable.

    A :class:`ValueError` for pure callers and a :class:`~server.errors.BadRequest` (HTTP 400) for the API layer.
    """

    code: str

    def __init__(self, code: str, message: str | None = None) -> None:
        super().__init__(code, message if message is not None else code)


class Misfire(StrEnum):
    SKIP = "skip"
    CATCH_UP_ONCE = "catch_up_once"


def _utc(value: datetime, name: str) -> datetime:
    if value.tzinfo is None or value.tzinfo.utcoffset(value) is None:
        raise ScheduleError("naive_datetime", f"{name} must be timezone-aware, got {value!r}")
    return value.astimezone(UTC)


def _as_datetime(value: object) -> datetime:
    """What croniter returned: a wall-clock time, as naive as the start it was given."""
    if not isinstance(value, datetime):  # pragma: no cover - croniter always returns datetimes when asked to
        raise TypeError(f"croniter returned {type(value).__name__}, expected datetime")
    return value


def _zone(name: str | None) -> tzinfo:
    if name is None:
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError) as exc:
        raise ScheduleError("unknown_timezone", f"{name!r} is not an IANA time zone") from exc


def _wall(t: datetime, zone: tzinfo) -> datetime:
    """`t` on the zone's wall clock, without its zone (what a cron expression is read against)."""
    return t.astimezone(zone).replace(tzinfo=None)


def _instant(wall: datetime, zone: tzinfo) -> datetime:
    """The UTC instant of a wall-clock time: its first occurrence when the clock repeats it, the moment the clock
    jumps past it when the clock skips it. Non-decreasing in `wall`, so slots keep their order."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if _wall(first, zone) == wall:
        return first
    # Skipped: the jump is the first whole second whose wall clock reads past `wall` (offsets are whole seconds).
    before, after = int(wall.replace(tzinfo=zone, fold=1).timestamp()), int(first.timestamp())
    while after - before > 1:
        middle = (before + after) // 2
        if _wall(datetime.fromtimestamp(middle, UTC), zone) < wall:
            before = middle
        else:
            after = middle
    return datetime.fromtimestamp(after, UTC)


@dataclass(frozen=True, kw_only=True)
class Recurrence:
    """Exactly one of ``interval`` (> 0) or ``cron`` (a valid 5-field expression, read on ``tz``'s wall clock)."""

    interval: timedelta | None = None
    cron: str | None = None
    tz: str | None = None
    """The IANA zone a cron is read in (None: UTC). An interval is elapsed time and takes no zone."""

    def __post_init__(self) -> None:
        if (self.interval is None) == (self.cron is None):
            raise ScheduleError("invalid_schedule", "exactly one of interval or cron must be set")
        if self.interval is not None:
            if not isinstance(self.interval, timedelta):
                raise ScheduleError("invalid_schedule", f"interval must be a timedelta, got {self.interval!r}")
            if self.interval <= _ZERO:
                raise ScheduleError("invalid_schedule", f"interval must be positive, got {self.interval}")
            if self.tz is not None:
                raise ScheduleError("invalid_schedule", "an interval is elapsed time: it takes no time zone")
        if self.cron is not None:
            self._validate_cron(self.cron)
        _zone(self.tz)

    @staticmethod
    def _validate_cron(expr: object) -> None:
        if not isinstance(expr, str) or len(expr.split()) != 5:
            raise ScheduleError("invalid_schedule", f"cron must be a 5-field expression, got {expr!r}")
        if not croniter.is_valid(expr):
            raise ScheduleError("invalid_schedule", f"cron expression does not parse: {expr!r}")
        try:  # e.g. "0 0 30 2 *" parses but never matches
            croniter(expr, datetime(2000, 1, 1, tzinfo=UTC)).get_next(datetime)
        except (ValueError, KeyError) as exc:
            raise ScheduleError("invalid_schedule", f"cron expression never fires: {expr!r}") from exc

    def next_after(self, t: datetime, *, anchor: datetime) -> datetime:
        """The first slot strictly after ``t`` (UTC). Interval slots are ``anchor + k * interval``, ``k >= 0``."""
        t = _utc(t, "t")
        anchor = _utc(anchor, "anchor")
        if self.interval is not None:
            if t < anchor:
                return anchor
            return anchor + ((t - anchor) // self.interval + 1) * self.interval
        return next(self._cron_slots(t))

    def latest_at_or_before(self, t: datetime, *, anchor: datetime) -> datetime | None:
        """The last slot ``<= t`` (UTC), or None if there is none (an interval schedule before its anchor)."""
        t = _utc(t, "t")
        anchor = _utc(anchor, "anchor")
        if self.interval is not None:
            if t < anchor:
                return None
            return anchor + ((t - anchor) // self.interval) * self.interval
        # A wall-clock slot before t's own happened before t; walk forward from there over any the clock repeated.
        zone = _zone(self.tz)
        it = croniter(self._cron_expr, _wall(t, zone))
        latest = _as_datetime(it.get_prev(datetime))
        it = croniter(self._cron_expr, latest)
        while True:
            wall = _as_datetime(it.get_next(datetime))
            if _instant(wall, zone) > t:
                return _instant(latest, zone)
            latest = wall

    def _cron_slots(self, t: datetime) -> Iterator[datetime]:
        """The cron's slots strictly after ``t``, in UTC, strictly increasing."""
        zone = _zone(self.tz)
        it = croniter(self._cron_expr, _wall(t, zone))
        last = t
        while True:
            slot = _instant(_as_datetime(it.get_next(datetime)), zone)
            if slot > last:
                last = slot
                yield slot

    @property
    def _cron_expr(self) -> str:
        assert self.cron is not None
        return self.cron

    def _count_in(self, lo: datetime, hi: datetime, *, anchor: datetime) -> tuple[int, datetime | None, bool]:
        """Slots in the half-open range ``(lo, hi]``: (count, latest such slot, whether the count was capped)."""
        if hi <= lo:
            return 0, None, False
        if self.interval is not None:
            last = self.latest_at_or_before(hi, anchor=anchor)
            if last is None or last <= lo:
                return 0, None, False
            first = self.next_after(lo, anchor=anchor)
            return (last - first) // self.interval + 1, last, False
        count = 0
        latest: datetime | None = None
        for slot in self._cron_slots(lo):
            if slot > hi:
                return count, latest, False
            if count == CRON_SCAN_CAP:
                break
            count += 1
            latest = slot
        # Capped: there may be more slots; the latest one is still exact.
        return count, self.latest_at_or_before(hi, anchor=anchor), True


@dataclass(frozen=True, kw_only=True)
class Decision:
    fire_slot: datetime | None  # the slot to fire now, or None if nothing fires now
    next_due: datetime | None  # the new due time (None: the timer is done -- follow-ups only)
    missed: int  # how many slots were missed and not fired (for logging; a lower bound past CRON_SCAN_CAP)


def decide(
    *,
    due_at: datetime,
    now: datetime,
    recurrence: Recurrence | None,
    anchor: datetime,
    misfire: Misfire,
    grace: timedelta = _ZERO,
) -> Decision | None:
    """What a timer due at ``due_at`` should do at ``now``; None if it is not due yet (``now < due_at``).

    * Follow-up (``recurrence is None``): fire ``due_at`` once, however late; ``next_due`` is None.
    * Schedule: the slots to account for are ``due_at`` plus every slot in ``(due_at, now]``. ``next_due`` is always
      the first slot strictly after ``now``.

      - One slot (``due_at`` only): fire it, ``missed=0``.
      - Several (downtime): under ``skip``, fire the latest one only if ``now - latest <= grace`` (the rest are
        missed), otherwise fire nothing and every slot is missed; under ``catch_up_once``, fire the latest one and
        count the rest as missed.
    """
    due_at = _utc(due_at, "due_at")
    now = _utc(now, "now")
    anchor = _utc(anchor, "anchor")
    if grace < _ZERO:
        raise ScheduleError("invalid_grace", f"grace must not be negative, got {grace}")
    try:
        misfire = Misfire(misfire)
    except ValueError as exc:
        raise ScheduleError("invalid_misfire", f"unknown misfire policy {misfire!r}") from exc
    if now < due_at:
        return None
    if recurrence is None:
        return Decision(fire_slot=due_at, next_due=None, missed=0)

    extra, latest_extra, _capped = recurrence._count_in(due_at, now, anchor=anchor)
    next_due = recurrence.next_after(now, anchor=anchor)
    if extra == 0:
        return Decision(fire_slot=due_at, next_due=next_due, missed=0)
    assert latest_extra is not None
    total = extra + 1
    if misfire == Misfire.CATCH_UP_ONCE or now - latest_extra <= grace:
        return Decision(fire_slot=latest_extra, next_due=next_due, missed=total - 1)
    return Decision(fire_slot=None, next_due=next_due, missed=total)


def min_gap(recurrence: Recurrence, *, anchor: datetime) -> timedelta:
    """The interval, or for cron the smallest gap between consecutive slots over the next 50 firings after anchor."""
    anchor = _utc(anchor, "anchor")
    if recurrence.interval is not None:
        return recurrence.interval
    slots = recurrence._cron_slots(anchor)
    prev = next(slots)
    smallest: timedelta | None = None
    for _ in range(MIN_GAP_FIRINGS - 1):
        slot = next(slots)
        gap = slot - prev
        smallest = gap if smallest is None else min(smallest, gap)
        prev = slot
    assert smallest is not None
    return smallest
