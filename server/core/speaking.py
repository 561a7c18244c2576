"""When the agent speaks: the gate every message to the user passes, and the one summary that carries what it held.

    Level, Urgency     what a message says it is (notify, suggest, ask, act) and, when urgent, why and by when
    Preferences        the user's time zone, quiet hours and daily attention budget: control state, written only by
                       the user (`change_preferences`: `PUT /v1/preferences`, `wakeful preferences`), never the agent
    decide             the gate, a pure function of the preferences, the time, the message's urgency and how many
                       messages went out today: send now, or hold until a time, and why
    admit              the gate's shell for one message being queued: its state, `seq` and recorded reason
    release_due        at the end of a hold, the user's held messages go out as ONE summary, in order, each with
                       its level

Urgency breaks through a hold only when its deadline is still ahead and falls before the hold ends (the hotel hold
that expires at 06:00 while quiet hours run to 07:30): news that can wait for the summary waits. A message marked
urgent whose deadline does not fall in that window is held like any other, and its record says so.

Every message the user is shown carries `seq`, their feed's order. It is taken by incrementing the user's row, whose
lock the transaction then holds to its commit: two writers for one user commit in seq order, so a reader that has
seen seq N never later finds a message below N (`GET /v1/messages?after=`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, time, timedelta
from enum import StrEnum
from typing import Any, Final
from zoneinfo import ZoneInfo

from sqlalchemy import Connection, and_, bindparam, func, select, update

from wakeful.server.errors import BadRequest, NotFound
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import OutboxKind, OutboxState, outbox, users
from wakeful.server.store.users import set_zone

__all__ = ["HH_MM", "Gate", "Level", "Preferences", "QuietHours", "Urgency", "admit", "any_held_due",
           "change_preferences", "decide", "describe", "next_summary", "preferences", "release_due", "summarize"]


HH_MM: Final = r"^([01][0-9]|2[0-3]):[0-5][0-9]$"
"""A local wall-clock time as quiet hours are written: 23:00, 07:30."""


class Level(StrEnum):
    """How much a message asks of the user, least first ("record silently" is `stay_quiet`: no message at all)."""

    NOTIFY = "notify"
    SUGGEST = "suggest"
    ASK = "ask"
    ACT = "act"


@dataclass(frozen=True, kw_only=True)
class Urgency:
    reason: str
    deadline: datetime
    """When waiting stops helping (a hold expires, a flight leaves): the claim urgency is judged by."""


@dataclass(frozen=True, kw_only=True)
class QuietHours:
    """Local wall-clock times; a window may cross midnight (23:00–07:30)."""

    start: time
    end: time

    @classmethod
    def parse(cls, start: str, end: str) -> QuietHours:
        """From "HH:MM" strings; anything else, or equal times (quiet all day, or never?), is a 400
        `invalid_quiet_hours`."""
        if not (re.fullmatch(HH_MM, start) and re.fullmatch(HH_MM, end)):
            raise BadRequest("invalid_quiet_hours", f"quiet hours are two local times HH:MM, not {start!r}, {end!r}")
        quiet = cls(start=time.fromisoformat(start), end=time.fromisoformat(end))
        if quiet.start == quiet.end:
            raise BadRequest("invalid_quiet_hours", "quiet hours must start and end at different times")
        return quiet

    def covers(self, local: time) -> bool:
        if self.start < self.end:
            return self.start <= local < self.end
        return local >= self.start or local < self.end

    def __str__(self) -> str:
        return f"{self.start:%H:%M}–{self.end:%H:%M}"


@dataclass(frozen=True, kw_only=True)
class Preferences:
    zone: ZoneInfo
    quiet: QuietHours | None = None
    budget: int | None = None
    """Messages per local day; past it, what is not urgent waits for the next summary."""


@dataclass(frozen=True, kw_only=True)
class Gate:
    """The gate's answer for one message: held until `hold_until` (None: it goes now), and why, to be recorded."""

    hold_until: datetime | None
    why: str | None


def decide(prefs: Preferences, *, now: datetime, urgency: Urgency | None, sent_today: int) -> Gate:
    """Send now, or hold until the end of quiet hours / the next summary. Checks in order: quiet hours, the budget,
    then whether urgency (a deadline before the hold would end) breaks through."""
    local = now.astimezone(prefs.zone)
    if prefs.quiet is not None and prefs.quiet.covers(local.time()):
        until, why = _next(local, prefs.quiet.end), f"quiet hours {prefs.quiet} ({prefs.zone.key})"
    elif prefs.budget is not None and sent_today >= prefs.budget:
        until, why = next_summary(prefs, now), f"the attention budget of {prefs.budget} messages a day is used"
    else:
        return Gate(hold_until=None, why=None)
    shown = f"{until.astimezone(prefs.zone):%Y-%m-%d %H:%M}"
    if urgency is not None and now < urgency.deadline < until:
        return Gate(hold_until=None, why=f"urgent, broke through {why}: {urgency.reason} (deadline "
                                         f"{urgency.deadline.astimezone(prefs.zone):%H:%M}, before {shown})")
    if urgency is not None:
        why += (f"; marked urgent ({urgency.reason}) but its deadline "
                f"{urgency.deadline.astimezone(prefs.zone):%Y-%m-%d %H:%M} is not between now and {shown}, "
                "so it is not urgent")
    return Gate(hold_until=until.astimezone(UTC), why=f"held for the summary at {shown}: {why}")


def next_summary(prefs: Preferences, now: datetime) -> datetime:
    """When held messages next go out: the end of the next quiet hours, or the next local midnight without them."""
    local = now.astimezone(prefs.zone)
    return _next(local, prefs.quiet.end if prefs.quiet is not None else time(0))


def _next(local: datetime, at: time) -> datetime:
    """The first local `at` strictly after `local`."""
    candidate = datetime.combine(local.date(), at, tzinfo=local.tzinfo)
    return candidate if candidate > local else datetime.combine(local.date() + timedelta(days=1), at,
                                                                tzinfo=local.tzinfo)


# -- records --------------------------------------------------------------------------------------------------------


def preferences(conn: Connection, user_id: str) -> Preferences:
    row = conn.execute(select(users.c.timezone, users.c.quiet_start, users.c.quiet_end, users.c.attention_budget)
                       .where(users.c.id == user_id)).first()
    if row is None:
        raise NotFound("unknown_user", f"no user {user_id}")
    quiet = QuietHours.parse(row.quiet_start, row.quiet_end) if row.quiet_start and row.quiet_end else None
    return Preferences(zone=ZoneInfo(row.timezone), quiet=quiet, budget=row.attention_budget)


def change_preferences(conn: Connection, *, user_id: str, changes: Mapping[str, Any]) -> Preferences:
    """Set what `changes` names (`timezone`: an IANA name; `quiet_hours`: `QuietHours` or None; `attention_budget`:
    messages per day or None), keep the rest; returns what holds afterwards. Only the user's channels call this."""
    if "timezone" in changes:
        set_zone(conn, user_id=user_id, name=changes["timezone"])
    current = preferences(conn, user_id)
    quiet: QuietHours | None = changes.get("quiet_hours", current.quiet)
    values = {"quiet_start": f"{quiet.start:%H:%M}" if quiet else None,
              "quiet_end": f"{quiet.end:%H:%M}" if quiet else None,
              "attention_budget": changes.get("attention_budget", current.budget)}
    conn.execute(update(users).where(users.c.id == user_id).values(**values))
    return preferences(conn, user_id)


def describe(prefs: Preferences) -> dict[str, Any]:
    """As the control channel shows them (`GET /v1/preferences`, `wakeful preferences`)."""
    quiet = prefs.quiet
    return {"timezone": prefs.zone.key, "attention_budget": prefs.budget,
            "quiet_hours": {"start": f"{quiet.start:%H:%M}", "end": f"{quiet.end:%H:%M}"} if quiet else None}


def admit(conn: Connection, *, user_id: str, now: datetime, urgency: Urgency | None) -> dict[str, Any]:
    """The outbox columns of one message to the user as the gate decides: pending with the user's next `seq`, or
    held until its summary. Takes the user's row lock (see the module docstring) when the message goes."""
    prefs = preferences(conn, user_id)
    sent = _sent_since(conn, user_id, _midnight(now, prefs.zone)) if prefs.budget is not None else 0
    gate = decide(prefs, now=now, urgency=urgency, sent_today=sent)
    if gate.hold_until is not None:
        return {"state": OutboxState.HELD.value, "seq": None, "gate": gate.why, "held_until": gate.hold_until}
    return {"state": OutboxState.PENDING.value, "seq": _next_seq(conn, user_id), "gate": gate.why,
            "held_until": None}


def any_held_due(conn: Connection, *, now: datetime) -> bool:
    """Whether `release_due` would find anything (a read, so an idle round takes no write lock)."""
    return conn.execute(select(outbox.c.id).where(_HELD_DUE).params(now=now).limit(1)).first() is not None


def release_due(conn: Connection, *, now: datetime) -> int:
    """For every user with held messages whose hold has ended: one summary of them, in the order they were
    written, queued with the user's next `seq`; the held rows become `batched` into it. Returns summaries queued."""
    due = conn.execute(select(outbox.c.user_id).where(_HELD_DUE).params(now=now).distinct()).scalars().all()
    released = 0
    for user_id in due:
        seq = _next_seq(conn, user_id)  # the lock first: a second releaser waits, then finds nothing held
        held = conn.execute(select(outbox).where(and_(
            outbox.c.user_id == user_id, outbox.c.state == OutboxState.HELD.value, outbox.c.held_until <= now))
            .order_by(outbox.c.created_at, outbox.c.id)).all()
        if not held:
            continue
        summary_id = new_id("msg")
        conn.execute(outbox.insert().values(
            id=summary_id, user_id=user_id, kind=OutboxKind.USER_MESSAGE.value, body=json.dumps(
                summarize(held, preferences(conn, user_id).zone), sort_keys=True),
            state=OutboxState.PENDING.value, attempts=0, next_attempt_at=now, created_at=now, seq=seq))
        moved = conn.execute(_BATCH, {"rows": [r.id for r in held], "summary": summary_id}).rowcount
        if moved != len(held):
            raise RuntimeError(f"{len(held) - moved} held messages of {user_id} moved while being summarized")
        released += 1
    return released


def summarize(held: Sequence[Any], zone: ZoneInfo) -> dict[str, Any]:
    """The summary's body: each held message in order, with its level and local time; its level is the highest."""
    items = []
    for row in held:
        body = json.loads(row.body)
        items.append({"message_id": row.id, "level": body.get("level", Level.NOTIFY.value),
                      "text": _said(body),
                      "at": f"{row.created_at.astimezone(zone):%H:%M}"})
    lines = [f"{n}. [{i['level']}, {i['at']}] {i['text']}" for n, i in enumerate(items, 1)]
    levels = list(Level)
    top = max((Level(i["level"]) for i in items), key=levels.index, default=Level.NOTIFY)
    return {"kind": "summary", "level": top.value, "items": items,
            "text": f"While you were not to be disturbed, {len(items)} message(s) waited:\n" + "\n".join(lines)}


def _said(body: dict[str, Any]) -> str:
    """A held message in one line: its text, else its card's lines (an approval or steer request), else its kind."""
    if body.get("text"):
        return str(body["text"])
    kind = str(body.get("kind", "a message"))
    lines = "; ".join(str(line) for line in (body.get("card") or {}).get("lines", []))
    return f"{kind}: {lines}" if lines else kind


_HELD_DUE = and_(outbox.c.state == OutboxState.HELD.value, outbox.c.held_until <= bindparam("now"))
_BATCH = (update(outbox).where(and_(outbox.c.id.in_(bindparam("rows", expanding=True)),
                                    outbox.c.state == OutboxState.HELD.value))
          .values(state=OutboxState.BATCHED.value, summary_id=bindparam("summary")))


def _next_seq(conn: Connection, user_id: str) -> int:
    seq = conn.execute(update(users).where(users.c.id == user_id).values(message_seq=users.c.message_seq + 1)
                       .returning(users.c.message_seq)).scalar_one_or_none()
    if seq is None:
        raise NotFound("unknown_user", f"no user {user_id}")
    return int(seq)


def _midnight(now: datetime, zone: ZoneInfo) -> datetime:
    local = now.astimezone(zone)
    return datetime.combine(local.date(), time(0), tzinfo=zone).astimezone(UTC)


def _sent_since(conn: Connection, user_id: str, since: datetime) -> int:
    """Messages that went to the user since `since` (each summary is one)."""
    return int(conn.execute(select(func.count()).select_from(outbox).where(and_(
        outbox.c.user_id == user_id, outbox.c.kind == OutboxKind.USER_MESSAGE.value, outbox.c.seq.is_not(None),
        outbox.c.created_at >= since))).scalar_one())
