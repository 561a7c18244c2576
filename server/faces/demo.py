"""`wakeful demo`: the subscription-cancellation delegation end to end on the embedded default.

One process, one SQLite file, the merchant simulator on loopback, and a scripted model in place of a real one.
The merchant commits the cancellation and then drops the response, so the ledger shows the whole arc: request
received → approval → attempt persisted → outcome unknown → reconciled → verified by a fresh read → receipt.

The records go to `--data-dir` (or `WAKEFUL_DATA_DIR`) when one is given, so they can be read afterwards with the
other commands; otherwise to a temporary folder removed at the end. Each run is a new delegation in the same
database: a directory used before holds the earlier runs' records beside the new one. Everything it needs ships
with the package (the simulator in `wakeful.server.sims`, the connector declarations in `wakeful.policies`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import and_, select

from wakeful.server.acting import approvals, ledger
from wakeful.server.core import control, sessions
from wakeful.server.core.worker import RunContext
from wakeful.server.errors import WakefulError
from wakeful.server.runtime import Runtime
from wakeful.server.settings import DB_FILE, EXAMPLE_POLICIES, Settings
from wakeful.server.sims import Merchant, create_merchant, serve
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import OutboxState, actions, outbox, verdicts
from wakeful.server.store.users import ensure_user

__all__ = ["SubscriptionAgent", "run_demo"]

DEMO_MARK = ".wakeful-demo"
"""The file that says a data directory holds the demo's records (and nothing else): the demo runs there again."""

COMPLETION = [{"effect": "merchant__cancel_renewal",
               "verify": {"read": "merchant__get_subscription", "with": {"subscription": "subscription"},
                          "done_when": {"at": "renewal", "equals": "off"}}}]


class SubscriptionAgent:
    """A scripted model: reads the subscriptions, proposes cancelling the renewal of the first, then reports."""

    def __call__(self, ctx: RunContext) -> None:
        ctx.step()
        delegation = next((e for e in ctx.events if e.source == "delegation"), None)
        if delegation is None:
            outcomes = [e.payload for e in ctx.events if e.source in ("dispatch", "reconcile")]
            if outcomes:
                ctx.send_to_user("Update: " + "; ".join(f"{o['action_id']} {o['outcome']}" for o in outcomes))
            else:
                ctx.silence("nothing new to report")
            return
        task_id = delegation.payload["task_id"]
        decision_id, proposal = ctx.propose(lambda: {"tool": "merchant__list_subscriptions", "args": {}})
        listed = ctx.call_tool(task_id=task_id, decision_id=decision_id, **proposal)
        ctx.step()
        target = listed["objects"][0]
        decision_id, proposal = ctx.propose(lambda: {"tool": "merchant__cancel_renewal",
                                                     "args": {"subscription": target["id"],
                                                              "reason": "keep this month's benefits"}})
        result = ctx.call_tool(task_id=task_id, decision_id=decision_id, **proposal)
        ctx.send_to_user(f"I asked to stop {target['plan']} renewing; it is {result['status']} "
                         f"({result['code']}).")


def _wait_for(what: str, predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the demo gave up waiting for: {what}")
        time.sleep(0.05)  # polling the database inside a bounded loop


@contextmanager
def _merchant() -> Iterator[tuple[str, Merchant]]:
    app, merchant = create_merchant()
    with serve(app) as url:
        yield url, merchant


@contextmanager
def _data_dir(given: Path | None) -> Iterator[Path]:
    """`--data-dir`, else `WAKEFUL_DATA_DIR`, else a temporary folder that goes when the demo ends."""
    named = given or (Path(os.environ["WAKEFUL_DATA_DIR"]) if os.environ.get("WAKEFUL_DATA_DIR") else None)
    if named is not None:
        _claim(named)
        yield named
        return
    with tempfile.TemporaryDirectory(prefix="wakeful-demo-") as tmp:
        yield Path(tmp)


def _claim(directory: Path) -> None:
    """Refuse a named directory whose database holds records other than an earlier demo's (`DEMO_MARK`): the demo's
    simulated cancellation, its approval and its spending would join a deployment's chained ledger for good."""
    database = directory / DB_FILE  # the demo's settings name no other database
    if database.is_file() and database.stat().st_size > 0 and not (directory / DEMO_MARK).is_file():
        raise WakefulError("not_a_demo_directory",
                           f"{directory} holds other records, which the demo's simulated cancellation, its approval "
                           "and its spending would join for good: run `wakeful demo` without --data-dir and "
                           "WAKEFUL_DATA_DIR (it uses a temporary directory), or name an empty directory")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / DEMO_MARK).write_text("wakeful demo's records: the demo may run here again\n")


def run_demo(data_dir: Path | None = None, out: Callable[[str], None] = print) -> int:
    """Run the demo; returns how many cancellations the merchant's own records hold (1 is right)."""
    with _merchant() as (url, merchant), _data_dir(data_dir) as directory:
        merchant.faults.update({"commit_then_timeout": 1, "stall_seconds": 3.0})
        settings = Settings(data_dir=directory, policies_dir=EXAMPLE_POLICIES,
                            connector_urls={"merchant": url}, poll_interval=0.1, reconcile_interval=0.2,
                            connector_timeout=0.5,  # shorter than the merchant's stall: the response is lost
                            sources={}, proxy=False)  # the simulator speaks plain HTTP on loopback, holds no key
        runtime = Runtime(settings, handler=SubscriptionAgent())
        runtime.prepare()
        runtime.start()
        try:
            return _script(runtime, merchant, out)
        finally:
            runtime.stop()


def _script(runtime: Runtime, merchant: Merchant, out: Callable[[str], None]) -> int:
    engine, clock = runtime.engine, runtime.clock
    with write(engine) as conn:
        owner, _ = ensure_user(conn, name="owner", now=clock.now())
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        task_id = control.create_task(conn, user_id=owner, session_id=session_id, now=clock.now(),
                                      title="Cancel my Pro subscription but keep this month's benefits",
                                      completion=COMPLETION)
    runtime.signals.work.set()
    out(f"delegated: {task_id} (database {runtime.settings.db_shown})")

    def waiting_action() -> str | None:
        """This delegation's action awaiting approval (a data directory used before holds earlier runs' too)."""
        with read(engine) as conn:
            return conn.execute(select(verdicts.c.action_id)
                                .join(actions, actions.c.id == verdicts.c.action_id)
                                .where(and_(actions.c.task_id == task_id, verdicts.c.verdict == "needs_approval"))
                                .limit(1)).scalar()

    _wait_for("the approval request", lambda: waiting_action() is not None)
    action_id = waiting_action()
    assert action_id is not None
    out(f"approval requested for {action_id}; the merchant will commit it and then drop the response")
    with write(engine) as conn:
        approvals.decide(conn, user_id=owner, action_id=action_id, approve=True, actor="user:owner (demo)",
                         policy=runtime.policy, now=clock.now())
    runtime.signals.dispatch.set()
    out("approved by the user through the control channel")

    def receipt_sent() -> bool:
        with read(engine) as conn:
            return conn.execute(select(outbox.c.id).where(and_(outbox.c.id.like(f"rcpt_{task_id}%"),
                                                               outbox.c.state == OutboxState.SENT.value))
                                ).first() is not None

    _wait_for("the receipt", receipt_sent, timeout=15)
    with read(engine) as conn:
        entries = ledger.entries(conn, task_id=task_id, user_id=owner)
        facts = ledger.four_facts(conn, task_id=task_id)
    out("\nledger timeline:")
    for entry in entries:
        out("  " + ledger.describe(entry))
    out("\nfour facts: " + ", ".join(f"{k}={v}" for k, v in facts.items()))
    count = len(merchant.effects_of("cancel_renewal"))
    sub = merchant.subscription("sub_1") or {}
    out(f"merchant's own records: {count} cancellation(s) of sub_1; renewal is now {sub.get('renewal')}")
    return count


