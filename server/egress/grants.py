"""Egress: the server's half of the egress proxy.

- Grants: before the server sends a connector request (a read tool, an action's attempt, a reconcile or verify
  query) it persists a grant naming exactly that request, and sends a one-time token with it. Only a digest of the
  token is stored.
- Decisions: the proxy asks, per request, over the decider channel; `decide` answers from the records. A connector
  request is allowed only if its grant exists, has not expired, may still leave (`leave_check`: STOP, pause,
  revoke, an attempt that already has an outcome, task version, stale objects) and matches the request byte for
  byte (method, scheme, host, port, path, query, body digest). Tool-computer traffic is matched against the egress
  allowlist (`policies/egress.toml`), deny by default, after the tool computer's proxy credential is checked.
- Tool-computer credentials: one live credential per user and label. Issuing one for a label revokes the label's
  earlier one in the same transaction; `revoke_label` revokes without issuing. The decider reads the records at
  every request, so a revoked credential is refused from the next request on, and its verdict names the label.
- Audit: one append-only row per request the proxy saw, queryable by user.
"""

from __future__ import annotations

import hashlib
import secrets
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import Connection, Row, Select, and_, bindparam, insert, or_, select, update

from wakeful.proxy.contract import Allow, DecisionRequest, EgressRequest, RefusalCode, Verdict, clip, refuse
from wakeful.proxy.decide import AllowRule, decide_by_allowlist
from wakeful.server.acting.actions import load_action
from wakeful.server.acting.leave import Leave, LeaveFacts, leave_check
from wakeful.server.acting.verdicts import leave_facts
from wakeful.server.core import control
from wakeful.server.errors import BadRequest, NotFound
from wakeful.server.store.db import upsert
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import (
    ControlKind,
    GrantPurpose,
    TaskState,
    attempts,
    egress_audit,
    egress_clients,
    egress_grant_uses,
    egress_grants,
    tasks,
    users,
)
from wakeful.server.store.tables import control as control_records
from wakeful.server.store.toml_lines import TomlLines

if TYPE_CHECKING:
    from wakeful.proxy.audit import EgressRecord

__all__ = [
    "ClientState",
    "EgressRules",
    "audit_rows",
    "client_digest",
    "client_state",
    "client_state_statement",
    "decide",
    "issue_client_token",
    "issue_grant",
    "load_egress_rules",
    "revoke_client",
    "revoke_label",
    "store_audit",
    "tool_computer_verdict",
]


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# -- grants ------------------------------------------------------------------------------------------------------


def issue_grant(conn: Connection, *, user_id: str, task_id: str, purpose: GrantPurpose, tool: str,
                request: EgressRequest, credential: str | None, now: datetime, ttl: timedelta,
                action_id: str | None = None, attempt_id: str | None = None) -> str:
    """Persist a grant for exactly `request` and return its token (send it in `X-Wakeful-Attempt`; never store it).
    The grant keeps the request's parts, its body by digest; headers are not part of a grant."""
    token = secrets.token_urlsafe(32)
    conn.execute(insert(egress_grants).values(
        id=new_id("egr"), token_sha256=_digest(token), user_id=user_id, task_id=task_id, purpose=purpose.value,
        action_id=action_id, attempt_id=attempt_id, tool=tool, method=request.method, scheme=request.scheme,
        host=request.host, port=request.port, path=request.path, query=request.query,
        body_sha256=request.body_sha256, credential=credential, created_at=now, expires_at=now + ttl))
    return token


def _granted(grant: Any) -> EgressRequest:
    """The request a grant row names."""
    return EgressRequest(method=grant.method, scheme=grant.scheme, host=grant.host, port=grant.port,
                         path=grant.path, query=grant.query, body_sha256=grant.body_sha256)


def _not_admitted(reason: str) -> Verdict:
    return refuse(RefusalCode.NOT_ADMITTED, reason)


def _leave_facts(conn: Connection, grant: Any, now: datetime) -> LeaveFacts:
    """What `leave_check` needs about the granted request now. Reconcile and verify only read what already
    happened: they go on through a pause, a revoke or a STOP, because an unknown outcome must still be settled."""
    task = conn.execute(select(tasks.c.state, tasks.c.current_version).where(tasks.c.id == grant.task_id)).one()
    if grant.purpose == GrantPurpose.WRITE.value:
        outcome = conn.execute(select(attempts.c.outcome).where(attempts.c.id == grant.attempt_id)).scalar_one()
        return leave_facts(conn, load_action(conn, grant.action_id), task=task, now=now,
                           attempt=(grant.attempt_id, outcome))
    return LeaveFacts(stopped=control.stop_state(conn).blocks(grant.user_id), task_state=TaskState(task.state),
                      current_version=task.current_version, settling=grant.purpose != GrantPurpose.READ.value)


def _decide_connector(conn: Connection, req: DecisionRequest, now: datetime) -> Verdict:
    if not req.attempt_token:
        return _not_admitted("a connector request carries the attempt token the server issued for it")
    grant = conn.execute(select(egress_grants).where(
        egress_grants.c.token_sha256 == _digest(req.attempt_token))).one_or_none()
    if grant is None:
        return _not_admitted("no request was granted under this attempt token")
    if now >= grant.expires_at:
        return _not_admitted(f"the grant for this {grant.tool} request expired at {grant.expires_at.isoformat()}")
    leaving = leave_check(_leave_facts(conn, grant, now))
    if leaving.kind is not Leave.GO:
        return _not_admitted(leaving.detail)
    part = _granted(grant).differs(req.request)
    if part is not None:
        return refuse(RefusalCode.CONTENT_MISMATCH, f"the request's {part} differs from what was granted for "
                                                    f"{grant.tool}")
    used = conn.execute(upsert(conn, egress_grant_uses).values(grant_id=grant.id, request_id=req.request_id,
                                                               used_at=now).on_conflict_do_nothing())
    if used.rowcount != 1:
        return _not_admitted(f"this attempt token already let its {grant.tool} request through; a token is used once")
    what = f"{grant.purpose} {grant.tool}" + (f" (action {grant.action_id})" if grant.action_id else "")
    return Allow(credential=grant.credential, rule=what, attempt_id=grant.id, action_id=grant.action_id)


# -- tool computers ----------------------------------------------------------------------------------------------


class _RuleFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=100)
    host: str
    ports: list[int] = Field(default_factory=lambda: [443], min_length=1)
    methods: list[str] = Field(default_factory=lambda: ["GET", "HEAD"], min_length=1)
    path_prefix: str = "/"
    credential: str | None = None
    users: list[str] | None = None
    """User names this rule is for; every user when absent."""


class _EgressFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    allow: list[_RuleFile] = Field(default_factory=list)


@dataclass(frozen=True)
class EgressRules:
    """The egress allowlist for tool-computer traffic; rules without `users` apply to everyone."""

    rules: tuple[tuple[AllowRule, frozenset[str] | None], ...] = ()

    def for_user(self, user_name: str) -> list[AllowRule]:
        return [rule for rule, names in self.rules if names is None or user_name in names]


def load_egress_rules(path: Path) -> EgressRules:
    """The allowlist in `path` (none when the file does not exist: everything is refused). Errors name the file,
    the line and the field."""
    if not path.exists():
        return EgressRules()
    text = path.read_text()
    try:
        parsed = _EgressFile.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise BadRequest("invalid_egress_policy", f"{path}: {exc}", file=str(path)) from None
    except ValidationError as exc:
        lines = TomlLines(text)
        problems = "; ".join(
            f"line {lines.line_of(tuple(e['loc']))}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
            for e in exc.errors())
        raise BadRequest("invalid_egress_policy", f"{path}: {problems}", file=str(path)) from None
    built: list[tuple[AllowRule, frozenset[str] | None]] = []
    for i, rule in enumerate(parsed.allow):
        try:
            allow = AllowRule(name=rule.name, host=rule.host.lower(), ports=frozenset(rule.ports),
                              methods=frozenset(m.upper() for m in rule.methods), path_prefix=rule.path_prefix,
                              credential=rule.credential)
        except ValueError as exc:
            line = TomlLines(text).line_of(("allow", i))
            raise BadRequest("invalid_egress_policy", f"{path}: line {line}: allow[{i}] ({rule.name}): {exc}",
                             file=str(path)) from None
        built.append((allow, None if rule.users is None else frozenset(rule.users)))
    return EgressRules(tuple(built))


_LABEL_WIDTH = 100
_REASON_WIDTH = 1000


def _check_label(label: str) -> None:
    if not 0 < len(label) <= _LABEL_WIDTH or not label.isprintable() or label != label.strip():
        raise BadRequest("invalid_label", f"a tool computer's label is 1 to {_LABEL_WIDTH} printable characters, "
                                          "without spaces around them")


def issue_client_token(conn: Connection, *, user_id: str, label: str, now: datetime) -> tuple[str, str]:
    """A proxy credential for one of the user's tool computers: (client ID, token). The token is shown once. The
    user's earlier credential under the same label is revoked in the same transaction: a label has one at a time."""
    _check_label(label)
    # The user's row is locked (PostgreSQL; SQLite's writer lock serialises anyway): two issues for one label
    # cannot both leave a live credential.
    if conn.execute(select(users.c.id).where(users.c.id == user_id).with_for_update()).first() is None:
        raise NotFound("unknown_user", f"no user {user_id}")
    revoke_label(conn, user_id=user_id, label=label, now=now)
    token = secrets.token_urlsafe(32)
    client_id = new_id("egc")
    conn.execute(insert(egress_clients).values(id=client_id, user_id=user_id, label=label,
                                               token_sha256=_digest(token), created_at=now))
    return client_id, token


def revoke_label(conn: Connection, *, user_id: str, label: str, now: datetime) -> int:
    """Revoke the user's live credentials under `label`; how many there were (0: none)."""
    return conn.execute(update(egress_clients).where(and_(
        egress_clients.c.user_id == user_id, egress_clients.c.label == label,
        egress_clients.c.revoked_at.is_(None))).values(revoked_at=now)).rowcount


def revoke_client(conn: Connection, client_id: str, *, now: datetime) -> None:
    moved = conn.execute(update(egress_clients).where(and_(
        egress_clients.c.id == client_id, egress_clients.c.revoked_at.is_(None))).values(revoked_at=now)).rowcount
    if moved != 1:
        raise NotFound("unknown_client", f"no active egress client {client_id}")


@dataclass(frozen=True, kw_only=True)
class ClientState:
    """What the records say about one tool-computer proxy credential at the moment of the request."""

    user_id: str
    """The user the credential belongs to."""
    user_name: str
    """Whose egress rules apply (`users` in egress.toml names users)."""
    label: str
    """What it was issued for (`wakeful egress client LABEL`): named in every verdict, so in the audit."""
    revoked: bool
    """Revoked, or replaced by a newer credential for the same label."""
    stopped: bool
    """A STOP is in force for this user or for the whole deployment."""


def _latest_stop_kind(scope: Any) -> Any:
    # The newest STOP/START row of one scope decides it, exactly as `control.stop_state` orders them.
    return (select(control_records.c.kind)
            .where(scope, control_records.c.kind.in_([ControlKind.STOP.value, ControlKind.START.value]))
            .order_by(control_records.c.created_at.desc(), control_records.c.id.desc())
            .limit(1).scalar_subquery())


_CLIENT_STATE = (
    select(egress_clients.c.user_id, users.c.name.label("user_name"), egress_clients.c.label,
           egress_clients.c.revoked_at.is_not(None).label("revoked"),
           _latest_stop_kind(control_records.c.user_id.is_(None)).label("stop_all"),
           _latest_stop_kind(control_records.c.user_id == egress_clients.c.user_id).label("stop_user"))
    .join_from(egress_clients, users, users.c.id == egress_clients.c.user_id)
    .where(egress_clients.c.token_sha256 == bindparam("digest", ""))
)


def client_state_statement() -> Select[Any]:
    """One statement, one snapshot: the credential's user, label and whether it is revoked, that user's name and
    both STOP scopes. Bind `digest` to `client_digest(req)`. Every lookup is by index (the credential's digest, the
    user's id)."""
    return _CLIENT_STATE


def client_digest(req: DecisionRequest) -> str | None:
    """The digest `client_state_statement` looks up, or None when the request presents no proxy credential."""
    if not req.user_id or not req.client_token:
        return None
    return _digest(req.client_token)


def client_state(row: Row[Any] | tuple[Any, ...] | None) -> ClientState | None:
    """The state from a row of `client_state_statement` (None: no such credential)."""
    if row is None:
        return None
    user_id, user_name, label, revoked, stop_all, stop_user = row
    stop = ControlKind.STOP.value
    return ClientState(user_id=user_id, user_name=user_name, label=label, revoked=bool(revoked),
                       stopped=stop in (stop_all, stop_user))


def tool_computer_verdict(req: DecisionRequest, state: ClientState | None, rules: EgressRules) -> Verdict:
    """The decision for tool-computer traffic, given what the records say about its credential. Pure. Once the
    credential is known, the verdict names it by its label (the audit row says which tool computer it was)."""
    if not req.user_id or not req.client_token:
        return _not_admitted("a tool computer authenticates to the proxy (Proxy-Authorization)")
    if state is None or state.user_id != req.user_id:
        return _not_admitted("this tool computer's proxy credential is unknown")
    label = clip(state.label if state.label.isprintable() else repr(state.label), _LABEL_WIDTH)
    if state.revoked:
        return _not_admitted(f"tool computer {label}: its proxy credential was revoked (issued again for this label, "
                             "or `wakeful egress client --revoke`)")
    if state.stopped:
        return _not_admitted(f"tool computer {label}: STOP is in force; nothing new goes out until the user lifts it")
    verdict = decide_by_allowlist(req, rules.for_user(state.user_name))
    if isinstance(verdict, Allow):
        return replace(verdict, rule=f"{verdict.rule}, for tool computer {label}")
    return replace(verdict, reason=clip(f"tool computer {label}: {verdict.reason}", _REASON_WIDTH))


def _decide_tool_computer(conn: Connection, req: DecisionRequest, rules: EgressRules) -> Verdict:
    digest = client_digest(req)
    row = None if digest is None else conn.execute(_CLIENT_STATE, {"digest": digest}).one_or_none()
    return tool_computer_verdict(req, client_state(row), rules)


def decide(conn: Connection, req: DecisionRequest, *, now: datetime, rules: EgressRules) -> Verdict:
    """The policy's answer to the proxy for one request. Reads only, except that a connector request it allows uses
    up its grant (run it in a write transaction: a second request under the same token is refused)."""
    if req.client == "connector":
        return _decide_connector(conn, req, now)
    return _decide_tool_computer(conn, req, rules)


# -- audit -------------------------------------------------------------------------------------------------------


def store_audit(conn: Connection, records: Iterable[EgressRecord], *, now: datetime) -> int:
    """Append the proxy's records; one the proxy sent again (after a reconnect) is stored once. Returns how many
    were new. A connector record gets its user from the grant it names."""
    rows = []
    for r in records:
        user_id = r.user_id
        if user_id is None and r.attempt_id is not None:
            user_id = conn.execute(select(egress_grants.c.user_id)
                                   .where(egress_grants.c.id == r.attempt_id)).scalar_one_or_none()
        rows.append({"request_id": r.request_id, "at": r.at, "user_id": user_id,
                     "client": r.client, "grant_id": r.attempt_id, "action_id": r.action_id, "method": r.method,
                     "scheme": r.scheme, "host": r.host, "port": r.port, "path": r.path, "verdict": r.verdict,
                     "code": r.code, "rule": r.rule, "credential": r.credential, "bytes_up": r.bytes_up,
                     "bytes_down": r.bytes_down, "upstream_status": r.upstream_status,
                     "latency_ms": r.latency_ms, "recorded_at": now})
    if not rows:
        return 0
    # A record already stored is left as it is (the table is append-only): one statement, no read before it.
    stored = conn.execute(upsert(conn, egress_audit).on_conflict_do_nothing(index_elements=["request_id"]), rows)
    return stored.rowcount


def audit_rows(conn: Connection, *, user_id: str | None, limit: int = 100, since: datetime | None = None,
               verdict: str | None = None, before: tuple[str, str] | None = None) -> Sequence[dict[str, Any]]:
    """The newest audit rows first; `user_id` None means every user (the CLI on the deployment's own machine).
    `before` is the (time in ISO 8601, request ID) of the last row of the previous page."""
    query = select(egress_audit).order_by(egress_audit.c.at.desc(), egress_audit.c.request_id.desc()).limit(limit)
    if before is not None:
        try:
            at: datetime | None = datetime.fromisoformat(before[0])
        except ValueError:
            at = None
        if at is None or at.tzinfo is None:  # the server writes its times with their zone
            raise BadRequest("bad_cursor", "the cursor is not one this server gave out")
        query = query.where(or_(egress_audit.c.at < at, and_(egress_audit.c.at == at,
                                                              egress_audit.c.request_id < before[1])))
    if user_id is not None:
        query = query.where(egress_audit.c.user_id == user_id)
    if since is not None:
        query = query.where(egress_audit.c.at >= since)
    if verdict is not None:
        query = query.where(egress_audit.c.verdict == verdict)
    out = []
    for row in conn.execute(query).mappings():
        item = dict(row)
        item["at"] = item["at"].isoformat()
        item["recorded_at"] = item["recorded_at"].isoformat()
        out.append(item)
    return out
