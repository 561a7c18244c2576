"""Every table, in one place. States are `StrEnum`s mirrored by SQL `CHECK` constraints.

SQLAlchemy Core tables rather than SQLModel classes: every state change is a guarded Core `UPDATE`, and the hot
ingest path batches Core inserts, so an ORM layer would sit unused. The schema stays PostgreSQL-compatible.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Dialect,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    UniqueConstraint,
    event,
)

__all__ = [
    "APPEND_ONLY",
    "ControlKind",
    "EventKind",
    "EventStatus",
    "OutboxKind",
    "OutboxState",
    "RunOutcome",
    "TaskState",
    "TimerKind",
    "TimerState",
    "WaitState",
    "append_only_ddl",
    "control",
    "events",
    "metadata",
    "outbox",
    "runs",
    "session_keys",
    "sessions",
    "tasks",
    "timers",
    "todos",
    "usage_daily",
    "users",
    "waits",
]


class UTCDateTime(TypeDecorator[datetime]):
    """Stored as naive UTC, returned tz-aware; naive input is refused rather than guessed."""

    impl = DateTime(timezone=False)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column")
        return value.astimezone(UTC).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


class EventStatus(StrEnum):
    PENDING = "pending"      # acknowledged, waiting for a run
    PROCESSED = "processed"  # a run committed its outcome
    FAILED = "failed"        # poison: past the attempt cap; the user was told
    LATE = "late"            # matched only a terminal wait: recorded, wakes nothing


class EventKind(StrEnum):
    WEBHOOK = "webhook"
    TIMER = "timer"
    WAIT_TIMEOUT = "wait_timeout"
    CONTROL = "control"


class RunOutcome(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    INTERRUPTED = "interrupted"          # STOP or a preempting control event
    BUDGET_EXHAUSTED = "budget_exhausted"
    FAILED = "failed"                    # the handler raised; events stay pending
    ABANDONED = "abandoned"              # the lease expired under it (worker died)
    STALE = "stale"                      # its commit lost to a newer fencing token


class WaitState(StrEnum):
    PENDING = "pending"
    SATISFIED = "satisfied"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


class TaskState(StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    CLOSED = "closed"


class TimerKind(StrEnum):
    FOLLOWUP = "followup"
    SCHEDULE = "schedule"


class TimerState(StrEnum):
    ACTIVE = "active"
    DONE = "done"
    CANCELLED = "cancelled"


class OutboxKind(StrEnum):
    USER_MESSAGE = "user_message"
    DISPATCH = "dispatch"


class OutboxState(StrEnum):
    PENDING = "pending"
    SENT = "sent"
    FAILED = "failed"


class ControlKind(StrEnum):
    STOP = "stop"
    START = "start"
    PAUSE = "pause"
    RESUME = "resume"
    CLOSE = "close"


def _check(column: str, enum: type[StrEnum]) -> CheckConstraint:
    values = ", ".join(f"'{member.value}'" for member in enum)
    return CheckConstraint(f"{column} IN ({values})", name=f"{column}_valid")


def _now_col(name: str, **kw: Any) -> Column[datetime]:
    return Column(name, UTCDateTime(), **kw)


metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

users = Table(
    "users",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("name", String(100), nullable=False, unique=True),
    Column("token_digest", String(64), unique=True),
    _now_col("created_at", nullable=False),
)

sessions = Table(
    "sessions",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("fencing_token", BigInteger, nullable=False, default=0),
    Column("lease_owner", String(80)),
    _now_col("lease_expires_at"),
    _now_col("created_at", nullable=False),
)

session_keys = Table(
    "session_keys",
    metadata,
    Column("user_id", String(40), ForeignKey("users.id"), primary_key=True),
    Column("key", String(200), primary_key=True),
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False),
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False),
    Column("title", Text, nullable=False),
    Column("state", String(16), nullable=False, default=TaskState.ACTIVE.value),
    _now_col("created_at", nullable=False),
    _now_col("closed_at"),
    _check("state", TaskState),
)

events = Table(
    "events",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("source", String(100), nullable=False),
    Column("source_id", String(300), nullable=False),
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False),
    Column("corr_key", String(200)),
    Column("kind", String(16), nullable=False),
    Column("trust", String(32), nullable=False),
    Column("preempt", Boolean, nullable=False, default=False),
    Column("payload", Text, nullable=False),
    Column("status", String(16), nullable=False, default=EventStatus.PENDING.value),
    Column("attempts", Integer, nullable=False, default=0),
    Column("run_id", String(40)),
    _now_col("received_at", nullable=False),
    _now_col("settled_at"),
    UniqueConstraint("source", "source_id"),
    Index(None, "session_id", "status"),
    Index(None, "user_id", "corr_key"),
    _check("status", EventStatus),
    _check("kind", EventKind),
)

todos = Table(
    "todos",
    metadata,
    Column("session_id", String(40), ForeignKey("sessions.id"), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("version", BigInteger, nullable=False, default=1),
    _now_col("due_at", nullable=False),
    Index(None, "due_at"),
)

runs = Table(
    "runs",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("fencing_token", BigInteger, nullable=False),
    Column("worker", String(80), nullable=False),
    Column("outcome", String(20), nullable=False, default=RunOutcome.RUNNING.value),
    Column("steps", Integer, nullable=False, default=0),
    Column("reason", Text),
    _now_col("started_at", nullable=False),
    _now_col("ended_at"),
    Index(None, "session_id", "outcome"),
    _check("outcome", RunOutcome),
)

waits = Table(
    "waits",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id")),
    Column("match_key", String(200), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("state", String(16), nullable=False, default=WaitState.PENDING.value),
    _now_col("deadline"),
    _now_col("created_at", nullable=False),
    _now_col("resolved_at"),
    Column("resolved_event_id", String(40)),
    UniqueConstraint("user_id", "match_key"),
    Index(None, "state", "deadline"),
    _check("state", WaitState),
)

timers = Table(
    "timers",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("state", String(16), nullable=False, default=TimerState.ACTIVE.value),
    _now_col("due_at", nullable=False),
    _now_col("anchor", nullable=False),
    Column("interval_seconds", BigInteger),
    Column("cron", String(120)),
    Column("misfire", String(16), nullable=False, default="skip"),
    Column("note", Text, nullable=False, default=""),
    Column("fire_count", Integer, nullable=False, default=0),
    _now_col("last_slot"),
    _now_col("created_at", nullable=False),
    Index(None, "state", "due_at"),
    _check("kind", TimerKind),
    _check("state", TimerState),
    CheckConstraint("misfire IN ('skip', 'catch_up_once')", name="misfire_valid"),
)

outbox = Table(
    "outbox",
    metadata,
    Column("id", String(40), primary_key=True),  # also the idempotency key the receiver sees
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("session_id", String(40)),
    Column("run_id", String(40)),
    Column("body", Text, nullable=False),
    Column("state", String(16), nullable=False, default=OutboxState.PENDING.value),
    Column("attempts", Integer, nullable=False, default=0),
    Column("last_error", Text),
    _now_col("next_attempt_at", nullable=False),
    _now_col("created_at", nullable=False),
    _now_col("sent_at"),
    Index(None, "state", "next_attempt_at"),
    _check("kind", OutboxKind),
    _check("state", OutboxState),
)

control = Table(
    "control",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id")),  # NULL: the whole deployment
    Column("task_id", String(40), ForeignKey("tasks.id")),
    Column("kind", String(16), nullable=False),
    Column("actor", String(100), nullable=False),
    Column("reason", Text, nullable=False, default=""),
    _now_col("created_at", nullable=False),
    Index(None, "user_id", "task_id", "created_at"),
    _check("kind", ControlKind),
)

usage_daily = Table(
    "usage_daily",
    metadata,
    Column("user_id", String(40), ForeignKey("users.id"), primary_key=True),
    Column("day", String(10), primary_key=True),
    Column("steps", Integer, nullable=False, default=0),
)

APPEND_ONLY = ("control",)
"""History tables: the schema refuses UPDATE and DELETE on them."""


def append_only_ddl(table: str, dialect: str) -> list[str]:
    """Triggers that make `table` append-only, for SQLite or PostgreSQL."""
    if dialect == "sqlite":
        return [
            f"CREATE TRIGGER {table}_no_{op.lower()} BEFORE {op} ON {table} "
            f"BEGIN SELECT RAISE(ABORT, '{table} is append-only'); END"
            for op in ("UPDATE", "DELETE")
        ]
    return [
        "CREATE OR REPLACE FUNCTION wakeful_append_only() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN RAISE EXCEPTION '% is append-only', TG_TABLE_NAME; END $$",
        f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
        "FOR EACH ROW EXECUTE FUNCTION wakeful_append_only()",
    ]


for _name in APPEND_ONLY:
    for _dialect in ("sqlite", "postgresql"):
        for _stmt in append_only_ddl(_name, _dialect):
            event.listen(metadata.tables[_name], "after_create",
                         DDL(_stmt).execute_if(dialect=_dialect))  # type: ignore[no-untyped-call]
