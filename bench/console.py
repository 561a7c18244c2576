"""Console page latency for one user with 10,000 tasks and 100,000 ledger rows (events, runs, steps, actions with
verdicts, messages), p50/p95 per page over real HTTP on loopback, beside `GET /healthz` and the JSON API's
`GET /v1/tasks/{id}` from the same server in the same run. Target: every page's p95 at most 100 ms.

The records are written straight into a fresh SQLite database (the shapes the runtime writes); the server is
`create_app` under uvicorn on a thread of this process, signed in through the console's own form.
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from _common import ROOT, Row, Table, bench_args, fmt_ms, percentile, print_and_save, reproduce
from sqlalchemy import Engine

from wakeful.proxy.clock import FakeClock
from wakeful.server.faces.http import QuietServer, create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.tables import (
    actions,
    decisions,
    events,
    outbox,
    runs,
    sessions,
    task_versions,
    tasks,
    verdicts,
    waits,
)
from wakeful.server.store.users import ensure_user

TARGET_P95 = 0.100


def fill(engine: Engine, user_id: str, *, n_tasks: int, n_rows: int, now: datetime) -> dict[str, str]:
    """`n_tasks` tasks and about `n_rows` ledger rows for one user; answers IDs the pages are asked about."""
    per_task = max(1, n_rows // n_tasks // 5)  # five kinds of row per unit below
    with write(engine) as conn:
        batch: dict[Any, list[dict[str, Any]]] = {t: [] for t in (sessions, tasks, task_versions, events, runs,
                                                                  decisions, actions, verdicts, waits, outbox)}
        for t in range(n_tasks):
            at = now - timedelta(seconds=n_tasks - t)
            sid, tid = f"ses_{t:06d}", f"tsk_{t:06d}"
            batch[sessions].append({"id": sid, "user_id": user_id, "fencing_token": 1, "created_at": at})
            batch[tasks].append({"id": tid, "user_id": user_id, "session_id": sid, "title": f"task {t}",
                                 "state": "active", "current_version": 1, "created_at": at})
            batch[task_versions].append({"id": f"tv_{t:06d}", "task_id": tid, "version": 1, "goal": f"goal {t}",
                                         "constraints": "{}", "completion": "[]", "created_by": "user",
                                         "created_at": at})
            for k in range(per_task):
                n = f"{t:06d}_{k:03d}"
                batch[events].append({"id": f"evt_{n}", "user_id": user_id, "source": "hook", "source_id": n,
                                      "session_id": sid, "kind": "webhook", "trust": "untrusted", "payload": "{}",
                                      "status": "processed", "attempts": 1, "run_id": f"run_{n}", "received_at": at,
                                      "authority": "source:hook"})
                batch[runs].append({"id": f"run_{n}", "session_id": sid, "user_id": user_id, "fencing_token": 1,
                                    "worker": "bench", "outcome": "completed", "steps": 1, "started_at": at,
                                    "ended_at": at})
                batch[decisions].append({"id": f"dec_{n}", "run_id": f"run_{n}", "session_id": sid, "step": 0,
                                         "proposal": json.dumps({"text": "nothing new"}), "created_at": at})
                batch[actions].append({"id": f"act_{n}", "user_id": user_id, "task_id": tid, "task_version": 1,
                                       "tool": "merchant__cancel_renewal", "content": json.dumps({"n": n}),
                                       "content_hash": f"{t:064d}", "risk": "ask", "created_at": at})
                pending = k == 0 and t % 1000 == 0  # ten waiting for approval, the rest long decided
                if pending:
                    batch[waits].append({"id": f"wai_{n}", "user_id": user_id, "session_id": sid, "task_id": tid,
                                         "match_key": f"approval:act_{n}", "kind": "approval", "state": "pending",
                                         "deadline": now + timedelta(days=1), "created_at": at,
                                         "authority": "user"})
                batch[verdicts].append({"id": f"vrd_{n}", "action_id": f"act_{n}",
                                        "verdict": "needs_approval" if pending else "refused",
                                        "code": "needs_approval" if pending else "task_paused", "reasons": "[]",
                                        "created_at": at})
                batch[outbox].append({"id": f"msg_{n}", "user_id": user_id, "kind": "user_message",
                                      "session_id": sid, "body": json.dumps({"text": f"update {n}"}),
                                      "state": "sent", "next_attempt_at": at, "created_at": at, "sent_at": at,
                                      "seq": t * per_task + k + 1})
            if len(batch[events]) >= 20_000 or t == n_tasks - 1:
                for table, rows in batch.items():
                    if rows:
                        conn.execute(table.insert(), rows)
                    rows.clear()
    return {"task": f"tsk_{n_tasks // 2:06d}", "action": "act_000000_000", "run": f"run_{n_tasks // 2:06d}_000"}


def measure(client: httpx.Client, path: str, n: int, headers: dict[str, str] | None = None) -> list[float]:
    for _ in range(3):
        client.get(path, headers=headers).raise_for_status()
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        answer = client.get(path, headers=headers)
        samples.append(time.perf_counter() - start)
        answer.raise_for_status()
    return samples


def run(quick: bool) -> list[Table]:
    n_tasks, n_rows, n = (2_000, 20_000, 20) if quick else (10_000, 100_000, 100)
    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(data_dir=Path(tmp), proxy=False, computers=False, policies_dir=ROOT / "policies")
        engine = make_engine(settings.db_url)
        migrate(engine)
        clock = FakeClock()
        clock.set(datetime(2026, 12, 2, 12, 0, tzinfo=UTC))
        with write(engine) as conn:
            user_id, token = ensure_user(conn, name="bench", now=clock.now())
        assert token is not None
        started = time.perf_counter()
        ids = fill(engine, user_id, n_tasks=n_tasks, n_rows=n_rows, now=clock.now())
        filled = time.perf_counter() - started
        runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine)
        runtime.prepare()
        server = QuietServer(uvicorn.Config(create_app(runtime, manage_runtime=False), host="127.0.0.1", port=0,
                                            log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        try:
            with httpx.Client(base_url=url, timeout=30, follow_redirects=True) as client:
                form = client.get("/signin").text
                csrf = re.search(r'name="csrf" value="([^"]+)"', form)
                assert csrf is not None
                client.post("/signin", data={"csrf": csrf.group(1), "token": token}).raise_for_status()
                older = re.search(r'id="next" href="([^"]+)"', client.get("/tasks").text)
                assert older is not None
                pages = {"home /": "/", "approvals": "/approvals", "approval card": f"/approvals/{ids['action']}",
                         "tasks, first page": "/tasks", "tasks, second page": older.group(1).replace("&amp;", "&"),
                         "one task": f"/tasks/{ids['task']}", "activity: events": "/activity",
                         "activity: runs": "/activity?view=runs", "activity: outbox": "/activity?view=outbox",
                         "events filtered by status": "/activity?status=pending", "one run": f"/runs/{ids['run']}"}
                health = measure(client, "/healthz", n)
                api = measure(client, f"/v1/tasks/{ids['task']}", n, headers={"Authorization": f"Bearer {token}"})
                rows = []
                for name, path in pages.items():
                    samples = measure(client, path, n)
                    p95 = percentile(samples, 95)
                    rows.append(Row(f"{name}: p50 / p95", f"{fmt_ms(percentile(samples, 50))} / {fmt_ms(p95)}",
                                    f"{fmt_ms(percentile(api, 95))} (API p95)", "p95 <= 100 ms",
                                    "met" if p95 <= TARGET_P95 else "MISSED"))
                rows.append(Row("GET /healthz: p50 / p95", f"{fmt_ms(percentile(health, 50))} / "
                                f"{fmt_ms(percentile(health, 95))}", "-"))
        finally:
            server.should_exit = True
            thread.join(timeout=30)
            engine.dispose()
    return [Table(title=f"Console pages, one user with {n_tasks:,} tasks and ~{n_rows:,} ledger rows, {n} requests "
                        "per page (baseline: the JSON API's GET /v1/tasks/{id}, same server, same run)",
                  rows=rows, reproduce=reproduce("console.py", quick),
                  notes=[f"records written in {filled:.1f} s; SQLite; server and client share this process's cores"])]


if __name__ == "__main__":
    args = bench_args(__doc__ or "")
    print_and_save(run(args.quick), "console.txt")
