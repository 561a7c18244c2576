"""The memory commands docs/memory.md shows, run as a user runs them (the console script, in the order the doc gives
them) beside a running `wakeful serve` on the same data directory, whose HTTP API then answers what the commands
did; and the doc's HTTP examples, run with bash exactly as written."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.test_cli import run
from tests.support.docs import DOCS, doc_commands
from tests.support.serve import ServeProcess
from wakeful.proxy.clock import SystemClock
from wakeful.server import memory
from wakeful.server.errors import WakefulError
from wakeful.server.memory.committer import try_propose
from wakeful.server.store.db import make_engine, write
from wakeful.server.store.users import user_id_by_name

PLACEHOLDERS = ("TASK_ID", "HYPOTHESIS_ID", "CANDIDATE_ID", "INFERENCE_ID", "DERIVED_ID", "MEMORY_ID")


@dataclass
class Served:
    data: Path
    url: str
    auth: dict[str, str]

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}{path}", params=params, headers=self.auth, timeout=10)
        assert response.status_code == 200, response.text
        return response.json()

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = httpx.post(f"{self.url}{path}", json=body, headers=self.auth, timeout=10)
        assert response.status_code in (200, 201), response.text
        return response.json()

    def agent_proposes(self, task_id: str, **fields: Any) -> str:
        """What the agent's `remember` tool does, through the same committer, on the server's database."""
        engine = make_engine(f"sqlite:///{self.data / 'wakeful.db'}")
        try:
            with write(engine) as conn:
                stored = try_propose(conn, user_id=user_id_by_name(conn, "owner"), proposal=memory.parse_proposal(
                    fields), actor=memory.Actor(kind=memory.ActorKind.AGENT, task_id=task_id, name="mcp"),
                    now=SystemClock().now())
        finally:
            engine.dispose()
        assert not isinstance(stored, WakefulError), stored
        return stored.memory_id


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    with ServeProcess({"WAKEFUL_DATA_DIR": str(tmp_path)}, log_path=tmp_path / "serve.log") as server:
        token = run(tmp_path, "token").stdout.strip()
        yield Served(data=tmp_path, url=server.url, auth={"Authorization": f"Bearer {token}"})


def _learnt(served: Served) -> dict[str, str]:
    """A trip, the user's words about it, and what the agent inferred from them: the doc's placeholders."""
    task_id = served.post("/v1/tasks", {"title": "fly to Hong Kong"})["task_id"]
    said = served.post(f"/v1/tasks/{task_id}/messages", {"text": "the 07:00 flight is fine, extra legroom please"})
    evidence = [{"type": "event", "id": said["event_id"]}]
    guess = {"form": "hypothesis", "relation": "prefers", "scope": "always", "confidence": 0.6, "evidence": evidence}
    inference = served.agent_proposes(task_id, **guess, text="the user prefers early flights",
                                      subject="flight.departure", value="early")
    return {
        "TASK_ID": task_id,
        "HYPOTHESIS_ID": served.agent_proposes(task_id, **guess, text="the user prefers extra legroom",
                                               subject="seat.legroom", value="extra"),
        "CANDIDATE_ID": served.agent_proposes(task_id, **guess, text="the user prefers morning meals",
                                              subject="meal", value="breakfast"),
        "INFERENCE_ID": inference,
        "DERIVED_ID": served.agent_proposes(task_id, form="skill", text="when rebooking, take the earliest flight",
                                            subject="rebooking", relation="procedure", value="earliest first",
                                            scope="always", derived_from=[inference]),
    }


def test_the_memory_commands_in_the_docs_run_in_order_and_the_http_api_sees_what_they_did(served: Served) -> None:
    ids = _learnt(served)
    commands = doc_commands("memory.md", "memory")
    assert {c[0] for c in commands} == {"list", "show", "add", "confirm", "reject", "edit", "correct", "forget",
                                        "reviewed"}, "the doc no longer shows every memory command"
    outputs = []
    for args in commands:
        if "MEMORY_ID" in args and "MEMORY_ID" not in ids:
            raise AssertionError("the doc uses MEMORY_ID before it adds a record")
        result = run(served.data, "memory", *[ids.get(a, a) for a in args])
        outputs.append(result.stdout)
        if args[0] == "add" and "MEMORY_ID" not in ids:
            ids["MEMORY_ID"] = re.match(r"(mem_\w+): active preference v1$", result.stdout.strip()).group(1)  # type: ignore[union-attr]
    by_command = dict(zip([" ".join(c[:2]) if c[0] == "list" else c[0] for c in commands], outputs, strict=True))
    assert ids["HYPOTHESIS_ID"] in by_command["list --state"] and "pending hypothesis" in by_command["list --state"]
    assert f"{ids['DERIVED_ID']} v1 retired REVIEW (invalidated) skill" in by_command["list --review"]
    assert f"invalidated 1 derived record(s): {ids['DERIVED_ID']}" in by_command["correct"]

    confirmed = served.get(f"/v1/memory/{ids['HYPOTHESIS_ID']}")["record"]
    assert (confirmed["form"], confirmed["state"], confirmed["speaker"]) == ("preference", "active", "agent")
    assert confirmed["confirmed_by"]
    assert served.get(f"/v1/memory/{ids['CANDIDATE_ID']}")["record"]["retire_reason"] == "rejected"
    window = served.get(f"/v1/memory/{ids['MEMORY_ID']}")
    assert [(v["value"], v["retire_reason"]) for v in window["versions"]] == [("window", "superseded"),
                                                                             ("aisle", "forgotten")]
    assert served.get(f"/v1/memory/{ids['INFERENCE_ID']}")["record"]["retire_reason"] == "corrected"
    derived = served.get(f"/v1/memory/{ids['DERIVED_ID']}")["record"]
    assert (derived["retire_reason"], derived["review"]) == ("invalidated", False)  # reviewed by the last command
    statements = served.get("/v1/memory", form="statement")["records"]
    assert [(s["speaker"], s["text"]) for s in statements] == [("user", "I don't prefer early flights")]
    in_force = served.get("/v1/memory", task_id=ids["TASK_ID"], form="preference", state="active")["records"]
    assert ("task", ids["TASK_ID"], "aisle") in [(r["scope"], r["scope_ref"], r["value"]) for r in in_force]

    ledger = run(served.data, "ledger", ids["TASK_ID"]).stdout
    for change in ("committed", "confirmed", "rejected", "corrected"):
        assert re.search(rf"^\S+\s+memory\s+{change} mem_", ledger, re.M), change
    entries = json.loads(run(served.data, "ledger", ids["TASK_ID"], "--json").stdout)["entries"]
    corrected = next(e for e in entries if e["type"] == "memory" and e["change"] == "corrected")
    assert corrected["detail"]["reach"]["invalidated"] == [ids["DERIVED_ID"]]


def test_the_http_examples_in_the_docs_run_as_written(served: Served) -> None:
    snippet = re.search(r"## Over HTTP.*?```bash\n(.*?)```", (DOCS / "memory.md").read_text(), re.S)
    assert snippet
    env = {**os.environ, "TOKEN": served.auth["Authorization"].removeprefix("Bearer "),
           "WAKEFUL_PORT": served.url.rsplit(":", 1)[1]}
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", snippet.group(1)], env=env, capture_output=True,
                         text=True, check=True, timeout=30).stdout
    listed, written = (json.loads(line) for line in out.replace("}{", "}\n{").splitlines())
    assert listed == {"records": [], "next": None}
    assert (written["form"], written["state"]) == ("fact", "active")
    assert served.get(f"/v1/memory/{written['memory_id']}")["record"]["speaker"] == "user"


def test_a_refusal_is_one_line_with_its_code_and_exit_2(served: Served) -> None:
    empty, none_pending = (run(served.data, "memory", "list", *more) for more in ((), ("--state", "pending")))
    assert (empty.stdout, empty.stderr.strip()) == ("", "no memory records")  # said, not left blank
    assert none_pending.stderr.strip() == "no memory records match"
    for args, code in ((["confirm", "mem_nope"], "unknown_memory"),
                       (["add", "hypothesis", "x", "--subject", "s", "--relation", "r", "--value", "v"],
                        "invalid_memory"),
                       (["add", "preference", "x", "--subject", "Not An Id", "--relation", "r", "--value", "v"],
                        "invalid_memory"),
                       (["list", "--state", "gone"], "invalid_parameter"),
                       (["edit", "mem_nope", "--valid-until", "tomorrow"], "invalid_parameter"),
                       (["edit", "mem_nope"], "invalid_memory")):
        result = run(served.data, "memory", *args, check=False)
        assert result.returncode == 2 and f"wakeful: {code}:" in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    written = run(served.data, "memory", "add", "fact", "My passport expires in March 2027", "--subject", "passport",
                  "--relation", "expires", "--value", "2027-03", "--json").stdout
    memory_id = json.loads(written)["memory_id"]
    again = run(served.data, "memory", "confirm", memory_id, check=False)
    assert again.returncode == 2 and "wakeful: invalid_transition:" in again.stderr
