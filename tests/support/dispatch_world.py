"""A world for killing `wakeful serve` mid-dispatch: the merchant simulator on loopback in the test process, a real
`wakeful serve` subprocess over one database (the data directory's SQLite file, or a PostgreSQL database given by
URL), and the real tool layer writing actions into that same database.

    with dispatch_world(tmp_path, subscriptions=12) as w:
        w.start(crash_at="after_send:1")              # armed: dies with 77 at the point
        proposed = w.propose_cancel("sub_3")          # task, read, write -> an action waiting for approval
        w.approve(proposed.action_id)                 # through the running server's HTTP control API
        w.wait_crash("after_send")
        w.start()                                     # unarmed: recovery
        wait_until(lambda: w.settled(proposed.action_id), ...)

    with dispatch_world(tmp_path, subscriptions=12, database_url=postgres_database(server)) as w: ...

The default `wakeful serve` run handler proposes nothing, so the test process creates the work itself, through
`server.tools.ToolLayer` against the same database (SQLite in WAL mode serves both processes, as PostgreSQL does).
Everything asserted is read back from the server's database or from the simulator's own effect records.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Connection, Engine, and_, select

from tests.support.polling import wait_until
from tests.support.serve import WAKEFUL, ServeProcess
from wakeful.proxy.clock import SystemClock
from wakeful.server.acting.connectors import load_connectors
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, sessions
from wakeful.server.core.faults import EXIT_CODE
from wakeful.server.core.worker import Binding
from wakeful.server.egress.dispatch import reconcile_key
from wakeful.server.settings import EXAMPLE_POLICIES
from wakeful.server.sims import Merchant, create_merchant, serve
from wakeful.server.store import users
from wakeful.server.store.db import make_engine, read, write
from wakeful.server.store.tables import actions, attempts, events, evidence, objects, outbox, waits
from wakeful.server.tools.layer import ToolLayer

__all__ = ["CANCEL_VERIFIED", "CLEAN_EXIT", "DispatchWorld", "Proposed", "dispatch_world", "holds_for"]

# SIGTERM: uvicorn shuts down gracefully, then re-raises the signal, so a clean stop reads as -SIGTERM.
CLEAN_EXIT = (0, -15)
CRASH_TIMEOUT = 30.0

CANCEL_VERIFIED = [{"effect": "merchant__cancel_renewal",
                    "verify": {"read": "merchant__get_subscription", "with": {"subscription": "subscription"},
                               "done_when": {"at": "renewal", "equals": "off"}}}]


@dataclass(frozen=True)
class Proposed:
    subscription: str
    task_id: str
    session_id: str
    action_id: str
    idempotency_key: str


def holds_for(violation: Callable[[], object], seconds: float, what: str) -> None:
    """Poll `violation` for `seconds`: it returns something truthy describing what went wrong, or a falsy value.

    The observation window of an "and nothing more happens" assertion, built on `wait_until`; the first violation
    fails at once, naming it.
    """
    deadline = time.monotonic() + seconds

    def verdict() -> tuple[str, object] | None:
        found = violation()
        if found:
            return "violated", found
        return ("held", None) if time.monotonic() >= deadline else None

    result = wait_until(verdict, seconds + 30.0, what)
    assert result is not None and result[0] == "held", f"{what}: {result and result[1]}"


class DispatchWorld:
    def __init__(self, data_dir: Path, merchant: Merchant, merchant_url: str, *, reconcile_interval: float,
                 poll_interval: float, database_url: str | None = None) -> None:
        self.data_dir = data_dir
        self.database_url = database_url  # None: the data directory's SQLite file
        self.merchant = merchant
        self.merchant_url = merchant_url
        self.reconcile_interval = reconcile_interval
        self.poll_interval = poll_interval
        self.starts = 0
        self.server: ServeProcess | None = None
        self._engine: Engine | None = None
        self._tools: ToolLayer | None = None
        self._owner: str | None = None
        self._token: str | None = None
        self.clock = SystemClock()

    # -- the server process ----------------------------------------------------------------------------------

    def env(self, crash_at: str | None) -> dict[str, str]:
        env = {
            "WAKEFUL_DATA_DIR": str(self.data_dir),
            "WAKEFUL_POLICIES_DIR": str(EXAMPLE_POLICIES),
            "WAKEFUL_CONNECTOR_URLS__MERCHANT": self.merchant_url,
            "WAKEFUL_RECONCILE_INTERVAL": str(self.reconcile_interval),
            "WAKEFUL_RECONCILE_BACKOFF_MAX": "2",  # reads double from the interval: keep a recovery within seconds
            "WAKEFUL_POLL_INTERVAL": str(self.poll_interval),
            "WAKEFUL_IDLE_POLL_MAX": "1",  # recovery waits on lease expiry, which only polling notices
            "WAKEFUL_RESEND_AFTER": "2",
            # A dead worker's claims are free again after the lease (30 s by default): its sessions, and on
            # PostgreSQL the dispatch intent its drain had claimed (the outbox's hold), which recovery must take up.
            "WAKEFUL_LEASE": "3",
        }
        if crash_at:
            env["WAKEFUL_CRASH_AT"] = crash_at
        if self.database_url:
            env["WAKEFUL_DATABASE_URL"] = self.database_url
        return env

    def start(self, crash_at: str | None = None) -> ServeProcess:
        """Start `wakeful serve` (armed when `crash_at` is given); never two at once."""
        assert self.server is None or self.server.returncode is not None, "a server is still running"
        self.starts += 1
        tag = crash_at.partition(":")[0] if crash_at else "unarmed"
        self.server = ServeProcess(self.env(crash_at), log_path=self.data_dir / f"serve-{self.starts:03d}-{tag}.log")
        self.server.start()
        if self._engine is None:
            self._connect()
        return self.server

    def _connect(self) -> None:
        """Open the database the server has just migrated, and equip the test process to act as a client."""
        self._engine = make_engine(self.database_url or f"sqlite:///{self.data_dir / 'wakeful.db'}")
        with write(self._engine) as conn:
            owner = users.user_id_by_name(conn, "owner")
            self._token = users.issue_token(conn, user_id=owner)
        self._owner = owner
        registry = load_connectors(EXAMPLE_POLICIES / "connectors", base_urls={"merchant": self.merchant_url})
        self._tools = ToolLayer(self._engine, self.clock, registry=registry, policy=Policy())

    def wait_crash(self, point: str, timeout: float = CRASH_TIMEOUT) -> None:
        server = self.live
        code = server.wait_exit(timeout)
        assert code is not None, f"the armed server did not die at {point} within {timeout} s:\n{server.log()}"
        log = server.log()
        assert code == EXIT_CODE, f"wakeful serve exited with {code}, not {EXIT_CODE}:\n{log}"
        assert f"crash point {point} reached" in log, f"exit {EXIT_CODE} without the crash point's log line:\n{log}"

    def stop(self) -> str:
        """SIGTERM the running server; it must stop cleanly. Returns its log."""
        server = self.live
        code, killed = server.terminate()
        log = server.log()
        assert not killed and code in CLEAN_EXIT, f"SIGTERM: exit {code}, killed={killed}; log:\n{log}"
        return log

    @property
    def live(self) -> ServeProcess:
        assert self.server is not None, "no server was started"
        return self.server

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "start the server first: it migrates the database"
        return self._engine

    @property
    def owner(self) -> str:
        assert self._owner is not None
        return self._owner

    def close(self) -> None:
        if self.server is not None:
            self.server.kill()
        if self._tools is not None:
            self._tools.close()
        if self._engine is not None:
            self._engine.dispose()

    # -- acting as a client ----------------------------------------------------------------------------------

    def propose_cancel(self, subscription: str, *, reason: str | None = None,
                       completion: list[dict[str, Any]] | None = None) -> Proposed:
        """A task, a fresh read of the subscriptions, and a `cancel_renewal` for one of them: the action waits for
        the user's approval (the connector declares the tool `ask`)."""
        assert self._tools is not None
        now = self.clock.now()
        with write(self.engine) as conn:
            session_id = sessions.create_session(conn, user_id=self.owner, now=now)
            task_id = control.create_task(conn, user_id=self.owner, session_id=session_id, now=now,
                                          title=f"stop {subscription} renewing", completion=completion or [])
        binding = Binding(user_id=self.owner, task_id=task_id)
        listed = self._tools.call(binding, "merchant__list_subscriptions", {})["objects"]
        with read(self.engine) as conn:
            refs = dict(conn.execute(select(objects.c.id, objects.c.ref).where(
                objects.c.id.in_([o["id"] for o in listed]))).all())
        (object_id,) = [oid for oid, ref in refs.items() if ref == subscription]
        args: dict[str, Any] = {"subscription": object_id}
        if reason is not None:
            args["reason"] = reason
        proposed = self._tools.call(binding, "merchant__cancel_renewal", args)
        assert proposed["status"] == "needs_approval", proposed
        content = self.action_content(proposed["action_id"])
        assert content["refs"] == {"subscription": subscription}, content["refs"]
        return Proposed(subscription=subscription, task_id=task_id, session_id=session_id,
                        action_id=proposed["action_id"], idempotency_key=content["idempotency_key"])

    def approve(self, action_id: str) -> dict[str, Any] | None:
        """Approve through the running server's HTTP control API. None when the reply was lost because the
        process died (the dispatcher may reach the crash point before the HTTP response is written): the
        approval is then checked in the database instead, as a client that lost the reply would."""
        try:
            response = httpx.post(f"{self.live.url}/v1/actions/{action_id}/approve",
                                  headers={"Authorization": f"Bearer {self._token}"}, timeout=30.0)
        except httpx.TransportError:
            assert self.dispatch_intents(action_id), f"the approval of {action_id} was lost with the process"
            return None
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        assert body["verdict"] == "admitted", body
        return body

    # -- the server's records --------------------------------------------------------------------------------

    def action_content(self, action_id: str) -> dict[str, Any]:
        with read(self.engine) as conn:
            raw = conn.execute(select(actions.c.content).where(actions.c.id == action_id)).scalar_one()
        content: dict[str, Any] = json.loads(raw)
        return content

    def attempts(self, action_id: str) -> list[dict[str, Any]]:
        with read(self.engine) as conn:
            rows = conn.execute(select(attempts).where(attempts.c.action_id == action_id)
                                .order_by(attempts.c.seq)).all()
        return [{**r._asdict(), "request": json.loads(r.request)} for r in rows]

    def evidence(self, action_id: str, source: str | None = None) -> list[dict[str, Any]]:
        with read(self.engine) as conn:
            rows = conn.execute(select(evidence).where(evidence.c.action_id == action_id)
                                .order_by(evidence.c.checked_at, evidence.c.id)).all()
        return [{**r._asdict(), "observed": json.loads(r.observed)} for r in rows
                if source is None or r.source == source]

    def dispatch_intents(self, action_id: str) -> list[dict[str, Any]]:
        """Every dispatch intent of the action: the approval's `dsp_<id>` and reconciliation's `dsp_<id>_<seq>`."""
        with read(self.engine) as conn:
            rows = conn.execute(select(outbox).where(and_(outbox.c.kind == "dispatch",
                                                          outbox.c.id.like(f"dsp_{action_id}%")))
                                .order_by(outbox.c.created_at, outbox.c.id)).all()
        return [r._asdict() for r in rows]

    def reconcile_wait(self, action_id: str) -> dict[str, Any] | None:
        with read(self.engine) as conn:
            row = conn.execute(select(waits).where(waits.c.match_key == reconcile_key(action_id))).first()
        return row._asdict() if row else None

    def messages(self, session_id: str) -> list[dict[str, Any]]:
        with read(self.engine) as conn:
            rows = conn.execute(select(outbox).where(and_(outbox.c.kind == "user_message",
                                                          outbox.c.session_id == session_id))
                                .order_by(outbox.c.created_at, outbox.c.id)).all()
        return [{"id": r.id, "state": r.state, **json.loads(r.body)} for r in rows]

    def session_events(self, session_id: str) -> list[dict[str, Any]]:
        with read(self.engine) as conn:
            rows = conn.execute(select(events).where(events.c.session_id == session_id)
                                .order_by(events.c.received_at, events.c.id)).all()
        return [r._asdict() for r in rows]

    def accepted(self, action_id: str) -> str | None:
        """How the outcome became known to be `accepted`: "reconcile", "response", or None (not yet)."""
        with read(self.engine) as conn:
            return self._accepted(conn, action_id)

    @staticmethod
    def _accepted(conn: Connection, action_id: str) -> str | None:
        if conn.execute(select(evidence.c.id).where(and_(
                evidence.c.action_id == action_id, evidence.c.source == "reconcile",
                evidence.c.verdict == "accepted"))).first() is not None:
            return "reconcile"
        if conn.execute(select(attempts.c.id).where(and_(
                attempts.c.action_id == action_id, attempts.c.outcome == "accepted"))).first() is not None:
            return "response"
        return None

    def settled(self, action_id: str) -> str | None:
        """Accepted, with nothing left in flight for it: no open attempt, no pending dispatch intent, and no
        reconcile wait still pending — all read in one snapshot. Returns how it became known (see `accepted`)."""
        with read(self.engine) as conn:
            how = self._accepted(conn, action_id)
            in_flight = (
                conn.execute(select(attempts.c.id).where(and_(
                    attempts.c.action_id == action_id, attempts.c.outcome.is_(None)))).first(),
                conn.execute(select(outbox.c.id).where(and_(
                    outbox.c.kind == "dispatch", outbox.c.id.like(f"dsp_{action_id}%"),
                    outbox.c.state == "pending"))).first(),
                conn.execute(select(waits.c.id).where(and_(
                    waits.c.match_key == reconcile_key(action_id), waits.c.state == "pending"))).first(),
            )
        return None if how is None or any(row is not None for row in in_flight) else how

    def ledger_export(self) -> list[dict[str, Any]]:
        """`wakeful ledger export` over the data directory, as the operator would run it."""
        database = ["--database-url", self.database_url] if self.database_url else []
        done = subprocess.run([str(WAKEFUL), "ledger", "export", "--data-dir", str(self.data_dir), *database],
                              capture_output=True, text=True, timeout=60, check=False,
                              env={k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")})
        assert done.returncode == 0, done.stderr
        (self.data_dir / "ledger.jsonl").write_text(done.stdout)
        return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


@contextmanager
def dispatch_world(data_dir: Path, *, subscriptions: int, reconcile_interval: float = 0.2,
                   poll_interval: float = 0.1, database_url: str | None = None) -> Iterator[DispatchWorld]:
    """The merchant on loopback with `sub_0` … `sub_<n-1>`, and a world whose server is not started yet; its
    database is `database_url` (an empty PostgreSQL database the first start migrates) or the data directory's
    SQLite file."""
    app, merchant = create_merchant(subscriptions=[{"id": f"sub_{i}"} for i in range(subscriptions)])
    with serve(app) as url:
        world = DispatchWorld(data_dir, merchant, url, reconcile_interval=reconcile_interval,
                              poll_interval=poll_interval, database_url=database_url)
        try:
            yield world
        finally:
            world.close()
