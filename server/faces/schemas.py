"""The shapes the HTTP API answers with, for its OpenAPI document (`server.faces.openapi`) and for FastAPI, which
checks every answer against its route's `response_model` on the way out: an answer that drifted from its
documented shape is a loud 500 the fuzzer finds (tests/integration/test_fuzz_http.py), never a silent lie.

Response models forbid keys they do not name, for the same reason. `refusals(...)` declares which error codes a
route answers; `CODES` says each code's status, the one table docs/http-api.md's error table is held to.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from wakeful.server.acting.ledger import EntryType
from wakeful.server.store.tables import (
    EventStatus,
    MemoryForm,
    MemoryScope,
    MemoryState,
    OutboxState,
    Speaker,
    SteerState,
    TaskState,
)

__all__ = [
    "CODES", "ActionView", "ApprovalCard", "Decision", "Done", "EgressPage", "ErrorEnvelope", "EventView", "Health",
    "HookReceipt",
    "Ledger", "MemoryChanged", "MemoryDetail", "MemoryPage", "MemoryRecord", "MessagePage", "PreferencesView",
    "MessageRecorded", "Ready", "SlackChallenge", "SteerDecision", "StopAnswer", "StopRecorded", "TaskCreated",
    "TaskStateAnswer", "TaskStatus", "TaskVersionAnswer", "ViewLink", "refusals",
]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors ----------------------------------------------------------------------------------------------------------


class ErrorBody(BaseModel):
    """What went wrong: a stable `code` to branch on, a `message` to show, and fields that name what it was about
    (`task_id`, `source`, `details` for each invalid field, ...)."""

    model_config = ConfigDict(extra="allow")
    code: str
    message: str


class ErrorEnvelope(_Answer):
    """Every error the API answers, whatever its status."""

    error: ErrorBody


CODES: dict[str, int] = {
    "malformed_body": 400, "invalid_parameter": 400, "invalid_completion": 400, "bad_cursor": 400,
    "json_too_deep": 400, "number_too_long": 400, "number_out_of_range": 400, "duplicate_key": 400,
    "missing_delivery_id": 400, "invalid_delivery_id": 400, "invalid_session_key": 400, "invalid_task_key": 400,
    "unknown_timezone": 400, "invalid_quiet_hours": 400, "invalid_memory": 400, "invalid_scope": 400,
    "malformed_form": 400,
    "missing_token": 401, "signed_out": 401, "bad_token": 401, "signature_missing": 401, "signature_malformed": 401,
    "signature_mismatch": 401, "signature_expired": 401,
    "forbidden": 403, "user_credential_required": 403, "third_party_directive": 403, "bad_csrf_token": 403,
    "admin_required": 403,
    "not_found": 404, "unknown_task": 404, "unknown_event": 404, "unknown_action": 404, "unknown_steer": 404,
    "unknown_operation": 404, "unknown_source": 404, "unknown_tool": 404, "unknown_memory": 404, "unknown_link": 404,
    "unknown_run": 404, "no_tool_computer": 404,
    "method_not_allowed": 405,
    "invalid_transition": 409, "not_awaiting_approval": 409, "not_awaiting_user": 409, "task_key_taken": 409,
    "link_used": 409, "link_expired": 409, "action_changed": 409,
    "gone": 410,
    "payload_too_large": 413,
    "misdirected_request": 421,
    "not_ready": 503,
}
"""Every error code the API answers, and its status (a code always comes with the same one)."""

ERROR_CODES_KEY = "x-error-codes"
"""Where a documented error response lists its codes (an OpenAPI extension); the document's builder turns the list
into the schema of the response's `error.code`."""


def refusals(*codes: str) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a route that answers these error codes (besides those every route of its kind answers:
    the token and body checks, which the document's builder adds)."""
    by_status: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        by_status.setdefault(CODES[code], {ERROR_CODES_KEY: []})[ERROR_CODES_KEY].append(code)
    return by_status


# -- the control channel ---------------------------------------------------------------------------------------------


class StopAnswer(_Answer):
    stopped: bool
    """Whether nothing goes out for this user (their own STOP, or one over everything)."""
    global_stop: bool
    """Whether the operator's STOP over everything is in force."""


class StopRecorded(StopAnswer):
    record_id: str
    note: str | None = None
    """Only when a START could not lift a STOP over everything: what to do about it."""


class TaskCreated(_Answer):
    task_id: str
    session_id: str
    version: int


class TaskVersionAnswer(_Answer):
    task_id: str
    version: int


class TaskStateAnswer(_Answer):
    task_id: str
    state: TaskState


class MessageRecorded(_Answer):
    """The user's message about a task, recorded as an event; `state` is the task's afterwards: `held` until a run
    reads the message (or `paused`, when it already was)."""

    task_id: str
    event_id: str
    state: TaskState


class Hold(_Answer):
    """The hold the user's latest message put on the task: nothing new goes out until a run has read it."""

    hold_id: str
    event_id: str
    held_by: str
    since: str


class Facts(_Answer):
    """The four facts of a task, each with its own time (ISO 8601); null: not yet."""

    request_received: str
    run_ended: str | None
    goal_verified: str | None
    receipt_delivered: str | None


class PendingWait(_Answer):
    wait_id: str
    kind: str
    match_key: str
    authority: str
    """Who may satisfy it: `user`, `system`, `any_source` or `source:<name>` (one webhook source)."""
    deadline: str | None
    on_timeout: Literal["follow_up", "tell_user", "close"] | None
    """A reply wait the agent set: what its deadline does (null: the server's own wait; its deadline wakes the
    task)."""
    note: str | None
    said: str | None
    """A reply wait the agent set, in plain words, in the user's time zone."""


class OpenTimer(_Answer):
    """A follow-up or a recurring check set for the task."""

    timer_id: str
    kind: Literal["followup", "schedule"]
    note: str
    next_at: str
    """When it fires next (ISO 8601, UTC)."""
    said: str
    """In plain words, in the user's time zone: "checks prices every day at 09:00 Asia/Hong_Kong; next …"."""


class ActionSummary(_Answer):
    action_id: str
    tool: str
    version: int
    content_hash: str
    verdict: str | None
    code: str | None
    outcome: str | None


class ProposedSteer(_Answer):
    """A steer the agent proposed because it would widen the task: it waits for the user's confirm or reject."""

    steer_id: str
    state: SteerState
    against_version: int
    widens: list[str]
    """Each widening, in plain words."""


class TaskKey(_Answer):
    """A correlation key of the task: a delivery carrying it wakes the task while the key is bound."""

    key: str
    bound_by: str
    """`user:<id>` (given at delegation) or the agent (`agent:<id> via mcp`, `agent:<id>/<name> via mcp` with the
    agent credential `<name>`, `agent:<id> run <run>`)."""
    reason: str
    bound_at: str
    released_at: str | None
    """When the task was closed or revoked; a released key routes like an unknown one (to triage)."""


class TaskStatus(_Answer):
    task_id: str
    session_id: str
    title: str
    state: TaskState
    version: int
    facts: Facts
    timers: list[OpenTimer]
    waits: list[PendingWait]
    actions: list[ActionSummary]
    proposed_steers: list[ProposedSteer]
    hold: Hold | None = None
    """Set while the task is `held`."""
    keys: list[TaskKey]


class SteerDecision(_Answer):
    steer_id: str
    task_id: str
    state: SteerState
    version: int
    """The task's version afterwards: the new one when confirmed, the one it was proposed against when rejected."""


class LedgerEntry(BaseModel):
    """One record of the task's history: when, what kind, and the record's own columns (those that are set)."""

    model_config = ConfigDict(extra="allow")
    at: str
    type: EntryType


class Ledger(_Answer):
    task_id: str
    entries: list[LedgerEntry]


class Budget(_Answer):
    spent_task_cents: int
    task_total_cents: int | None


class ApprovalCard(_Answer):
    """What the user reads before approving, rendered from the action's immutable content and recorded facts."""

    action_id: str
    content_hash: str
    tool: str
    lines: list[str]
    approve_with: str
    deny_with: str
    valid_for_seconds: int
    budget: Budget


class ActionView(_Answer):
    action_id: str
    tool: str
    content_hash: str
    content: dict[str, Any]
    card: ApprovalCard


class Decision(_Answer):
    action_id: str
    approval_id: str
    verdict: str
    """The action's admission after the decision: `admitted`, `needs_approval` or `refused`."""
    code: str
    reason: str


class EventView(_Answer):
    event_id: str
    source: str
    source_id: str
    session_id: str
    status: EventStatus
    attempts: int
    run_id: str | None
    received_at: str


class Message(_Answer):
    id: str
    seq: int | None = Field(description="the message's place in the user's feed (`after=`); null while held and "
                                        "once batched into a summary, which has its own")
    state: OutboxState
    created_at: str
    body: dict[str, Any] = Field(description="`text`, `level` (notify, suggest, ask, act), `urgent` (reason, "
                                             "deadline) when so marked; a summary adds `items`, each held message")
    gate: str | None = Field(description="why the speaking gate held this message, or let it break through")
    held_until: str | None = Field(description="when a held message goes out in its summary")
    summary_id: str | None = Field(description="the summary a batched message went out in")


class MessagePage(_Answer):
    messages: list[Message]
    next: str | None = Field(description="the cursor of the following page; null on the last (newest first only)")
    after: int | None = Field(default=None, description="with `after=`: the `after` of the next poll (the last "
                                                        "`seq` on this page, or the one sent when it is empty)")


class QuietHoursView(_Answer):
    start: str = Field(description="local time, HH:MM")
    end: str = Field(description="local time, HH:MM; before `start`: the quiet hours cross midnight")


class PreferencesView(_Answer):
    """How the user wants to be spoken to; only the user sets it, on this channel (never the agent, nor MCP)."""

    timezone: str
    quiet_hours: QuietHoursView | None
    attention_budget: int | None = Field(description="messages per local day; null: no budget")


class EgressRequest(_Answer):
    """One request the egress proxy saw: never its headers, body or query."""

    request_id: str
    at: str
    user_id: str | None
    client: Literal["connector", "tool_computer"]
    grant_id: str | None
    action_id: str | None
    method: str
    scheme: str
    host: str
    port: int
    path: str
    verdict: Literal["allow", "refuse"]
    code: str | None
    rule: str
    credential: str | None
    """The name of the credential binding the proxy added, never its value."""
    bytes_up: int
    bytes_down: int
    upstream_status: int | None
    latency_ms: float
    recorded_at: str


class TaskSummary(_Answer):
    task_id: str
    title: str
    state: TaskState
    version: int
    created_at: str


class TaskPage(_Answer):
    tasks: list[TaskSummary]
    next: str | None = Field(description="the cursor of the following page; null on the last")


class EgressPage(_Answer):
    requests: list[EgressRequest]
    next: str | None = Field(description="the cursor of the following page; null on the last")


class ViewLink(_Answer):
    link: str
    view_only: bool
    expires_at: str


class Health(_Answer):
    status: Literal["ok"]


class Ready(_Answer):
    """`GET /readyz` when everything it checks answers; each check is `ok` (a `503 not_ready` names what failed)."""

    status: Literal["ready"]
    checks: dict[str, str] = Field(description="database, proxy (when on), libvirt (when tool computers are on), "
                                               "draining: `ok` each")


class Done(_Answer):
    ok: Literal[True]


# -- memory ----------------------------------------------------------------------------------------------------------


class MemoryRecord(_Answer):
    """One version of a memory record (`server.memory`): what it says, who said it, where and when it holds, and
    when the system learnt and retired it. Times are ISO 8601; null: not set (not confirmed, not retired, no end)."""

    memory_id: str
    """This version's ID: what the routes below take."""
    lineage_id: str
    """The record's: its first version's ID, the same in every version."""
    version: int
    supersedes: str | None
    form: MemoryForm
    state: MemoryState
    subject: str
    relation: str
    value: str
    text: str
    scope: MemoryScope
    scope_ref: str | None
    """The run, task or project it holds for; null for `always`."""
    speaker: Speaker
    speaker_name: str
    """The user's name, the run that inferred it, or the third party that said it."""
    confidence: float | None
    review: bool
    """Retired by someone other than you: shown to you until you mark it reviewed."""
    run_id: str | None
    task_id: str | None
    confirmed_by: str | None
    confirmed_at: str | None
    valid_from: str
    valid_until: str | None
    recorded_at: str
    retired_at: str | None
    retire_reason: str | None
    retired_by: str | None
    topics: list[str]
    """What it is recalled for: its subject and its tags."""


class MemoryPage(_Answer):
    records: list[MemoryRecord]
    next: str | None = Field(description="the `after` of the following page; null on the last")


class MemoryRef(_Answer):
    type: str
    """event, decision, approval, action, steer, message, run or memory (what it was derived from)."""
    id: str


class MemoryChange(_Answer):
    """One change to the record, as the ledger shows it."""

    change_id: str
    memory_id: str | None
    change: str
    actor: Literal["user", "agent", "system"]
    run_id: str | None
    task_id: str | None
    code: str | None
    detail: dict[str, Any]
    at: str


class MemoryDetail(_Answer):
    """A record with its whole lineage: every version, the evidence it was produced from, what was derived from it,
    the runs that recalled it, and every change."""

    record: MemoryRecord
    """Its latest version (whichever version's ID was asked for)."""
    versions: list[MemoryRecord]
    """Every version of the record, oldest first."""
    evidence: list[MemoryRef]
    derived: list[str]
    """The IDs of the records derived from this one (a correction or a deletion invalidates them)."""
    recalled_by: list[str]
    """The runs whose context recalled a version of it."""
    changes: list[MemoryChange]


class MemoryReach(_Answer):
    """What a correction or a deletion reached."""

    invalidated: list[str]
    """The records derived from it, retired `invalidated` and shown to you for review."""
    runs: list[str]
    """The runs that had recalled it (their history is not rewritten)."""
    tasks: list[str]
    """The open tasks whose next wake is told which recalled record was corrected."""


class MemoryChanged(_Answer):
    """The record after the change: the version the change wrote (or retired) and its state."""

    memory_id: str
    version: int
    state: MemoryState
    form: MemoryForm
    retired: list[str] | None = None
    """The versions this one retired as `contradicted` (same subject, relation and scope; another value)."""
    reach: MemoryReach | None = None
    """A correction or a deletion: what it reached."""


# -- the webhook inbox -----------------------------------------------------------------------------------------------


class HookReceipt(_Answer):
    """The delivery is durable: recorded now, or before (`duplicate`, by the provider's delivery ID)."""

    event_id: str
    duplicate: bool
    status: EventStatus


class SlackChallenge(_Answer):
    """Slack's URL verification, answered with the challenge it sent (and nothing recorded)."""

    challenge: Any
