"""One scenario's world: a fresh data directory, the simulators and a runtime serving the real HTTP app, all on
127.0.0.1 and on one clock that can jump days.

The scenario talks to it only as the outside does: the user over HTTP (`POST /v1/tasks`, approvals, pause, close,
`GET /v1/tasks/{id}/ledger`), the services through their own API and `/_sim` controls, their webhooks signed into
`POST /v1/hooks/<sim>`. The clock (`SimClock(running=True)`) ticks with real time, so the runtime's loops see time
pass, and jumps when a scenario skips hours or days; the simulators sign their webhooks with it, as the receiver
checks a signature's timestamp against the same clock.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from datetime import time as dt_time
from functools import cache, partial
from pathlib import Path
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

import httpx
from pydantic import SecretStr
from starlette.types import ASGIApp

from wakeful.server.harness.model import ModelAdapter
from wakeful.server.harness.wake import Harness
from wakeful.server.runtime import Runtime, load_registry
from wakeful.server.settings import DB_FILE, EXAMPLE_POLICIES, Settings, SourceSettings
from wakeful.server.sims import Sim, SimClock, serve
from wakeful.server.sims.fleet import CORRELATION, running
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.users import ensure_user, issue_token

__all__ = ["AppFactory", "EvalWorld", "Gave", "world"]

T = TypeVar("T")
COALESCE = timedelta(seconds=2)
"""The runtime's coalescing window: keyed webhooks arriving within it are one run (`Settings.coalesce_seconds`)."""
AppFactory = Callable[[Runtime], ASGIApp]
"""Builds the HTTP app over a runtime that is already running (the caller's `create_app(..., manage_runtime=False)`)."""


class Gave(Exception):
    """A scenario's wait ran out: what it waited for never happened (the scenario fails, with this as evidence)."""


@dataclass
class EvalWorld:
    clock: SimClock
    api: httpx.Client
    """The user's HTTP client: the app's base URL and the owner's token."""
    sims: dict[str, Sim]
    sim_urls: dict[str, str]
    timeout: float
    """How long one wait may take before the scenario gives up."""
    tasks: list[str] = field(default_factory=list)
    """The tasks delegated so far, oldest first (a failed trial shows the last one's ledger)."""

    def post(self, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return self.api.post(path, json=body or {})

    def get(self, path: str) -> Any:
        response = self.api.get(path)
        response.raise_for_status()
        return response.json()

    def delegate(self, title: str, completion: list[dict[str, Any]] | None = None,
                 keys: Sequence[str] = ()) -> str:
        created = self.post("/v1/tasks", {"title": title, "completion": completion or [], "keys": list(keys)})
        created.raise_for_status()
        self.tasks.append(created.json()["task_id"])
        return self.tasks[-1]

    def status(self, task_id: str) -> dict[str, Any]:
        return dict(self.get(f"/v1/tasks/{task_id}"))

    def ledger(self, task_id: str) -> list[dict[str, Any]]:
        return list(self.get(f"/v1/tasks/{task_id}/ledger")["entries"])

    def control(self, task_id: str, operation: str, reason: str = "") -> dict[str, Any]:
        return dict(self.post(f"/v1/tasks/{task_id}/{operation}", {"reason": reason or operation}).json())

    def decide(self, action_id: str, decision: str = "approve") -> dict[str, Any]:
        return dict(self.post(f"/v1/actions/{action_id}/{decision}", {"reason": "eval"}).json())

    def prefer(self, **changes: Any) -> dict[str, Any]:
        """The user's preferences (`PUT /v1/preferences`: timezone, quiet_hours, attention_budget)."""
        answer = self.api.put("/v1/preferences", json=changes)
        answer.raise_for_status()
        return dict(answer.json())

    def messages(self, after: int = 0) -> list[dict[str, Any]]:
        """What the user was sent after feed position `after`, in feed order (`GET /v1/messages?after=`)."""
        return list(self.get(f"/v1/messages?after={after}")["messages"])

    def deliver(self, name: str) -> list[dict[str, Any]]:
        """Send the simulator's pending webhooks, let their coalescing window pass, and wait until each is handled
        (a run took it, or it was late): the events they became."""
        delivered = self.flush(name)
        self.jump(COALESCE)
        return self.handled(delivered)

    def jump_to(self, local: dt_time, zone: ZoneInfo) -> datetime:
        """Jump to the next `local` wall-clock time in `zone` (at least a second ahead); returns it."""
        now = self.clock.now().astimezone(zone)
        target = datetime.combine(now.date(), local, tzinfo=zone)
        if target <= now:
            target = datetime.combine(now.date() + timedelta(days=1), local, tzinfo=zone)
        self.jump(target - now)
        return target

    def sim(self, name: str, method: str, path: str, body: Any = None) -> Any:
        """A simulator's own API or its `/_sim` controls, over HTTP."""
        response = httpx.request(method, self.sim_urls[name] + path, json=body, timeout=30, trust_env=False)
        response.raise_for_status()
        return response.json()

    def effects(self, name: str, kind: str | None = None) -> list[dict[str, Any]]:
        """What the simulator applied, by its own records (`GET /_sim/records`)."""
        return list(self.sim(name, "GET", "/_sim/records" + (f"?kind={kind}" if kind else ""))["effects"])

    def faults(self, name: str, **knobs: Any) -> None:
        self.sim(name, "POST", "/_sim/faults", knobs)

    def flush(self, name: str) -> list[dict[str, Any]]:
        """Send the simulator's pending webhooks now; one result per send ({delivery_id, status_code, answer})."""
        return list(self.sim(name, "POST", "/_sim/webhooks/flush")["delivered"])

    def handled(self, delivered: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events these webhook sends became, once each is no longer pending (a run took it, or it was late)."""
        return [self.until(f"event {d['answer']['event_id']} to be handled", partial(self._handled, d["answer"]
                                                                                    ["event_id"])) for d in delivered]

    def _handled(self, event_id: str) -> dict[str, Any] | None:
        event: dict[str, Any] = self.get(f"/v1/events/{event_id}")
        return event if event["status"] != "pending" else None

    def jump(self, delta: timedelta) -> None:
        """Skip simulated time for everyone (the runtime, the simulators), then tell the server to look."""
        self.clock.advance(delta)
        self.api.post("/v1/wake")

    def until(self, what: str, probe: Callable[[], T | None], timeout: float | None = None) -> T:
        """Poll `probe` until it answers something truthy; raise `Gave` naming `what` after the timeout."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise Gave(f"gave up waiting for {what}")
            time.sleep(0.05)  # a poll tick inside a bounded loop

    def action_of(self, task_id: str, tool: str, verdict: str | None = None) -> dict[str, Any]:
        """The task's first action of `tool` (whose latest verdict is `verdict`, if given), once there is one."""
        def found() -> dict[str, Any] | None:
            return next((a for a in self.status(task_id)["actions"]
                         if a["tool"] == tool and verdict in (None, a["verdict"])), None)
        return self.until(f"a {tool} action" + (f" with verdict {verdict}" if verdict else ""), found)


@cache
def _migrated() -> bytes:
    """An empty database at the newest schema, made once per process: migrating costs more than a whole scenario's
    work, and every trial starts from the same empty records."""
    with tempfile.TemporaryDirectory(prefix="wakeful-eval-schema-") as tmp:
        path = Path(tmp) / DB_FILE
        engine = make_engine(f"sqlite:///{path}")
        migrate(engine)
        engine.dispose()
        return path.read_bytes()


def _fresh_database(data_dir: Path) -> None:
    path = data_dir / DB_FILE
    path.write_bytes(_migrated())
    path.chmod(0o600)


def _settings(data_dir: Path, urls: dict[str, str], secret: str, policy: str) -> Settings:
    policies = data_dir / "policies"
    shutil.copytree(EXAMPLE_POLICIES / "connectors", policies / "connectors")
    (policies / "policy.toml").write_text(policy)
    # A jump of the clock is an instant, not a stall: a run in flight across one must not be taken for dead, so the
    # session lease outlasts any jump a scenario makes.
    return Settings(data_dir=data_dir, database_url=None, policies_dir=policies, connector_urls=urls,
                    sources={name: SourceSettings(kind="generic", secret=SecretStr(secret), user="owner",
                                                  trust="verified_service", session_key=CORRELATION[name])
                             for name in urls},
                    proxy=False, computers=False, poll_interval=0.05, idle_poll_max=0.2, reconcile_interval=0.2,
                    connector_timeout=1.0, resend_after=timedelta(seconds=30), dispatch_backoff=timedelta(seconds=0.2),
                    sweep_interval=1.0, lease=timedelta(days=365), coalesce_seconds=COALESCE.total_seconds())


@contextmanager
def world(sims: Sequence[str], *, model: ModelAdapter, app_factory: AppFactory, policy: str = "",
          timeout: float = 30.0) -> Iterator[EvalWorld]:
    """Start everything for one scenario; stop it all (and remove the data directory) at the end."""
    clock = SimClock(running=True)
    secret = secrets.token_hex(16)
    with ExitStack() as stack:
        data_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="wakeful-eval-")))
        _fresh_database(data_dir)
        fleet = stack.enter_context(running(sims, clock=clock))
        urls = {name: r.url for name, r in fleet.items()}
        settings = _settings(data_dir, urls, secret, policy)
        registry = load_registry(settings)
        harness = Harness(model, registry=registry, instructions=None, max_tokens_per_run=settings.run_max_tokens)
        runtime = Runtime(settings, handler=harness, clock=clock, registry=registry)
        runtime.prepare()
        with write(runtime.engine) as conn:
            owner, _ = ensure_user(conn, name="owner", now=clock.now())
            token = issue_token(conn, user_id=owner)
        runtime.start()
        stack.callback(runtime.stop)
        app_url = stack.enter_context(serve(app_factory(runtime)))
        for name, started in fleet.items():
            started.sim.webhooks.configure(f"{app_url}/v1/hooks/{name}", secret)
            started.sim.webhooks.signing_clock = clock
        api = stack.enter_context(httpx.Client(base_url=app_url, headers={"Authorization": f"Bearer {token}"},
                                               timeout=30, trust_env=False))
        yield EvalWorld(clock=clock, api=api, sims={n: r.sim for n, r in fleet.items()}, sim_urls=urls,
                        timeout=timeout)
