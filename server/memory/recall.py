"""Recall: the memory records one wake's context carries, read as of the run's start.

    recall   the user's records in force at `now` that fit this wake: standing instructions always; the records
             scoped to this task or this run; wider ones (a project, always) only when one of their topics is in the
             focus. A narrower record overrides a wider one of the same subject and relation: the wider one is left
             out and named in `overrides` (it is not rewritten, and is back once the narrower one ends). Bounded,
             in a fixed order; an empty recall is an answer. `corrected_since` names the records earlier runs of the
             session recalled that were corrected, forgotten or invalidated since the session's previous run.
    focus    a wake's focus: the words of the task's goal (lowercased, stop words dropped), the prefixes of the
             task's keys (`PNR123` → `pnr`), and the sources of its events; `recall` adds the events' kinds.

As of `now`, on both time axes: a version counts when it was recorded before `now` and not retired by then, and
holds in the world at `now` (valid_from ≤ now < valid_until). "Before", not "at": a run's own writes are stamped at
or after its start, so neither the run nor a replay of it recalls them, and a replay of an old run recalls what the
run recalled then, records retired since included. A version is written pending or active and only moves on to
retired; one that was pending (it needed the user and has no confirmation, or the user rejected it) never counts.

Recall shapes a plan; it never approves or widens anything: nothing in an authorization path imports this package
(`tests/unit/test_memory_never_authorizes.py`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import Connection, and_, func, not_, or_, select, union

from wakeful.server.store.tables import (
    MemoryForm,
    MemoryScope,
    MemoryState,
    Speaker,
    memories,
    memory_topics,
    memory_uses,
    runs,
    task_keys,
)

__all__ = ["CORRECTED_CAP", "FOCUS_CAP", "LIMIT", "Corrected", "Overridden", "Recall", "Recalled", "focus", "recall",
           "record_uses"]

LIMIT: Final = 12
"""Records one wake recalls at most."""
FOCUS_CAP: Final = 64
"""Topics one recall matches at most (the events' kinds and sources first, then the goal's words and key prefixes)."""
CORRECTED_CAP: Final = 10
TEXT_CAP: Final = 500

_STOP: Final = frozenset(
    "a about after all also an and any are as at be before but by can do does for from had has have he her his how "
    "i if in into is it its just me my no not of on once only or our out over she so some than that the their them "
    "then there these they this those to too up us was we were what when where which while who will with would you "
    "your".split())
_WORD = re.compile(r"[a-z0-9][a-z0-9_.-]*[a-z0-9]|[a-z0-9]")
_KEY_PREFIX = re.compile(r"[a-z]{2,}")
_SCOPE_RANK: Final = {MemoryScope.RUN.value: 0, MemoryScope.TASK.value: 1, MemoryScope.PROJECT.value: 2,
                      MemoryScope.ALWAYS.value: 3}
_WIDER: Final = (MemoryScope.PROJECT.value, MemoryScope.ALWAYS.value)
_NEEDS_USER: Final = (MemoryForm.HYPOTHESIS.value, MemoryForm.SKILL.value, MemoryForm.FACT.value)
_CORRECTIONS: Final = ("corrected", "forgotten", "invalidated")


@dataclass(frozen=True, kw_only=True)
class Recalled:
    """One recalled record version, tagged with who said it, where it holds and until when."""

    id: str
    version: int
    form: str
    text: str
    subject: str
    relation: str
    speaker: str
    speaker_name: str
    scope: str
    scope_ref: str | None
    valid_from: datetime
    valid_until: datetime | None
    confirmed: str | None
    """What confirmed it (the user's change, an approval); None: the user's own words, or not confirmed."""

    @property
    def stance(self) -> bool:
        """A statement is what the user said once: a stance to understand, never a premise to reason from."""
        return self.form == MemoryForm.STATEMENT.value

    def to_json(self) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": self.id, "version": self.version, "form": self.form, "text": self.text[:TEXT_CAP],
            "speaker": self.speaker, "speaker_name": self.speaker_name, "scope": self.scope,
            "valid_until": self.valid_until.isoformat() if self.valid_until else None, "confirmed": self.confirmed,
        }
        if self.scope_ref is not None:
            item["scope_ref"] = self.scope_ref
        if self.stance:
            item |= {"stance": True, "said_at": self.valid_from.isoformat()}
        return item


@dataclass(frozen=True, kw_only=True)
class Overridden:
    """A wider record left out because a narrower one on the same subject and relation is in force."""

    id: str
    scope: str
    by: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "scope": self.scope, "overridden_by": self.by}


@dataclass(frozen=True, kw_only=True)
class Corrected:
    """A record an earlier run of the session recalled that the user corrected or forgot, or that was invalidated."""

    id: str
    subject: str
    relation: str
    reason: str
    at: datetime

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "about": f"{self.subject} {self.relation}", "reason": self.reason,
                "at": self.at.isoformat()}


@dataclass(frozen=True, kw_only=True)
class Recall:
    records: tuple[Recalled, ...]
    overrides: tuple[Overridden, ...] = ()
    corrected_since: tuple[Corrected, ...] = ()
    left_out: int = 0
    """Records that fit but were past the limit."""

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(r.id for r in self.records)

    def to_json(self) -> dict[str, Any]:
        """What the context tail holds (`tail["memory"]`), in the recall's order."""
        return {"records": [r.to_json() for r in self.records], "overrides": [o.to_json() for o in self.overrides],
                "corrected_since": [c.to_json() for c in self.corrected_since], "left_out": self.left_out}


def focus(conn: Connection, *, task_id: str | None, goal: str, sources: Iterable[str],
          now: datetime) -> tuple[str, ...]:
    """The topics a wake is about: its events' sources, the goal's words, the prefixes of the keys the task held at
    `now`; lowercased, each once, in that order, at most FOCUS_CAP."""
    prefixes: list[str] = []
    if task_id is not None:
        held = conn.execute(select(task_keys.c.key).where(and_(
            task_keys.c.task_id == task_id, task_keys.c.bound_at < now,
            or_(task_keys.c.released_at.is_(None), task_keys.c.released_at >= now))).order_by(task_keys.c.key))
        prefixes = [m.group(0) for k in held.scalars() if (m := _KEY_PREFIX.match(k.lower()))]
    return _topics([*sources, *_words(goal), *prefixes])


def _words(text: str) -> list[str]:
    """A goal's words worth matching: lowercased, no stop words, a plural also as its singular."""
    words = [w for w in _WORD.findall(text.lower()) if w not in _STOP and len(w) > 1]
    return [form for w in words for form in ([w, w[:-1]] if len(w) > 3 and w.endswith("s") else [w])]


def _topics(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip().lower()[:80] for v in values if v and v.strip()))[:FOCUS_CAP]


def recall(conn: Connection, *, user_id: str, task_id: str | None, run_id: str, event_kinds: Sequence[str],
           focus: Sequence[str], now: datetime, limit: int = LIMIT) -> Recall:
    """The records of `user_id` in force at `now` that this wake (of `task_id`, run `run_id`) recalls."""
    topics = _topics([*event_kinds, *focus])
    m = memories.c
    hits: dict[str, int] = {  # per record on a topic of the focus: how many of its topics are
        r.memory_id: r.n for r in conn.execute(select(memory_topics.c.memory_id, func.count().label("n")).where(and_(
            memory_topics.c.user_id == user_id, memory_topics.c.topic.in_(topics)))
            .group_by(memory_topics.c.memory_id))} if topics else {}
    own = union(  # the user's instructions and the records of this task or run, whatever their topics
        select(m.id).where(and_(m.user_id == user_id, m.form == MemoryForm.INSTRUCTION.value, m.scope.in_(_WIDER))),
        select(m.id).where(and_(m.user_id == user_id, m.scope == MemoryScope.TASK.value, m.scope_ref == task_id)),
        select(m.id).where(and_(m.user_id == user_id, m.scope == MemoryScope.RUN.value, m.scope_ref == run_id)),
    )
    fits = or_(  # each side names only the user's records
        m.id.in_(own),
        and_(m.id.in_(select(memory_topics.c.memory_id).where(and_(
            memory_topics.c.user_id == user_id, memory_topics.c.topic.in_(topics)))), m.scope.in_(_WIDER)),
    )
    # light rows first (the candidates can be hundreds); whole rows for the ones kept
    rows = conn.execute(select(m.id, m.form, m.scope, m.subject, m.relation, m.recorded_at).where(and_(
        fits, *_in_force(now), or_(m.run_id.is_(None), m.run_id != run_id),
    ))).all()
    ordered = sorted(rows, key=lambda r: (r.form != MemoryForm.INSTRUCTION.value, _SCOPE_RANK[r.scope],
                                          -hits.get(r.id, 0), _newest_first(r.recorded_at), r.id))
    narrowest: dict[tuple[str, str], Any] = {}  # per subject and relation, the first of its narrowest records
    for r in ordered:
        first = narrowest.setdefault((r.subject, r.relation), r)
        if _SCOPE_RANK[r.scope] < _SCOPE_RANK[first.scope]:
            narrowest[(r.subject, r.relation)] = r
    kept, overrides = [], []
    for r in ordered:
        by = narrowest[(r.subject, r.relation)]
        if _SCOPE_RANK[r.scope] > _SCOPE_RANK[by.scope]:  # an instruction too: the user's word in this task is newer
            overrides.append(Overridden(id=r.id, scope=r.scope, by=by.id))
        else:
            kept.append(r.id)
    whole = {r.id: r for r in conn.execute(select(memories).where(m.id.in_(kept[:limit])))}
    return Recall(records=tuple(_recalled(whole[i]) for i in kept[:limit]),
                  overrides=tuple(sorted(overrides, key=lambda o: o.id)),
                  corrected_since=_corrected_since(conn, run_id=run_id, now=now),
                  left_out=max(0, len(kept) - limit))


def _newest_first(at: datetime) -> float:
    return -at.timestamp()


def _in_force(now: datetime) -> list[Any]:
    """A version in force at `now`: recorded before it, not retired by then, valid in the world at it, and one that
    was active (never a pending one: a pending version is retired when confirmed, rejected or forgotten)."""
    m = memories.c
    was_pending = or_(m.retire_reason == "rejected", and_(
        m.speaker != Speaker.USER.value, m.form.in_(_NEEDS_USER), m.confirmed_by.is_(None)))
    return [
        m.form != MemoryForm.HYPOTHESIS.value,
        or_(m.state == MemoryState.ACTIVE.value, and_(m.state == MemoryState.RETIRED.value, not_(was_pending))),
        m.recorded_at < now, or_(m.retired_at.is_(None), m.retired_at >= now),
        m.valid_from <= now, or_(m.valid_until.is_(None), m.valid_until > now),
    ]


def _recalled(r: Any) -> Recalled:
    return Recalled(id=r.id, version=r.version, form=r.form, text=r.text, subject=r.subject, relation=r.relation,
                    speaker=r.speaker, speaker_name=r.speaker_name, scope=r.scope, scope_ref=r.scope_ref,
                    valid_from=r.valid_from, valid_until=r.valid_until, confirmed=r.confirmed_by)


def _corrected_since(conn: Connection, *, run_id: str, now: datetime) -> tuple[Corrected, ...]:
    """Records the session's earlier runs recalled, corrected, forgotten or invalidated between the start of its
    previous run and `now`: what the model may have relied on before and must not rely on now."""
    session = select(runs.c.session_id).where(runs.c.id == run_id).scalar_subquery()
    previous = conn.execute(select(runs.c.started_at).where(and_(runs.c.session_id == session, runs.c.id < run_id))
                            .order_by(runs.c.id.desc()).limit(1)).scalar()
    if previous is None:
        return ()
    m = memories.c
    earlier = select(memory_uses.c.memory_id).join(runs, runs.c.id == memory_uses.c.run_id).where(and_(
        runs.c.session_id == session, runs.c.id < run_id))
    found = conn.execute(select(m.id, m.subject, m.relation, m.retire_reason, m.retired_at).where(and_(
        m.id.in_(earlier), m.retire_reason.in_(_CORRECTIONS), m.retired_at >= previous, m.retired_at < now))
        .order_by(m.retired_at, m.id).limit(CORRECTED_CAP)).all()
    return tuple(Corrected(id=r.id, subject=r.subject, relation=r.relation, reason=r.retire_reason, at=r.retired_at)
                 for r in found)


def record_uses(conn: Connection, *, run_id: str, memory_ids: Sequence[str]) -> None:
    """Which record versions run `run_id`'s context recalled (`memory_uses`): what a correction's reach names."""
    if memory_ids:
        conn.execute(memory_uses.insert(), [{"run_id": run_id, "memory_id": m} for m in dict.fromkeys(memory_ids)])
