"""The `wakeful` command line, run as a user runs it (the console script in a subprocess)."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from wakeful.server.store.db import newest_revision

WAKEFUL = str(Path(sys.executable).parent / "wakeful")


def run(data_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_") and k != "ANTHROPIC_API_KEY"} | {
        "WAKEFUL_DATA_DIR": str(data_dir)}
    result = subprocess.run([WAKEFUL, *args], env=env, capture_output=True, text=True, timeout=60)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def test_token_prints_only_a_new_token_and_the_old_one_stops_working(tmp_path: Path) -> None:
    first = run(tmp_path, "token").stdout.strip()
    second = run(tmp_path, "token").stdout.strip()
    assert first.startswith("wk_") and second.startswith("wk_") and first != second
    database = (tmp_path / "wakeful.db").read_bytes()
    assert first.encode() not in database and second.encode() not in database  # only digests are stored


def test_stop_and_start_are_recorded_and_reported_by_status(tmp_path: Path) -> None:
    run(tmp_path, "migrate")
    assert "STOP recorded for everything" in run(tmp_path, "stop", "--reason", "going on holiday").stdout
    assert "stop: in force for everything" in run(tmp_path, "status").stdout
    assert "START recorded for everything" in run(tmp_path, "start").stdout
    assert "stop: not in force" in run(tmp_path, "status").stdout


def test_stopping_an_unknown_user_is_a_clear_error(tmp_path: Path) -> None:
    result = run(tmp_path, "stop", "--user", "nobody", check=False)
    assert result.returncode != 0 and "unknown_user" in result.stderr + result.stdout


def test_user_add_prints_a_token_once_and_refuses_a_second_time(tmp_path: Path) -> None:
    assert run(tmp_path, "user-add", "alice").stdout.startswith("wk_")
    again = run(tmp_path, "user-add", "alice", check=False)
    assert again.returncode == 2 and "user_exists" in again.stderr


def test_user_add_admin_makes_an_admin_and_the_owner_the_token_command_creates_is_one(tmp_path: Path) -> None:
    run(tmp_path, "token")
    run(tmp_path, "user-add", "alice")
    assert run(tmp_path, "user-add", "--admin", "root").stdout.startswith("wk_")
    with sqlite3.connect(tmp_path / "wakeful.db") as db:
        admins = dict(db.execute("SELECT name, admin FROM users").fetchall())
    assert admins == {"owner": 1, "alice": 0, "root": 1}


def test_a_typo_in_the_config_file_is_reported_with_the_field(tmp_path: Path) -> None:
    (tmp_path / "wakeful.toml").write_text('[sources.gh]\nkind = "gitlab"\nsecret = "x"\n')
    result = run(tmp_path, "status", check=False)
    assert result.returncode == 2
    assert f"wakeful: invalid_settings: sources.gh.kind ({tmp_path / 'wakeful.toml'} line 2)" in result.stderr


def test_migrate_creates_the_schema(tmp_path: Path) -> None:
    assert run(tmp_path, "migrate").stdout == f"schema is at revision {newest_revision()}, the newest\n"
    assert (tmp_path / "wakeful.db").exists()


def test_the_demo_runs_the_cancellation_end_to_end_with_a_dropped_response(tmp_path: Path) -> None:
    out = run(tmp_path, "demo").stdout
    for line in ("approval_required", "approved by user:owner", "persisted before sending",
                 "unknown None ReadTimeout", "reconcile → accepted", "verify → accepted", "completion → accepted",
                 "merchant's own records: 1 cancellation(s) of sub_1; renewal is now off"):
        assert line in out, line
    assert "receipt_delivered=None" not in out


def test_the_signed_delivery_in_the_webhook_docs_is_accepted_then_recognised_as_a_duplicate(tmp_path: Path) -> None:
    import json
    import re

    from tests.support.serve import ServeProcess

    doc = (Path(__file__).resolve().parents[2] / "docs" / "webhooks.md").read_text()
    snippet = re.search(r"## Sending a signed delivery by hand.*?```bash\n(.*?)```", doc, re.S)
    assert snippet
    env = {"WAKEFUL_DATA_DIR": str(tmp_path), "WAKEFUL_SOURCES__DEMO__KIND": "generic",
           "WAKEFUL_SOURCES__DEMO__SECRET": "change-me"}
    with ServeProcess(env, log_path=tmp_path / "serve.log") as server:
        shell_env = {**os.environ, "WAKEFUL_PORT": str(server.port)}
        answers = [json.loads(subprocess.run(["bash", "-c", snippet.group(1)], env=shell_env, capture_output=True,
                                             text=True, check=True, timeout=30).stdout) for _ in range(2)]
    assert answers[0]["duplicate"] is False and answers[0]["event_id"].startswith("ev_")
    assert answers[1] == {**answers[0], "duplicate": True, "status": answers[1]["status"]}
