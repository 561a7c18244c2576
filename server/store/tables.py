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
    Float,
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
    false,
    text,
)

__all__ = [
    "APPEND_ONLY",
    "CHAINED",
    "CHAIN_KEY_SEPARATOR",
    "SOURCE_PREFIX",
    "ApprovalDecision",
    "Authority",
    "ControlKind",
    "Effect",
    "EventKind",
    "EventStatus",
    "GrantPurpose",
    "MemoryForm",
    "MemoryScope",
    "MemoryState",
    "Outcome",
    "OutboxKind",
    "OutboxState",
    "RunOutcome",
    "Speaker",
    "SteerState",
    "HelperState",
    "TaskState",
    "TimerKind",
    "Risk",
    "TimerState",
    "VerdictKind",
    "WaitState",
    "actions",
    "agent_credentials",
    "append_only_ddl",
    "approval_links",
    "approval_uses",
    "approvals",
    "attempts",
    "attempts_guard_ddl",
    "MEMORY_MUTABLE",
    "memory_guard_ddl",
    "console_sessions",
    "chain_ddl",
    "chain_guard_ddl",
    "control",
    "decisions",
    "egress_audit",
    "egress_clients",
    "egress_grant_uses",
    "egress_grants",
    "event_attachments",
    "events",
    "evidence",
    "helpers",
    "ledger_chain",
    "ledger_checkpoints",
    "memories",
    "memory_changes",
    "memory_disowned",
    "memory_links",
    "memory_topics",
    "memory_uses",
    "metadata",
    "objects",
    "outbox",
    "refusals",
    "run_contexts",
    "runs",
    "sessions",
    "steer_proposals",
    "task_keys",
    "task_versions",
    "tasks",
    "timers",
    "todos",
    "tool_results",
    "triage_sessions",
    "usage_daily",
    "users",
    "verdicts",
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
    MESSAGE = "message"  # the user's own chat about a task: it preempts, and holds the task until a run reads it


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


class Authority(StrEnum):
    """Who sent a delivery, and who may satisfy a wait (the rules: `server.core.authority`). Besides these, an
    authority is `source:<name>`, one webhook source (`SOURCE_PREFIX`); `any_source` is a wait's only."""

    USER = "user"
    AGENT = "agent"  # the agent's own word (over MCP): a sender, never a wait's authority
    SYSTEM = "system"
    ANY_SOURCE = "any_source"


SOURCE_PREFIX = "source:"


class TaskState(StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    REVOKED = "revoked"   # the user withdrew the delegation: nothing more is dispatched for it
    CLOSED = "closed"
    HELD = "held"         # the user wrote: held like a pause until a run reads it (`core.holds`)


class SteerState(StrEnum):
    AWAITING_USER = "awaiting_user"  # the agent asked for more: nothing changes unless the user confirms
    CONFIRMED = "confirmed"          # the user confirmed it: it became the task's next version
    REJECTED = "rejected"
    SUPERSEDED = "superseded"        # the task got a newer version first: it asked against an old one


class OnTimeout(StrEnum):
    """What a reply wait the agent set does at its deadline (`server.core.agenda`)."""

    FOLLOW_UP = "follow_up"  # the task's session wakes with a timeout event
    TELL_USER = "tell_user"  # one plain message to the user, through the outbox; no wake
    CLOSE = "close"          # the wait ends timed out, recorded; no wake
class HelperState(StrEnum):
    """A helper task (`server.core.helper_tasks`): it runs until it returns its result, fails (its budget, or it
    ended without a result) or is stopped with its task."""

    RUNNING = "running"
    RETURNED = "returned"
    FAILED = "failed"
    STOPPED = "stopped"


class MemoryForm(StrEnum):
    """What a memory record is (`server.memory`): its form decides how far it may shape a plan."""

    INSTRUCTION = "instruction"    # the user's standing instruction: written by the user only, read-only to the agent
    PREFERENCE = "preference"      # a preference in force: the user's own words, or a candidate the user confirmed
    FACT = "fact"                  # a fact about the user or their world, confirmed by the user
    HYPOTHESIS = "hypothesis"      # a candidate inferred from choices, approvals, rejections, edits: pending the user
    STATEMENT = "statement"        # what the user said, when and where: a stance, never a premise
    EPISODE = "episode"            # what happened once (the last typhoon rebooking): recalled for similar cases
    SOURCED_FACT = "sourced_fact"  # what a named third party says: never a preference, never an instruction
    SKILL = "skill"                # a procedure revision: pending the user


class MemoryState(StrEnum):
    PENDING = "pending"  # awaiting the user's confirmation: never recalled as something in force
    ACTIVE = "active"
    RETIRED = "retired"  # kept with why and by whom (`retire_reason`, `retired_by`); never deleted


class MemoryScope(StrEnum):
    """Where a record holds, narrowest first; a narrower record overrides a wider one without rewriting it."""

    RUN = "run"
    TASK = "task"        # expires with its task
    PROJECT = "project"  # a name the user gives a group of tasks
    ALWAYS = "always"


class Speaker(StrEnum):
    """Who said what a record holds: never confusable."""

    USER = "user"
    AGENT = "agent"
    THIRD_PARTY = "third_party"  # named in `speaker_name` (the source that sent it)


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
    HELD = "held"        # a message the speaking gate held (quiet hours, the attention budget) until `held_until`
    BATCHED = "batched"  # a held message, gone out inside the summary `summary_id`


class ControlKind(StrEnum):
    STOP = "stop"
    START = "start"
    PAUSE = "pause"
    RESUME = "resume"
    REVOKE = "revoke"
    CLOSE = "close"
    REOPEN = "reopen"
    STEER = "steer"       # a new task version
    APPROVE = "approve"
    DENY = "deny"
    HOLD = "hold"         # the user's message holds the task (`core.holds`)
    RELEASE = "release"   # the system lifts a hold: the run that read the message did not confirm a pause


class Effect(StrEnum):
    READ = "read"
    WRITE = "write"


class Risk(StrEnum):
    AUTO = "auto"   # policy approves, recorded as the approver
    ASK = "ask"     # the user approves
    DENY = "deny"


class VerdictKind(StrEnum):
    ADMITTED = "admitted"
    NEEDS_APPROVAL = "needs_approval"
    REFUSED = "refused"


class Outcome(StrEnum):
    ACCEPTED = "accepted"   # the remote did it; the evidence says where
    BLOCKED = "blocked"     # certain that nothing happened
    UNKNOWN = "unknown"     # it may have happened: reconcile, never retry blindly


class ApprovalDecision(StrEnum):
    APPROVED = "approved"
    DENIED = "denied"


def _check(column: str, enum: type[StrEnum]) -> CheckConstraint:
    values = ", ".join(f"'{member.value}'" for member in enum)
    return CheckConstraint(f"{column} IN ({values})", name=f"{column}_valid")


def _authority_check(*named: Authority) -> CheckConstraint:
    """An authority is one of `named` or a webhook source's."""
    values = ", ".join(f"'{member.value}'" for member in named)
    return CheckConstraint(f"authority IN ({values}) OR authority LIKE '{SOURCE_PREFIX}%'", name="authority_valid")


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
    Column("timezone", String(64), nullable=False, server_default="UTC"),  # IANA name (`store.users.zone`)
    # What the user set about being spoken to (`core.speaking`): quiet hours as local "HH:MM", messages per day.
    Column("quiet_start", String(5)),
    Column("quiet_end", String(5)),
    Column("attention_budget", Integer),
    # The last `seq` given to one of the user's messages: taken under this row's lock, so seq order is commit order.
    Column("message_seq", BigInteger, nullable=False, server_default="0"),
    # An admin may also STOP / START the whole deployment from the console; the owner `wakeful serve` creates is one.
    Column("admin", Boolean, nullable=False, server_default=false()),
)

agent_credentials = Table(
    "agent_credentials",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("name", String(40), nullable=False),  # what the user calls the client: `claude-code`
    Column("token_digest", String(64), nullable=False, unique=True),
    _now_col("created_at", nullable=False),
    _now_col("revoked_at"),  # set once (`store.agents.revoke`): the credential answers 401 from then on
    # A name names one live credential of a user; revoked ones stay, so the records they wrote keep their author.
    Index("uq_agent_credentials_user_id_name_live", "user_id", "name", unique=True,
          sqlite_where=text("revoked_at IS NULL"), postgresql_where=text("revoked_at IS NULL")),
)
"""A user's agent credentials, one per MCP client: they reach the agent's tools (`/mcp`) and nothing else
(`server.faces.auth`). Only a credential's SHA-256 digest is stored; the credential itself is shown once."""

sessions = Table(
    "sessions",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("fencing_token", BigInteger, nullable=False, default=0),
    Column("lease_owner", String(80)),
    _now_col("lease_expires_at"),
    _now_col("created_at", nullable=False),
    Index(None, "lease_expires_at"),  # the sweeper looks for lapsed leases among every session
)

tasks = Table(
    "tasks",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False),
    Column("title", Text, nullable=False),
    Column("state", String(16), nullable=False, default=TaskState.ACTIVE.value),
    Column("current_version", Integer, nullable=False, default=1, server_default="1"),
    _now_col("created_at", nullable=False),
    _now_col("closed_at"),
    _check("state", TaskState),
    Index(None, "user_id", "created_at"),  # the console's task list, newest first
)

task_versions = Table(
    "task_versions",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("version", Integer, nullable=False),
    Column("goal", Text, nullable=False),
    Column("constraints", Text, nullable=False, default="{}"),   # JSON
    Column("completion", Text, nullable=False, default="[]"),    # JSON: conditions checked against evidence
    Column("created_by", String(100), nullable=False),
    _now_col("created_at", nullable=False),
    UniqueConstraint("task_id", "version"),
)

task_keys = Table(
    "task_keys",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("key", String(200), nullable=False),  # a PNR, an order number, a mail thread ID (`core.keys`)
    Column("bound_by", String(120), nullable=False),  # user:<id> or agent:<id> …
    Column("reason", Text, nullable=False, default=""),
    _now_col("bound_at", nullable=False),
    _now_col("released_at"),  # when its task closed or was revoked: it routes like an unknown key from then on
    Index(None, "task_id"),
    # A key leads to at most one open task of a user; released bindings stay as history.
    Index("uq_task_keys_user_id_key_bound", "user_id", "key", unique=True,
          sqlite_where=text("released_at IS NULL"), postgresql_where=text("released_at IS NULL")),
)
"""Correlation keys bound to a task: a delivery carrying one wakes the task's session (`core.inbox`)."""

triage_sessions = Table(
    "triage_sessions",
    metadata,
    Column("user_id", String(40), ForeignKey("users.id"), primary_key=True),  # one per user, by the schema
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False, unique=True),
    _now_col("created_at", nullable=False),
)
"""The session each user's deliveries go to when they match no wait and no task key (`core.triage`)."""

steer_proposals = Table(
    "steer_proposals",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("base_version", Integer, nullable=False),             # the version it was proposed against
    Column("goal", Text, nullable=False),
    Column("constraints", Text, nullable=False),                 # JSON
    Column("completion", Text, nullable=False),                  # JSON
    Column("widens", Text, nullable=False),                      # JSON: each widening, in plain words
    Column("proposed_by", String(120), nullable=False),
    Column("state", String(16), nullable=False, default=SteerState.AWAITING_USER.value),
    Column("decided_by", String(120)),
    _now_col("created_at", nullable=False),
    _now_col("decided_at"),
    Index(None, "task_id", "state"),
    _check("state", SteerState),
)

helpers = Table(
    "helpers",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("task_version", Integer, nullable=False),             # the version its handoff was based on
    Column("parent_session_id", String(40), ForeignKey("sessions.id"), nullable=False),  # where its result goes
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False, unique=True),  # its own
    Column("goal", Text, nullable=False),
    Column("constraints", Text, nullable=False),                 # JSON: a list of sentences
    Column("output_form", Text, nullable=False),
    Column("state", String(16), nullable=False, default=HelperState.RUNNING.value),
    Column("reason", Text),                                      # why it failed or was stopped
    Column("max_steps", Integer, nullable=False),
    _now_col("deadline", nullable=False),
    _now_col("created_at", nullable=False),
    _now_col("finished_at"),
    Index(None, "task_id", "state"),
    _check("state", HelperState),
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
    Column("authority", String(120), nullable=False),  # who sent it (`server.core.authority`)
    UniqueConstraint("source", "source_id"),
    Index(None, "session_id", "status", "preempt", "received_at", "id"),  # a session's pending events, oldest first
    Index(None, "status", "attempts"),  # pending events and poison ones, without reading the settled ones
    Index(None, "user_id", "corr_key"),
    Index(None, "user_id", "received_at"),  # the console's activity, newest first
    Index(None, "user_id", "status", "received_at"),  # ... filtered by status
    _check("status", EventStatus),
    _check("kind", EventKind),
    _authority_check(Authority.USER, Authority.AGENT, Authority.SYSTEM),
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
    Index(None, "outcome"),  # the sweeper's look for runs still marked running
    Index(None, "user_id", "started_at"),  # the console's runs, newest first
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
    Column("authority", String(120), nullable=False),  # who may satisfy it (`server.core.authority`)
    Column("on_timeout", String(16)),  # a reply wait the agent set; None: a timeout wakes the session
    Column("note", Text),  # what the agent awaits, in its words
    UniqueConstraint("user_id", "match_key"),
    Index(None, "state", "deadline"),
    _check("state", WaitState),
    _check("on_timeout", OnTimeout),
    _authority_check(Authority.USER, Authority.SYSTEM, Authority.ANY_SOURCE),
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
    Column("tz", String(64)),  # the IANA zone a cron is read in (the user's when it was set); None: UTC
    _now_col("ended_at"),  # when it was cancelled or fired its last
    Column("end_reason", Text),
    Index(None, "state", "due_at"),
    Index(None, "user_id", "created_at"),  # the console's timers, newest first
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
    Column("seq", BigInteger),  # the user's feed order (`GET /v1/messages?after=`); null while held, and on intents
    Column("gate", Text),  # why the speaking gate held this message, or let it break through quiet hours
    _now_col("held_until"),
    Column("summary_id", String(40)),  # the summary a held message went out in
    Index(None, "state", "next_attempt_at"),
    Index(None, "user_id", "seq", unique=True),
    Index(None, "user_id", "created_at"),  # the console's outbox, newest first
    Index(None, "session_id", "created_at"),  # a task's messages
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
    Column("event_id", String(40)),  # the event it answers: a hold's or a release's message
    Column("run_id", String(40)),    # the run that confirmed a pause or whose end released a hold
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

decisions = Table(
    "decisions",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("run_id", String(40), ForeignKey("runs.id"), nullable=False),
    Column("session_id", String(40), ForeignKey("sessions.id"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("proposal", Text, nullable=False),  # JSON, exactly as the model proposed it
    _now_col("created_at", nullable=False),
    UniqueConstraint("run_id", "step"),
)

objects = Table(
    "objects",
    metadata,
    Column("id", String(40), primary_key=True),  # opaque, minted by the server
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("task_version", Integer, nullable=False),
    Column("kind", String(64), nullable=False),
    Column("connector", String(64), nullable=False),
    Column("ref", String(500), nullable=False),  # the external reference it stands for
    Column("operation", String(130), nullable=False),  # the read that returned it
    Column("snapshot", Text, nullable=False),  # JSON: the fields kept when it was read (price, expiry …)
    _now_col("created_at", nullable=False),
    _now_col("expires_at", nullable=False),
    Column("helper_id", String(40)),  # minted for a helper run: only that helper's reads and writes resolve it
)

actions = Table(
    "actions",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("task_version", Integer, nullable=False),
    Column("run_id", String(40)),
    Column("decision_id", String(40), unique=True),  # one action per model decision, even when it is replayed
    Column("tool", String(130), nullable=False),
    Column("content", Text, nullable=False),  # canonical JSON; never changes
    Column("content_hash", String(64), nullable=False),
    Column("risk", String(8), nullable=False),
    Column("amount_cents", BigInteger),
    Column("currency", String(8)),
    _now_col("created_at", nullable=False),
    Column("operation_hash", String(64)),  # the same operation (`acting.actions`); NULL for tool-computer acts
    Index(None, "task_id", "created_at"),
    Index(None, "task_id", "task_version", "operation_hash"),
    _check("risk", Risk),
)

verdicts = Table(
    "verdicts",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("action_id", String(40), ForeignKey("actions.id"), nullable=False),
    Column("verdict", String(16), nullable=False),
    Column("code", String(40), nullable=False),
    Column("reasons", Text, nullable=False),  # JSON list of the checks, in order, with their results
    Column("approver", String(120)),          # user:<id> or policy:<rule>
    Column("approval_id", String(40)),
    _now_col("created_at", nullable=False),
    Index(None, "action_id", "created_at"),
    _check("verdict", VerdictKind),
)

approvals = Table(
    "approvals",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("action_id", String(40), ForeignKey("actions.id"), nullable=False),
    Column("content_hash", String(64), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("task_version", Integer, nullable=False),
    Column("decision", String(16), nullable=False),
    Column("approver", String(120), nullable=False),
    Column("amount_ceiling_cents", BigInteger),
    _now_col("valid_until", nullable=False),
    _now_col("created_at", nullable=False),
    Index(None, "action_id"),
    _check("decision", ApprovalDecision),
)

approval_uses = Table(
    "approval_uses",
    metadata,
    Column("approval_id", String(40), ForeignKey("approvals.id"), primary_key=True),  # single use, by the schema
    Column("action_id", String(40), ForeignKey("actions.id"), nullable=False),
    _now_col("used_at", nullable=False),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("action_id", String(40), ForeignKey("actions.id"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("request", Text, nullable=False),  # JSON: method, url, body digest, idempotency key — never a secret
    _now_col("created_at", nullable=False),
    Column("outcome", String(16)),            # written once
    _now_col("outcome_at"),
    Column("status_code", Integer),
    Column("external_ref", String(500)),
    Column("detail", Text),
    UniqueConstraint("action_id", "seq"),
    CheckConstraint("outcome IS NULL OR outcome IN ('accepted', 'blocked', 'unknown')", name="outcome_valid"),
)

evidence = Table(
    "evidence",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("action_id", String(40), ForeignKey("actions.id")),
    Column("attempt_id", String(40), ForeignKey("attempts.id")),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("source", String(32), nullable=False),   # response | reconcile | read | webhook
    Column("verdict", String(16), nullable=False),
    Column("observed", Text, nullable=False),       # JSON: what was seen, and where
    _now_col("checked_at", nullable=False),
    Index(None, "task_id", "checked_at"),
    _check("verdict", Outcome),
)

refusals = Table(
    "refusals",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("task_id", String(40)),
    Column("run_id", String(40)),
    Column("tool", String(130), nullable=False),
    Column("code", String(40), nullable=False),
    Column("detail", Text, nullable=False),
    _now_col("created_at", nullable=False),
)

run_contexts = Table(
    "run_contexts",
    metadata,
    Column("run_id", String(40), ForeignKey("runs.id"), primary_key=True),
    Column("prefix_sha256", String(64), nullable=False),
    Column("prefix", Text, nullable=False),  # the stable part: system prompt, instructions, tool definitions
    Column("tail", Text, nullable=False),    # JSON: what this wake added (task state, events, time)
    Column("model", String(100), nullable=False),
    Column("harness_version", String(20), nullable=False),
    _now_col("created_at", nullable=False),
)

tool_results = Table(
    "tool_results",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("run_id", String(40), ForeignKey("runs.id"), nullable=False),
    Column("step", Integer, nullable=False),
    Column("call_id", String(100), nullable=False),
    Column("tool", String(130), nullable=False),
    Column("args", Text, nullable=False),
    Column("result", Text, nullable=False),  # JSON; errors as {"error": {"code", "message"}}
    _now_col("created_at", nullable=False),
    UniqueConstraint("run_id", "step", "call_id"),
)

event_attachments = Table(
    "event_attachments",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("event_id", String(40), ForeignKey("events.id"), nullable=False),  # the delivery, in triage
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("attached_event_id", String(40), ForeignKey("events.id"), nullable=False),  # its copy in the task's session
    Column("actor", String(120), nullable=False),
    Column("reason", Text, nullable=False),
    _now_col("created_at", nullable=False),
    UniqueConstraint("event_id", "task_id"),
    Index(None, "task_id"),
)
"""A delivery from triage given to a task as information (`core.attach`): who attached it, and why."""

memories = Table(
    "memories",
    metadata,
    Column("id", String(40), primary_key=True),             # one version of a record
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("lineage_id", String(40), nullable=False),       # the record: its first version's id
    Column("version", Integer, nullable=False),
    Column("supersedes", String(40)),                       # the version this one replaced
    Column("form", String(16), nullable=False),
    Column("state", String(16), nullable=False),
    Column("subject", String(80), nullable=False),          # what it is about ("seat"): contradiction is judged on
    Column("relation", String(80), nullable=False),         # subject and relation only ("prefers")
    Column("value", Text, nullable=False),                  # ("window")
    Column("text", Text, nullable=False),                   # in plain words, as the model and the user read it
    Column("scope", String(16), nullable=False),
    Column("scope_ref", String(200)),                       # the run, task or project it holds for; NULL: always
    Column("speaker", String(16), nullable=False),
    Column("speaker_name", String(120), nullable=False),    # the user's name, the run, or the third party's source
    Column("confidence", Float),                            # a hypothesis's
    Column("review", Boolean, nullable=False, default=False),  # retired by someone other than the user: shown to them
    Column("run_id", String(40)),                           # the run that proposed it
    Column("task_id", String(40), ForeignKey("tasks.id")),  # the task it was learnt in
    Column("confirmed_by", String(120)),                    # what confirmed it (the user's change, an approval)
    _now_col("confirmed_at"),
    # bi-temporal: when it holds in the world, and when the system learnt and retired it
    _now_col("valid_from", nullable=False),
    _now_col("valid_until"),
    _now_col("recorded_at", nullable=False),
    _now_col("retired_at"),
    Column("retire_reason", String(16)),
    Column("retired_by", String(16)),
    UniqueConstraint("lineage_id", "version"),
    Index(None, "user_id", "state", "scope"),
    Index(None, "user_id", "subject", "relation"),
    Index(None, "user_id", "scope", "scope_ref"),  # recall: the records of this task or run
    Index(None, "user_id", "form", "scope"),        # recall: the user's standing instructions
    _check("form", MemoryForm),
    _check("state", MemoryState),
    _check("scope", MemoryScope),
    _check("speaker", Speaker),
    CheckConstraint("retire_reason IS NULL OR retire_reason IN ('superseded', 'contradicted', 'corrected', "
                    "'forgotten', 'expired', 'rejected', 'invalidated')", name="retire_reason_valid"),
    CheckConstraint("retired_by IS NULL OR retired_by IN ('user', 'agent', 'system')", name="retired_by_valid"),
)
"""Knowledge (`server.memory`): what the agent learnt about its user, each version a row. Content never changes
after the insert; a change is a new version that supersedes the old, which is retired, not deleted."""

memory_topics = Table(
    "memory_topics",
    metadata,
    Column("memory_id", String(40), ForeignKey("memories.id"), primary_key=True),
    Column("topic", String(80), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Index(None, "user_id", "topic"),
)
"""What a record is recalled for (its subject and tags: "seat", "flight", an event kind)."""

memory_links = Table(
    "memory_links",
    metadata,
    Column("memory_id", String(40), ForeignKey("memories.id"), primary_key=True),
    Column("ref_type", String(16), primary_key=True),  # event, decision, approval, action, steer, message, run, memory
    Column("ref_id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Index(None, "ref_type", "ref_id"),
)
"""The evidence a record was produced from, by ID; `memory` refs are what it was derived from (lineage)."""

memory_uses = Table(
    "memory_uses",
    metadata,
    Column("run_id", String(40), ForeignKey("runs.id"), primary_key=True),
    Column("memory_id", String(40), ForeignKey("memories.id"), primary_key=True),
    Index(None, "memory_id"),
)
"""Which record versions a run's context recalled: what a correction's propagation reaches."""

memory_disowned = Table(
    "memory_disowned",
    metadata,
    Column("user_id", String(40), ForeignKey("users.id"), primary_key=True),
    Column("ref_type", String(16), primary_key=True),
    Column("ref_id", String(40), primary_key=True),
    Column("memory_id", String(40), ForeignKey("memories.id"), nullable=False),  # the record the user corrected
    Column("reason", Text, nullable=False),
    _now_col("created_at", nullable=False),
)
"""Evidence the user said shows no preference ("those times had no alternatives"): never again evidence for one."""

memory_changes = Table(
    "memory_changes",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("memory_id", String(40), ForeignKey("memories.id")),  # NULL for a refused proposal
    Column("change", String(16), nullable=False),
    Column("actor", String(16), nullable=False),                 # user, agent, system
    Column("run_id", String(40)),
    Column("task_id", String(40)),
    Column("code", String(40)),                                  # a refusal's stable code
    Column("detail", Text, nullable=False, default="{}"),        # JSON: the proposal, the reason, what it reached
    _now_col("at", nullable=False),
    Index(None, "user_id", "at"),
    Index(None, "memory_id"),
    Index(None, "task_id"),
    CheckConstraint("change IN ('committed', 'refused', 'confirmed', 'rejected', 'edited', 'corrected', "
                    "'forgotten', 'retired', 'invalidated', 'expired', 'reviewed')", name="change_valid"),
    CheckConstraint("actor IN ('user', 'agent', 'system')", name="actor_valid"),
)
"""Every change to memory, refused proposals included: the memory part of the ledger."""


class GrantPurpose(StrEnum):
    READ = "read"            # a read tool the agent called
    WRITE = "write"          # one attempt of an admitted action
    RECONCILE = "reconcile"  # asking the remote whether an attempt with an unknown outcome landed
    VERIFY = "verify"        # re-reading the world after an accepted effect


egress_grants = Table(
    "egress_grants",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("token_sha256", String(64), nullable=False, unique=True),  # the token itself is never stored
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("task_id", String(40), ForeignKey("tasks.id"), nullable=False),
    Column("purpose", String(16), nullable=False),
    Column("action_id", String(40), ForeignKey("actions.id")),
    Column("attempt_id", String(40), ForeignKey("attempts.id")),
    Column("tool", String(130), nullable=False),
    Column("method", String(16), nullable=False),
    Column("scheme", String(8), nullable=False),
    Column("host", String(255), nullable=False),
    Column("port", Integer, nullable=False),
    Column("path", Text, nullable=False),
    Column("query", Text, nullable=False),
    Column("body_sha256", String(64), nullable=False),
    Column("credential", String(64)),
    _now_col("created_at", nullable=False),
    _now_col("expires_at", nullable=False),
    _check("purpose", GrantPurpose),
    CheckConstraint("purpose <> 'write' OR (action_id IS NOT NULL AND attempt_id IS NOT NULL)",
                    name="write_names_attempt"),
)
"""One row per connector request the server is about to send: the proxy forwards it only if it matches, once."""

egress_grant_uses = Table(
    "egress_grant_uses",
    metadata,
    Column("grant_id", String(40), ForeignKey("egress_grants.id"), primary_key=True),  # single use, by the schema
    Column("request_id", String(128), nullable=False),
    _now_col("used_at", nullable=False),
)
"""The one request the proxy let through under a grant's token."""

egress_clients = Table(
    "egress_clients",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("label", String(100), nullable=False),
    Column("token_sha256", String(64), nullable=False, unique=True),
    _now_col("created_at", nullable=False),
    _now_col("revoked_at"),
)
"""Proxy credentials of a user's tool computers (Proxy-Authorization); only digests are stored."""

egress_audit = Table(
    "egress_audit",
    metadata,
    Column("request_id", String(128), primary_key=True),
    _now_col("at", nullable=False),
    Column("user_id", String(40)),
    Column("client", String(16), nullable=False),
    Column("grant_id", String(128)),
    Column("action_id", String(128)),
    Column("method", String(16), nullable=False),
    Column("scheme", String(8), nullable=False),
    Column("host", String(255), nullable=False),
    Column("port", Integer, nullable=False),
    Column("path", Text, nullable=False),
    Column("verdict", String(8), nullable=False),
    Column("code", String(40)),
    Column("rule", Text, nullable=False),
    Column("credential", String(64)),
    Column("bytes_up", BigInteger, nullable=False),
    Column("bytes_down", BigInteger, nullable=False),
    Column("upstream_status", Integer),
    Column("latency_ms", Float, nullable=False),
    _now_col("recorded_at", nullable=False),
    Index(None, "user_id", "at"),
    Index(None, "at"),
    CheckConstraint("verdict IN ('allow', 'refuse')", name="verdict_valid"),
)
"""One row per request the egress proxy saw, allowed or refused. Never headers, bodies, queries or secrets."""

console_sessions = Table(
    "console_sessions",
    metadata,
    Column("id_digest", String(64), primary_key=True),  # SHA-256 of the cookie's session ID; the ID is never stored
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("csrf_token", String(64), nullable=False),  # every form of the session carries it; every POST is checked
    _now_col("created_at", nullable=False),
    _now_col("expires_at", nullable=False),
    Index(None, "user_id"),
    Index(None, "expires_at"),  # the sweeper deletes expired sessions
)
"""The console's signed-in browsers (`server.faces.console.signin`): a row per sign-in, deleted at sign-out."""

approval_links = Table(
    "approval_links",
    metadata,
    Column("token_digest", String(64), primary_key=True),  # SHA-256 of the link's token; the token is never stored
    Column("user_id", String(40), ForeignKey("users.id"), nullable=False),
    Column("action_id", String(40), ForeignKey("actions.id"), nullable=False),
    Column("content_hash", String(64), nullable=False),  # the action's, when the link was made: a changed one refuses
    _now_col("created_at", nullable=False),
    _now_col("expires_at", nullable=False),
    _now_col("used_at"),  # set once, when the signed-in user opened it: the link is good once
    Index(None, "action_id"),
    Index(None, "expires_at"),  # the sweeper deletes links long expired
)
"""One-time links in approval requests that open the action's card in the console (`server.faces.console.links`)."""

APPEND_ONLY = ("control", "task_versions", "decisions", "objects", "actions", "verdicts", "approvals",
               "approval_uses", "evidence", "refusals", "run_contexts", "tool_results", "egress_grants",
               "egress_grant_uses", "egress_audit", "event_attachments", "memory_links", "memory_uses",
               "memory_disowned", "memory_changes")
"""History tables: the schema refuses UPDATE and DELETE on them."""


ledger_chain = Table(
    "ledger_chain",
    metadata,
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("tbl", String(40), nullable=False),
    Column("row_key", String(400), nullable=False),  # the row's primary key, columns joined by CHAIN_KEY_SEPARATOR
    Column("part", String(16), nullable=False),      # `row`; an attempt's written outcome is a second entry
    Column("pos", BigInteger),                        # its place in the chain, given when sealed (`server.audit`)
    Column("row_hash", String(64)),
    Column("chain_hash", String(64)),
    Index(None, "pos", unique=True),
    CheckConstraint("part IN ('row', 'outcome')", name="part_valid"),
)
"""Every row of a chained table, in insertion order (filled by triggers on insert): the sealer hashes each, in `seq`
order, into one chain (`server.audit.seal`). Sealed entries never change."""

ledger_checkpoints = Table(
    "ledger_checkpoints",
    metadata,
    Column("pos", BigInteger, primary_key=True, autoincrement=False),  # the last entry it covers
    Column("chain_hash", String(64), nullable=False),
    _now_col("signed_at", nullable=False),
    Column("key_id", String(32), nullable=False),      # which Ed25519 key signed it (`server.audit.signing`)
    Column("signature", String(128), nullable=False),  # hex
)
"""Signed checkpoints of the ledger chain: the chain hash at `pos`, signed with the deployment's ledger key."""

CHAINED = (*APPEND_ONLY, "attempts")
"""Every table whose rows are chained into the verifiable ledger (`server.audit`): the history tables and attempts
(whose outcome, written once, is chained as a second entry)."""

CHAIN_KEY_SEPARATOR = "\x1f"


def _chain_key_sql(table: str, dialect: str) -> str:
    """The row's key as the triggers write it: its primary key's columns joined by CHAIN_KEY_SEPARATOR."""
    separator = "char(31)" if dialect == "sqlite" else "chr(31)"
    return f" || {separator} || ".join(f"NEW.{column.name}" for column in metadata.tables[table].primary_key)


def chain_ddl(table: str, dialect: str) -> list[str]:
    """Triggers that give every row inserted into `table` an entry in `ledger_chain` (and an attempt's outcome,
    when written, a second one), for SQLite or PostgreSQL."""
    key = _chain_key_sql(table, dialect)
    entry = f"INSERT INTO ledger_chain (tbl, row_key, part) VALUES ('{table}', {key}, "
    if dialect == "sqlite":
        statements = [f"CREATE TRIGGER {table}_chain AFTER INSERT ON {table} BEGIN {entry}'row'); END"]
        if table == "attempts":
            statements += [
                f"CREATE TRIGGER {table}_chain_outcome AFTER INSERT ON {table} WHEN NEW.outcome IS NOT NULL "
                f"BEGIN {entry}'outcome'); END",
                f"CREATE TRIGGER {table}_chain_outcome_set AFTER UPDATE OF outcome ON {table} "
                f"WHEN OLD.outcome IS NULL AND NEW.outcome IS NOT NULL BEGIN {entry}'outcome'); END",
            ]
        return statements
    function = f"wakeful_chain_{table}"
    if table != "attempts":
        body = f"{entry}'row'); RETURN NULL;"
    else:
        body = (f"IF TG_OP = 'INSERT' THEN {entry}'row'); END IF; "
                f"IF NEW.outcome IS NOT NULL AND (TG_OP = 'INSERT' OR OLD.outcome IS NULL) THEN {entry}'outcome'); "
                "END IF; RETURN NULL;")
    return [
        f"CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN {body} END $$",
        f"CREATE TRIGGER {table}_chain AFTER INSERT{' OR UPDATE' if table == 'attempts' else ''} ON {table} "
        f"FOR EACH ROW EXECUTE FUNCTION {function}()",
    ]


def chain_guard_ddl(dialect: str) -> list[str]:
    """A chain entry is sealed once (pos, row_hash, chain_hash) and never changes again; none is deleted. (The
    checkpoints get the append-only triggers.)"""
    if dialect == "sqlite":
        return [
            "CREATE TRIGGER ledger_chain_sealed_once BEFORE UPDATE ON ledger_chain WHEN OLD.pos IS NOT NULL "
            "OR NEW.seq IS NOT OLD.seq OR NEW.tbl IS NOT OLD.tbl OR NEW.row_key IS NOT OLD.row_key "
            "OR NEW.part IS NOT OLD.part BEGIN SELECT RAISE(ABORT, 'ledger_chain entries are sealed once'); END",
            "CREATE TRIGGER ledger_chain_no_delete BEFORE DELETE ON ledger_chain "
            "BEGIN SELECT RAISE(ABORT, 'ledger_chain entries are sealed once'); END",
        ]
    return [
        "CREATE OR REPLACE FUNCTION wakeful_chain_sealed_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF TG_OP = 'DELETE' OR OLD.pos IS NOT NULL OR NEW.seq IS DISTINCT FROM OLD.seq "
        "OR NEW.tbl IS DISTINCT FROM OLD.tbl OR NEW.row_key IS DISTINCT FROM OLD.row_key "
        "OR NEW.part IS DISTINCT FROM OLD.part "
        "THEN RAISE EXCEPTION 'ledger_chain entries are sealed once'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER ledger_chain_sealed_once BEFORE UPDATE OR DELETE ON ledger_chain "
        "FOR EACH ROW EXECUTE FUNCTION wakeful_chain_sealed_once()",
    ]


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


def attempts_guard_ddl(dialect: str) -> list[str]:
    """An attempt's request never changes, its outcome is written once, and attempts are never deleted."""
    if dialect == "sqlite":
        return [
            "CREATE TRIGGER attempts_outcome_once BEFORE UPDATE ON attempts WHEN OLD.outcome IS NOT NULL "
            "OR NEW.request IS NOT OLD.request OR NEW.action_id IS NOT OLD.action_id OR NEW.seq IS NOT OLD.seq "
            "OR NEW.created_at IS NOT OLD.created_at BEGIN SELECT RAISE(ABORT, 'attempts are write-once'); END",
            "CREATE TRIGGER attempts_no_delete BEFORE DELETE ON attempts "
            "BEGIN SELECT RAISE(ABORT, 'attempts are write-once'); END",
        ]
    return [
        "CREATE OR REPLACE FUNCTION wakeful_attempt_once() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF TG_OP = 'DELETE' OR OLD.outcome IS NOT NULL OR NEW.request IS DISTINCT FROM OLD.request "
        "OR NEW.action_id IS DISTINCT FROM OLD.action_id OR NEW.seq IS DISTINCT FROM OLD.seq "
        "THEN RAISE EXCEPTION 'attempts are write-once'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER attempts_outcome_once BEFORE UPDATE OR DELETE ON attempts "
        "FOR EACH ROW EXECUTE FUNCTION wakeful_attempt_once()",
    ]


MEMORY_MUTABLE = ("state", "review", "retired_at", "retire_reason", "retired_by")
"""What may change on a `memories` row after its insert: its state and retirement, and the review flag."""


def memory_guard_ddl(dialect: str) -> list[str]:
    """A memory version's content never changes (a change is a new version) and no version is ever deleted."""
    fixed = [c.name for c in memories.columns if c.name not in MEMORY_MUTABLE]
    if dialect == "sqlite":
        changed = " OR ".join(f"NEW.{c} IS NOT OLD.{c}" for c in fixed)
        return [
            f"CREATE TRIGGER memories_content_fixed BEFORE UPDATE ON memories WHEN {changed} "
            "BEGIN SELECT RAISE(ABORT, 'memory content is written once'); END",
            "CREATE TRIGGER memories_no_delete BEFORE DELETE ON memories "
            "BEGIN SELECT RAISE(ABORT, 'memory versions are never deleted'); END",
        ]
    changed = " OR ".join(f"NEW.{c} IS DISTINCT FROM OLD.{c}" for c in fixed)
    return [
        "CREATE OR REPLACE FUNCTION wakeful_memory_fixed() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        f"IF TG_OP = 'DELETE' OR {changed} "
        "THEN RAISE EXCEPTION 'memory content is written once; versions are never deleted'; END IF; "
        "RETURN NEW; END $$",
        "CREATE TRIGGER memories_content_fixed BEFORE UPDATE OR DELETE ON memories "
        "FOR EACH ROW EXECUTE FUNCTION wakeful_memory_fixed()",
    ]


for _dialect in ("sqlite", "postgresql"):
    for _stmt in memory_guard_ddl(_dialect):
        event.listen(metadata.tables["memories"], "after_create",
                     DDL(_stmt).execute_if(dialect=_dialect))  # type: ignore[no-untyped-call]

for _dialect in ("sqlite", "postgresql"):
    for _stmt in attempts_guard_ddl(_dialect):
        event.listen(metadata.tables["attempts"], "after_create",
                     DDL(_stmt).execute_if(dialect=_dialect))  # type: ignore[no-untyped-call]

for _name in APPEND_ONLY:
    for _dialect in ("sqlite", "postgresql"):
        for _stmt in append_only_ddl(_name, _dialect):
            event.listen(metadata.tables[_name], "after_create",
                         DDL(_stmt).execute_if(dialect=_dialect))  # type: ignore[no-untyped-call]

for _dialect in ("sqlite", "postgresql"):
    for _stmt in chain_guard_ddl(_dialect):
        event.listen(ledger_chain, "after_create", DDL(_stmt).execute_if(dialect=_dialect))  # type: ignore[no-untyped-call]
    for _stmt in append_only_ddl("ledger_checkpoints", _dialect):
        event.listen(ledger_checkpoints, "after_create",
                     DDL(_stmt).execute_if(dialect=_dialect))  # type: ignore[no-untyped-call]
    for _name in CHAINED:
        for _stmt in chain_ddl(_name, _dialect):
            event.listen(metadata.tables[_name], "after_create",
                         DDL(_stmt).execute_if(dialect=_dialect))  # type: ignore[no-untyped-call]
