"""`wakeful demo` keeps its records where the user says, runs again on the same data directory, and never writes into
a deployment's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

WAKEFUL = str(Path(sys.executable).parent / "wakeful")


def wakeful(*args: str | Path, env: dict[str, str]) -> str:
    result = subprocess.run([WAKEFUL, *map(str, args)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def clean_env(**more: str | Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}
    return env | {k: str(v) for k, v in more.items()}


def delegated_task(out: str) -> str:
    match = re.search(r"^delegated: (task_\w+) ", out, re.M)
    assert match, out
    return match.group(1)


def test_the_demo_keeps_its_records_in_the_data_directory_named_by_the_environment(tmp_path: Path) -> None:
    env = clean_env(WAKEFUL_DATA_DIR=tmp_path / "data")
    task = delegated_task(wakeful("demo", env=env))
    assert (tmp_path / "data" / "wakeful.db").is_file()
    history = wakeful("ledger", task, env=env)  # the records outlive the demo, for the other commands to read
    assert "reconcile → accepted" in history and "completion → accepted" in history


def test_the_demo_runs_again_on_the_same_data_directory_as_a_new_delegation(tmp_path: Path) -> None:
    env = clean_env(HOME=tmp_path / "home")
    data = tmp_path / "data"
    first = wakeful("demo", "--data-dir", data, env=env)
    second = wakeful("demo", "--data-dir", data, env=env)
    assert "merchant's own records: 1 cancellation(s) of sub_1; renewal is now off" in second
    tasks = delegated_task(first), delegated_task(second)
    assert tasks[0] != tasks[1]
    for task in tasks:
        history = wakeful("ledger", task, "--data-dir", data, env=env)
        assert "completion → accepted" in history
        assert len(re.findall(r"^\s*\S+\s+approval\s", history, re.M)) == 1  # each run approved its own action


def test_the_demo_refuses_a_data_directory_that_holds_a_deployment_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    env = clean_env(WAKEFUL_DATA_DIR=tmp_path / "data")  # exported for `wakeful serve`, then the demo is tried
    wakeful("token", env=env)
    database = tmp_path / "data" / "wakeful.db"
    before = database.read_bytes()
    refused = subprocess.run([WAKEFUL, "demo"], env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "not_a_demo_directory" in refused.stderr and "Traceback" not in refused.stderr
    assert "delegated:" not in refused.stdout
    assert database.read_bytes() == before
