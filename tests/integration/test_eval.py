"""`wakeful eval` as a user runs it: a real process, real simulators and a real HTTP app on loopback, judged by the
simulators' records and the ledger; a run whose outcome a simulator fault breaks must fail."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from tests.support.docs import doc_commands
from tests.support.serve import WAKEFUL
from wakeful.server.evals.catalog import SCENARIOS


def wakeful_eval(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_") and k != "ANTHROPIC_API_KEY"}
    return subprocess.run([str(WAKEFUL), "eval", *args], env=clean, capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_the_docs_eval_commands_are_the_ones_these_tests_run() -> None:
    assert doc_commands("evaluation.md", "eval") == [["--list"], ["--json", "report.json"],
                                    ["cancel-lost-response", "--fault", "merchant.fail_before_commit=1000",
                                     "--timeout", "4"],
                                    ["--model", "anthropic", "-k", "2", "-n", "3"]]


def checks_of(document: dict[str, Any], scenario: str) -> dict[str, dict[str, Any]]:
    (trial, *_) = [t for t in document["trials"] if t["scenario"] == scenario]
    return {c["name"]: c for c in trial["checks"]}


def test_every_scenario_passes_and_none_is_left_pending(tmp_path: Path) -> None:
    result = wakeful_eval("--json", "report.json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "report.json").read_text())
    assert {n: s["status"] for n, s in document["scenarios"].items()} == dict.fromkeys(SCENARIOS, "passed")
    assert document["pending"] == []
    assert document["pass^k"] == 1.0 and document["failed"] == 0
    cancel = checks_of(document, "cancel-lost-response")["the merchant applied exactly one cancellation"]
    assert [e["kind"] for e in cancel["evidence"]] == ["cancel_renewal"]  # the merchant's own record
    tickets = checks_of(document, "hk-d0-ticketing-timeout")["the airline issued exactly one ticket"]
    assert [e["kind"] for e in tickets["evidence"]] == ["ticket"]
    assert_the_trip_is_judged_by_the_records(document)
    assert all(t["seconds"] > 0 for t in document["trials"] if t["status"] == "passed")
    assert "overall pass^1: 1.000" in result.stdout
    assert f"[{len(SCENARIOS)}/{len(SCENARIOS)}]" in result.stderr  # progress, one line per trial


def assert_the_trip_is_judged_by_the_records(document: dict[str, Any]) -> None:
    """The new days' evidence is what the simulators and the HTTP API recorded, not the agent's word."""
    wait = checks_of(document, "hk-d0-two-day-wait")
    [follow_up] = wait["one follow-up, to the client, in the thread (the mail simulator's records)"]["evidence"]
    assert (follow_up["kind"], follow_up["target"], follow_up["to"]) == ("send", "thr-hk-meeting",
                                                                         ["assistant@client.example"])
    assert wait["the reply after the deadline was kept and woke nothing"]["evidence"]["status"] == "late"
    quiet = checks_of(document, "hk-d2-d8-quiet-wait")
    reasons = quiet["silent on the six days nothing changed, each silence with its reason"]["evidence"]["reasons"]
    assert sorted(reasons) == ["D2", "D3", "D4", "D5", "D7", "D8"]
    night = checks_of(document, "hk-d9-typhoon-night")
    assert night["nothing reached the user before 07:30"]["evidence"] == []
    [summary] = night["one summary at 07:30 carrying the night's news"]["evidence"]
    assert summary["body"]["kind"] == "summary" and summary["seq"] >= 1
    assert len(night["the advisory and both cancellation notices were one run"]["evidence"]) == 3
    closure = checks_of(document, "hk-d12-closure")
    assert [k["released_at"] is not None for k in closure["the trip's keys were released"]["evidence"]] == [True] * 2


def test_a_merchant_that_never_commits_fails_the_scenario_with_the_evidence_and_exits_non_zero(
        tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = wakeful_eval(*doc_commands("evaluation.md", "eval")[2], "--json", str(report))
    assert result.returncode == 1, result.stdout + result.stderr
    document = json.loads(report.read_text())
    assert document["scenarios"]["cancel-lost-response"]["status"] == "failed"
    (failed,) = [c for c in document["trials"][0]["checks"] if not c["passed"]]
    assert failed["evidence"]["error"] == "gave up waiting for the goal verified"
    assert any("merchant__cancel_renewal" in line for line in failed["evidence"]["ledger_tail"])
    assert "failed" in result.stdout.splitlines()[1]


def test_the_list_names_every_scenario_and_what_the_pending_ones_need() -> None:
    result = wakeful_eval(*doc_commands("evaluation.md", "eval")[0])
    assert result.returncode == 0, result.stderr
    listed = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert set(listed) == set(SCENARIOS)
    assert {line.split()[1] for line in listed.values()} == {"ready"}
    assert "D12" in listed["hk-d12-closure"]


def test_the_real_model_is_refused_clearly_without_a_key() -> None:
    result = wakeful_eval(*doc_commands("evaluation.md", "eval")[3])
    assert result.returncode == 2
    assert "no_model_key" in result.stderr and "ANTHROPIC_API_KEY" in result.stderr
