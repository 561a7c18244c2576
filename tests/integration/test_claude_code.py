"""The Claude Code CLI (from the npm registry) connects to wakeful with exactly the commands docs/claude-code.md
shows. No API key is needed for `claude mcp list`, which starts each server and checks it answers."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.serve import ServeProcess

ROOT = Path(__file__).resolve().parents[2]
CLAUDE = ROOT / ".tools" / "node_modules" / ".bin" / "claude"
DOC = (ROOT / "docs" / "claude-code.md").read_text()


def doc_commands(section: str) -> list[str]:
    """The bash lines of the first code block under a heading of the doc."""
    block = re.search(rf"## {re.escape(section)}.*?```bash\n(.*?)```", DOC, re.S)
    assert block, section
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def shell(command: str, home: Path, port: int | None = None) -> str:
    if port is not None:
        command = command.replace("127.0.0.1:8787", f"127.0.0.1:{port}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}
    env |= {"HOME": str(home), "PATH": f"{CLAUDE.parent}:{env['PATH']}"}
    result = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture
def home(tmp_path: Path) -> Path:
    if not CLAUDE.exists():
        pytest.fail("the Claude Code CLI is missing: run ./scripts/install --all")
    return tmp_path


def test_claude_code_connects_over_stdio_through_the_bridge_with_the_documented_commands(home: Path) -> None:
    credential, add, listing = doc_commands("stdio (the client starts wakeful)")
    data_dir = home / ".local" / "share" / "wakeful"
    with ServeProcess({"WAKEFUL_DATA_DIR": str(data_dir)}, log_path=home / "serve.log") as server:
        shell(credential, home)
        assert (home / ".wakeful-agent-token").stat().st_mode & 0o077 == 0  # the credential is the user's alone
        shell(add, home, port=server.port)
        listed = shell(listing, home)
    assert re.search(rf"wakeful: .*wakeful mcp --url http://127\.0\.0\.1:{server.port} .*- ✔ Connected", listed), listed


def test_claude_code_shows_the_bridge_failed_when_the_server_refuses_its_credential(home: Path) -> None:
    _, add, listing = doc_commands("stdio (the client starts wakeful)")
    (home / ".wakeful-agent-token").write_text("wk_revoked\n")
    data_dir = home / ".local" / "share" / "wakeful"
    with ServeProcess({"WAKEFUL_DATA_DIR": str(data_dir)}, log_path=home / "serve.log") as server:
        shell(add, home, port=server.port)
        listed = shell(listing, home)
    assert re.search(r"wakeful: .*wakeful mcp .* - ✘ Failed to connect", listed), listed


def test_claude_code_without_a_token_is_not_sent_to_an_oauth_server_that_is_not_there(home: Path) -> None:
    """The 401 names no resource metadata, so no authorization server: whatever Claude Code then tries on its own,
    wakeful never pointed it there (it used to: the metadata named this server as its own, 404 OAuth server)."""
    data_dir = home / ".local" / "share" / "wakeful"
    with ServeProcess({"WAKEFUL_DATA_DIR": str(data_dir)}, log_path=home / "serve.log") as server:
        shell(f"claude mcp add --transport http wakeful {server.url}/mcp", home)
        listed = shell("claude mcp list", home)
        refused = httpx.post(f"{server.url}/mcp", json={})
    assert re.search(rf"wakeful: {re.escape(server.url)}/mcp \(HTTP\) - ✘ Failed to connect", listed), listed
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == 'Bearer realm="wakeful"'


def test_claude_code_connects_over_http_with_the_documented_command(home: Path) -> None:
    (add,) = doc_commands("Streamable HTTP (wakeful is already running)")
    data_dir = home / ".local" / "share" / "wakeful"
    with ServeProcess({"WAKEFUL_DATA_DIR": str(data_dir)}, log_path=home / "serve.log") as server:
        shell(add, home, port=server.port)
        listed = shell("claude mcp list", home)
    assert re.search(rf"wakeful: http://127\.0\.0\.1:{server.port}/mcp \(HTTP\) - ✔ Connected", listed), listed
