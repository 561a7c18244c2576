"""The tool layer: one tool per declared connector operation, and the only way a proposal reaches the world.

Reads go out at once (through the same HTTP client the egress proxy will sit behind) and come back as
server-issued object IDs bound to this task version. Writes never go out here: they become immutable actions,
are admitted (or not) against recorded facts, and leave only through the dispatcher. Arguments naming objects
accept only IDs this server issued for this task version and kind; anything else is refused as
`unknown_object` and the refusal is recorded.

A helper task's run (`core.helper_tasks`: the call comes from the helper's own session) may call read tools only;
anything else is refused as `helper_read_only`, and recorded. Its reads mint IDs only that helper resolves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from sqlalchemy import Connection, Engine, and_, select

from wakeful.proxy.clock import Clock
from wakeful.server.acting import objects
from wakeful.server.acting.actions import ActionState, create_action, operation_hash, standing_action
from wakeful.server.acting.connectors import (
    OBJECT_ID_PATTERN,
    ObjectParam,
    Operation,
    Registry,
    build_request,
    extract_objects,
    reconcile_arguments,
    validate_arguments,
)
from wakeful.server.acting.policy import Policy
from wakeful.server.acting.verdicts import admit_and_record, lock_task, verdict_status
from wakeful.server.computers.pool import COMPUTER_TOOLS, Computers
from wakeful.server.core import helper_tasks, sessions
from wakeful.server.core.worker import Binding
from wakeful.server.egress.dispatch import add_evidence, proxy_refusal
from wakeful.server.egress.outbound import ConnectorHTTP
from wakeful.server.errors import BadRequest, NotFound, Refused, WakefulError
from wakeful.server.store.db import read, write
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import GrantPurpose, Outcome, Risk, TaskState, actions, task_versions, tasks
from wakeful.server.tools.computer import ComputerToolLayer
from wakeful.server.tools.specs import Completion, Face, spec

__all__ = ["Completion", "ToolLayer"]  # Completion: also what `server.faces.routes` validates a delegation with

_OBJECT_ID = re.compile(OBJECT_ID_PATTERN)

_SAID = {
    ActionState.PENDING: "waiting for the user's approval",
    ActionState.ADMITTED: "admitted and on its way",
    ActionState.UNKNOWN: "sent with an outcome not yet known (it is being reconciled, never sent blindly again)",
    ActionState.DONE: "done (the remote accepted it)",
}


class ToolLayer:
    def __init__(self, engine: Engine, clock: Clock, *, registry: Registry, policy: Policy,
                 http: ConnectorHTTP | None = None, timeout: float = 10.0) -> None:
        self.engine = engine
        self.clock = clock
        self.registry = registry
        self.policy = policy
        self._http = http or ConnectorHTTP(timeout=timeout)
        self.computers: ComputerToolLayer | None = None
        """Set when the server runs tool computers (`attach_computers`)."""

    def attach_computers(self, computers: Computers, *, dispatch_now: Callable[[str], None],
                         notify: Callable[[Binding, str], None]) -> None:
        self.computers = ComputerToolLayer(self.engine, self.clock, computers=computers, policy=self.policy,
                                           fence=self._fence, dispatch_now=dispatch_now, notify=notify)

    def close(self) -> None:
        self._http.close()

    def call(self, binding: Binding, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
        helper = self._helper(binding, tool)
        if tool in COMPUTER_TOOLS:
            if self.computers is None:
                raise WakefulError("tool_computer_unavailable", "this server runs no tool computers")
            return self.computers.call(binding, tool, spec(tool).validate(Face.HARNESS, args))
        op = self.registry.operation(tool)
        if op.internal:
            raise WakefulError("unknown_tool", f"there is no tool named {tool!r}")
        try:
            for name, param in op.params.items():
                value = args.get(name) if isinstance(args, Mapping) else None
                if isinstance(param, ObjectParam) and value is not None and (
                        not isinstance(value, str) or not _OBJECT_ID.fullmatch(value)):
                    raise objects.UnknownObject(repr(value)[:80], "not an ID this server issues")
            if op.effect == "read":
                return self._read(binding, op, args, helper_id=helper.id if helper else None)
            return self._write(binding, op, args)
        except (objects.UnknownObject, BadRequest) as refused:
            with write(self.engine) as conn:
                objects.record_refusal(conn, user_id=binding.user_id, task_id=binding.task_id, run_id=binding.run_id,
                                       tool=tool, code=refused.code, detail=refused.message, now=self.clock.now())
            raise

    # -- shared --------------------------------------------------------------------------------------------------

    def _helper(self, binding: Binding, tool: str) -> helper_tasks.Helper | None:
        """The helper task whose run calls (None for the main run and MCP calls); `helper_read_only` unless `tool`
        is one of this task's reads."""
        with read(self.engine) as conn:
            helper = helper_tasks.of_session(conn, binding.session_id)
        if helper is None:
            return None
        reads = {op.tool_name for op in self.registry.tools() if op.effect == "read"}
        if tool in reads and helper.task_id == binding.task_id:
            return helper
        with write(self.engine) as conn:
            objects.record_refusal(conn, user_id=binding.user_id, task_id=binding.task_id, run_id=binding.run_id,
                                   tool=tool, code="helper_read_only", detail=f"helper {helper.id}",
                                   now=self.clock.now())
        raise Refused("helper_read_only", f"{tool}: a helper task only reads; what it found goes back to the main "
                      "task, which decides and acts", helper_id=helper.id)

    def _fence(self, conn: Connection, binding: Binding) -> Any:
        if binding.token is not None and binding.session_id is not None:
            sessions.fence(conn, session_id=binding.session_id, token=binding.token)
        owned = conn.execute(select(tasks.c.id).where(and_(tasks.c.id == binding.task_id,
                                                           tasks.c.user_id == binding.user_id))).first()
        if owned is None:  # never there, or another user's: the same answer, so IDs cannot be probed
            raise NotFound("unknown_task", f"there is no task {binding.task_id!r} of yours: use the task ID that "
                                           "create_responsibility returned", task_id=binding.task_id)
        task = lock_task(conn, binding.task_id)
        if task.state == TaskState.HELD.value:
            raise Refused(task.state, "the user wrote about the task and it is held until this wake ends: read their "
                                      "message; confirm_pause if they asked to stop, else the hold lifts after it")
        if task.state != TaskState.ACTIVE.value:
            raise Refused(task.state, f"the task is {task.state}; nothing is done for it until the user resumes it")
        return task

    def _resolve(self, conn: Connection, binding: Binding, op: Operation, args: Mapping[str, Any],
                 version: int, helper_id: str | None = None) -> dict[str, objects.IssuedObject]:
        now = self.clock.now()
        return {name: objects.resolve(conn, args[name], user_id=binding.user_id, task_id=binding.task_id,
                                      task_version=version, kind=param.kind, now=now, helper_id=helper_id)
                for name, param in op.params.items() if isinstance(param, ObjectParam) and name in args}

    # -- reads -----------------------------------------------------------------------------------------------

    def _read(self, binding: Binding, op: Operation, args: Mapping[str, Any],
              helper_id: str | None) -> dict[str, Any]:
        valid = validate_arguments(op, args)
        with write(self.engine) as conn:
            task = self._fence(conn, binding)
            resolved = self._resolve(conn, binding, op, valid, task.current_version, helper_id)
            prepared = build_request(op, args=valid, resolved={k: o.ref for k, o in resolved.items()},
                                     idempotency_key=None)
            grant = self._http.grant(conn, purpose=GrantPurpose.READ, user_id=binding.user_id, task_id=task.id,
                                     tool=op.tool_name, request=prepared,
                                     credential=self.registry.connectors[op.connector].credential,
                                     now=self.clock.now())
        try:
            response = self._http.send(prepared, grant)
        except httpx.HTTPError as exc:
            raise WakefulError("remote_unreachable", f"{op.tool_name}: {type(exc).__name__}: {exc}") from None
        refused = proxy_refusal(response)
        if refused is not None:  # the proxy's own code and reason, as its audit has them, not the status it used
            raise WakefulError(refused[0], f"{op.tool_name}: refused by the egress proxy: {refused[1]}",
                               status_code=response.status_code)
        if not response.is_success:
            raise WakefulError("remote_error", f"{op.tool_name}: the remote answered HTTP {response.status_code}",
                               status_code=response.status_code)
        body = response.json()
        now = self.clock.now()
        with write(self.engine) as conn:
            task = self._fence(conn, binding)
            issued = []
            for found in extract_objects(op, body):
                object_id = objects.mint(conn, user_id=binding.user_id, task_id=binding.task_id,
                                         task_version=task.current_version, kind=found.kind, connector=op.connector,
                                         ref=found.ref, operation=op.tool_name, snapshot=found.snapshot, now=now,
                                         ttl=self.policy.object_ttl, helper_id=helper_id)
                issued.append({"id": object_id, "kind": found.kind, **found.snapshot})
            add_evidence(conn, action=None, task_id=binding.task_id, attempt_id=None, source="read",
                         verdict=Outcome.ACCEPTED, now=now,
                         observed={"tool": op.tool_name, "request": prepared.to_json(),
                                   "status_code": response.status_code, "objects": issued})
        return {"objects": issued}

    # -- writes ----------------------------------------------------------------------------------------------

    def _write(self, binding: Binding, op: Operation, args: Mapping[str, Any]) -> dict[str, Any]:
        valid = validate_arguments(op, args)
        now = self.clock.now()
        with write(self.engine) as conn:
            task = self._fence(conn, binding)
            if binding.decision_id is not None:
                existing = conn.execute(select(actions.c.id).where(and_(
                    actions.c.decision_id == binding.decision_id, actions.c.user_id == binding.user_id,
                    actions.c.task_id == binding.task_id))).scalar_one_or_none()
                if existing is not None:  # a replayed decision: the action exists already, never a second one
                    return self._status(conn, existing)
            resolved = self._resolve(conn, binding, op, valid, task.current_version)
            version = conn.execute(select(task_versions).where(and_(
                task_versions.c.task_id == task.id, task_versions.c.version == task.current_version))).one()
            content, amount, currency = self._content(op, valid, resolved, version)
            operation = operation_hash(connector=op.connector, tool=op.tool_name, request=content["request"])
            standing = standing_action(conn, task_id=task.id, task_version=task.current_version, operation=operation)
            if standing is not None:  # under the task's lock (`_fence`): two identical proposals cannot both miss
                return self._same_operation(conn, *standing)
            action = create_action(conn, user_id=binding.user_id, task_id=task.id, task_version=task.current_version,
                                   run_id=binding.run_id, tool=op.tool_name, content=content,
                                   risk=op.risk or Risk.ASK.value, amount_cents=amount, currency=currency, now=now,
                                   decision_id=binding.decision_id, operation=operation)
            admit_and_record(conn, action, policy=self.policy, now=now, session_id=task.session_id)
            return self._status(conn, action.id)

    def _content(self, op: Operation, args: dict[str, Any], resolved: dict[str, objects.IssuedObject],
                 version: Any) -> tuple[dict[str, Any], int | None, str | None]:
        key = new_id("idem")
        refs = {name: obj.ref for name, obj in resolved.items()}
        prepared = build_request(op, args=args, resolved=refs, idempotency_key=key)
        amount = currency = None
        if op.amount is not None and op.amount.from_object in resolved:
            snapshot = resolved[op.amount.from_object].snapshot
            raw_amount, raw_currency = snapshot.get(op.amount.field), snapshot.get(op.amount.currency_field)
            amount = raw_amount if isinstance(raw_amount, int) else None
            currency = raw_currency if isinstance(raw_currency, str) else None
        reconciler = self.registry.reconciler(op)
        r_args = reconcile_arguments(op, args=args, idempotency_key=key)
        r_request = build_request(reconciler, args=r_args, idempotency_key=None,
                                  resolved={n: refs[n] for n, v in r_args.items() if n in refs})
        content: dict[str, Any] = {
            "tool": op.tool_name, "connector": op.connector, "description": op.description,
            "credential": self.registry.connectors[op.connector].credential,
            "task_version": version.version, "args": args,
            "objects": {name: obj.id for name, obj in resolved.items()}, "refs": refs,
            "snapshots": {name: obj.snapshot for name, obj in resolved.items()},
            "request": prepared.to_json(), "idempotency_key": key, "idempotency_header": op.idempotency_header,
            "reconcile": {"request": r_request.to_json(),
                          "done_when": op.reconcile.done_when.model_dump() if op.reconcile else None},
            "constraints": json.loads(version.constraints),
        }
        for condition in (Completion.model_validate(c) for c in json.loads(version.completion)):
            if condition.effect == op.tool_name and condition.verify is not None:
                read_op = self.registry.operation(condition.verify.read)
                v_args = {theirs: args[ours] for theirs, ours in condition.verify.with_.items() if ours in args}
                v_request = build_request(read_op, args=v_args, idempotency_key=None,
                                          resolved={n: refs[n] for n in v_args if n in refs})
                content["verify"] = {"request": v_request.to_json(),
                                     "done_when": condition.verify.done_when.model_dump()}
        return content, amount, currency

    def _status(self, conn: Connection, action_id: str) -> dict[str, Any]:
        return verdict_status(conn, action_id)

    def _same_operation(self, conn: Connection, action_id: str, state: ActionState) -> dict[str, Any]:
        """The answer to a proposal that is an action already standing: that action, and no second one."""
        return {**verdict_status(conn, action_id), "state": state.value, "same_operation": True,
                "reason": f"the same operation as {action_id}, proposed earlier in this task version, which is "
                          f"{_SAID[state]}: it is that action, not a second one"}
