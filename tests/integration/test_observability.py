"""What an operator watches (issue 19): `/healthz`, `/readyz` (the database, the egress proxy, the drain after
SIGTERM), Prometheus metrics at `/metrics` that move with real deliveries and runs, and JSON log lines.

Real HTTP on loopback: the app on a thread of this process (`serving`), or a `wakeful serve` process; on SQLite and
PostgreSQL where the records are read. The exposition is parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Engine

from tests.support.docs import DOCS
from tests.support.polling import wait_until
from tests.support.postgres import postgres_cluster, postgres_database
from tests.support.serve import ServeProcess, free_port, serving
from wakeful.server.core.signatures import sign
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import make_engine, migrate

BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
SECRET = "test-secret"


def scrape(http: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of `/metrics`, by name and labels."""
    answer = http.get("/metrics")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(answer.text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (0 when there is none yet)."""
    return sum(v for (n, have), v in samples.items() if n == name and set(labels.items()) <= have)


def deliver(http: httpx.Client, delivery_id: str, *, secret: str = SECRET, source: str = "hook") -> httpx.Response:
    body = json.dumps({"session_key": f"s-{delivery_id}", "text": "hello"}).encode()
    headers = sign("generic", secret=secret.encode(), body=body, now=time.time(), delivery_id=delivery_id)
    return http.post(f"/v1/hooks/{source}", content=body, headers=headers)


@pytest.fixture
def started(settings: Settings, engine: Engine) -> Iterator[tuple[Runtime, httpx.Client]]:
    """The whole server in this process (its loops running, the real clock), on a loopback port."""
    live = settings.model_copy(update={"coalesce_seconds": 0.0, "computers": False})
    runtime = Runtime(live, handler=EchoHandler(), engine=engine)
    runtime.prepare()
    with serving(create_app(runtime)) as url, httpx.Client(base_url=url, timeout=10) as http:
        yield runtime, http


@BOTH
def test_healthz_and_readyz_answer_ok_when_the_database_answers(started: tuple[Runtime, httpx.Client]) -> None:
    _, http = started
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "checks": {"database": "ok", "draining": "ok"}}


@BOTH
def test_metrics_move_with_real_deliveries_and_the_runs_that_take_them(
        started: tuple[Runtime, httpx.Client], owner: str) -> None:
    runtime, http = started
    before = scrape(http)
    assert deliver(http, "d-1").json()["duplicate"] is False
    assert deliver(http, "d-1").json()["duplicate"] is True
    assert deliver(http, "d-2", secret="not-the-secret").status_code == 401
    assert deliver(http, "d-3", source="nobody-configured-this").status_code == 404

    def ran() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        now = scrape(http)
        done = value(now, "wakeful_runs_total", outcome="completed") > value(before, "wakeful_runs_total",
                                                                              outcome="completed")
        return now if done else None

    after = wait_until(ran, 30, "the delivery's run to be counted")
    moved = [(name, labels, value(after, name, **labels) - value(before, name, **labels)) for name, labels in [
        ("wakeful_deliveries_total", {"source": "hook", "result": "recorded"}),
        ("wakeful_deliveries_total", {"source": "hook", "result": "duplicate"}),
        ("wakeful_deliveries_total", {"source": "hook", "result": "signature_mismatch"}),
        ("wakeful_deliveries_total", {"source": "unknown", "result": "unknown_source"}),
        ("wakeful_ack_seconds_count", {}),
        ("wakeful_event_to_run_start_seconds_count", {}),
    ]]
    assert [by for _, _, by in moved] == [1, 1, 1, 1, 4, 1], moved
    assert value(after, "wakeful_runs_total", outcome="completed") >= 1
    # Stored state is counted from the database at the scrape: the run's reply went out (no notify_url: the feed).
    assert ("wakeful_events_pending", frozenset()) in after
    assert ("wakeful_outbox_depth", frozenset({("state", "pending")})) in after
    assert ("wakeful_waits_pending", frozenset()) in after and ("wakeful_timers_active", frozenset()) in after
    text = http.get("/metrics").text
    assert owner not in text and "owner" not in text and "nobody-configured-this" not in text


def test_metrics_can_be_turned_off(settings: Settings, engine: Engine) -> None:
    runtime = Runtime(settings.model_copy(update={"metrics": False}), handler=EchoHandler(), engine=engine)
    with serving(create_app(runtime, manage_runtime=False)) as url:
        answer = httpx.get(f"{url}/metrics")
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


def test_readyz_is_503_naming_the_proxy_when_nothing_answers_on_its_port(settings: Settings, engine: Engine) -> None:
    port = free_port()
    runtime = Runtime(settings.model_copy(update={"proxy": True, "proxy_port": port, "computers": False}),
                      handler=EchoHandler(), engine=engine)
    with serving(create_app(runtime, manage_runtime=False)) as url:
        answer = httpx.get(f"{url}/readyz")
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "not_ready"
    assert error["checks"]["database"] == "ok" and error["checks"]["draining"] == "ok"
    assert error["checks"]["proxy"].startswith(f"nothing answers on 127.0.0.1:{port}")
    assert f"proxy: nothing answers on 127.0.0.1:{port}" in error["message"]


def test_readyz_is_503_naming_the_database_when_postgresql_is_gone(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, proxy=False, computers=False, sources={})
    with postgres_cluster() as server:  # a cluster of its own: this test stops it
        engine = make_engine(postgres_database(server))
        migrate(engine)
        runtime = Runtime(settings, handler=EchoHandler(), engine=engine)
        app = serving(create_app(runtime, manage_runtime=False))
        url = app.__enter__()
        try:
            assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        except BaseException:
            app.__exit__(None, None, None)
            raise
    try:  # the cluster is stopped and its files are gone
        answer = httpx.get(f"{url}/readyz", timeout=10)
        assert answer.status_code == 503, answer.text
        checks = answer.json()["error"]["checks"]
        assert checks["database"] != "ok" and checks["draining"] == "ok"
        assert httpx.get(f"{url}/healthz", timeout=10).json() == {"status": "ok"}  # alive, not ready
    finally:
        app.__exit__(None, None, None)
        engine.dispose()


def _observability_commands() -> str:
    """The bash block of docs/deploy.md's Observability section: the commands a test must run."""
    block = re.search(r"## Observability.*?```bash\n(.*?)```", (DOCS / "deploy.md").read_text(), re.S)
    assert block, "docs/deploy.md no longer shows the probes"
    return block.group(1)


def _after_a_run(http: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
    samples = scrape(http)
    return samples if value(samples, "wakeful_runs_total", outcome="completed") else None


def test_serve_drains_on_sigterm_sums_metrics_across_processes_and_logs_json(tmp_path: Path) -> None:
    env = {"WAKEFUL_DATA_DIR": str(tmp_path / "data"), "WAKEFUL_COMPUTERS": "false", "WAKEFUL_LOG_FORMAT": "json",
           "WAKEFUL_DRAIN_SECONDS": "120", "WAKEFUL_COALESCE_SECONDS": "0", "WAKEFUL_ECHO_WITHOUT_MODEL": "true",
           "WAKEFUL_SOURCES__HOOK__KIND": "generic", "WAKEFUL_SOURCES__HOOK__SECRET": SECRET}
    with ServeProcess(env, log_path=tmp_path / "serve.log") as server, \
            httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.get("/readyz").status_code == 200
        assert deliver(http, "d-1").status_code == 200
        after = wait_until(lambda: _after_a_run(http), 30, "the run to be counted")
        assert value(after, "wakeful_deliveries_total", source="hook", result="recorded") == 1
        assert list((tmp_path / "data" / "run" / "metrics").glob("*.db")), "serve keeps its metrics in files"
        shown = _observability_commands()
        said = subprocess.run(["bash", "-c", shown], env={**os.environ, "WAKEFUL_PORT": str(server.port)},
                              capture_output=True, text=True, check=True, timeout=30).stdout
        alive, at = json.JSONDecoder().raw_decode(said)  # curl adds no newline after a JSON body
        ready, at = json.JSONDecoder().raw_decode(said, at)
        assert alive == {"status": "ok"} and ready["status"] == "ready"
        assert said[at:].strip() == 'wakeful_deliveries_total{result="recorded",source="hook"} 1.0'

        server._process.send_signal(signal.SIGTERM)  # Popen signals its own PID
        drained = wait_until(lambda: (a := http.get("/readyz")).status_code == 503 and a, 30, "/readyz to fail")
        assert drained.json()["error"]["checks"]["draining"] == "the process is stopping (SIGTERM)"
        assert http.get("/healthz").json() == {"status": "ok"}  # still alive while it drains
        assert server.returncode is None

        server._process.send_signal(signal.SIGTERM)  # a second one stops it now
        assert server.wait_exit(30) is not None, server.log()
    lines = [line for line in server.log().splitlines() if line.strip()]
    token = [line for line in lines if line.startswith("wk_")]  # stdout, in the same file here
    assert len(token) == 1, "the owner's token, once"
    logged = [json.loads(line) for line in lines if line not in token]  # stderr: nothing but JSON objects
    assert all({"time", "level", "logger", "message"} <= set(entry) for entry in logged)
    said = [entry["message"] for entry in logged]
    assert "Created user 'owner'. Its API token is on stdout, shown once (`wakeful token` issues a new one)." in said
    assert any(m.startswith(f"wakeful serving on http://127.0.0.1:{server.port}") for m in said)
    assert any(m.startswith("wakeful worker running") for m in said)
    assert any(entry["message"].startswith("SIGTERM: draining for 120 s") for entry in logged)
    assert SECRET not in server.log()


OBSERVE_ELSEWHERE = """
import sys
from pathlib import Path
from wakeful.server.observe import metrics
metrics.share_across_processes(Path(sys.argv[1]), clean=False)
metrics.run_ended("completed")
metrics.run_ended("failed")
"""


@BOTH
def test_what_another_process_observed_shows_on_this_ones_metrics(tmp_path: Path, engine: Engine) -> None:
    """What `wakeful serve`'s worker process observes is summed by its API process (multiprocess mode); here two
    processes of our own stand in for them, and a third reads the sum from the same directory and database."""
    shared = tmp_path / "metrics"
    shared.mkdir()
    for _ in range(2):
        subprocess.run([sys.executable, "-c", OBSERVE_ELSEWHERE, str(shared)], check=True, timeout=60)
    url = engine.url.render_as_string(hide_password=False)
    read_it = ("import sys; from pathlib import Path; from wakeful.server.observe import metrics; "
               "from wakeful.server.store.db import make_engine; "
               "metrics.share_across_processes(Path(sys.argv[1]), clean=False); "
               "sys.stdout.write(metrics.exposition(make_engine(sys.argv[2])).decode())")
    text = subprocess.run([sys.executable, "-c", read_it, str(shared), url], check=True, timeout=60,
                          capture_output=True, text=True).stdout
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert value(samples, "wakeful_runs_total", outcome="completed") == 2
    assert value(samples, "wakeful_runs_total", outcome="failed") == 2
    assert value(samples, "wakeful_events_pending") == 0  # and the stored state beside them
