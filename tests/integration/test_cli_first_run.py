"""The first minutes of a new user, through the real `wakeful` command in a subprocess: the config file in the data
directory, serve and its proxy child agreeing on it, wrong input answered in one line, records as JSON, a private
data directory, and an install without tool computers."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.integration.test_cli import WAKEFUL, run
from tests.support.polling import wait_until
from tests.support.serve import free_port
from wakeful.proxy.clock import SystemClock
from wakeful.server.core import control, sessions
from wakeful.server.store.db import make_engine, write
from wakeful.server.store.users import user_id_by_name

ROOT = Path(__file__).resolve().parents[2]
CLEAN_EXIT = (0, -signal.SIGTERM)
SERVE_START = 60.0  # serve prepares, then its api child starts: two starts in sequence on a busy machine


def _env(**more: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_") and k != "ANTHROPIC_API_KEY"}
    return base | more


@contextmanager
def serving(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """`wakeful serve ARGS` with stdout and stderr in files of their own; killed by its PID if a test leaves it."""
    with (tmp_path / "stdout").open("wb") as out, (tmp_path / "stderr").open("wb") as err:
        proc = subprocess.Popen([WAKEFUL, "serve", *args], env=env or _env(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=err)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=15)


def _said(tmp_path: Path, stream: str) -> str:
    return (tmp_path / stream).read_text(errors="replace")


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _healthy(proc: subprocess.Popen[bytes], port: int, tmp_path: Path) -> bool:
    assert proc.poll() is None, f"serve exited with {proc.returncode}:\n{_said(tmp_path, 'stderr')}"
    try:
        return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # ended, not yet reaped by its new parent


# -- one resolution of settings ------------------------------------------------------------------------------------


def test_serve_with_a_config_file_in_its_data_dir_binds_its_ports_and_so_does_its_proxy_child(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    port, proxy_port = free_port(), free_port()
    (data / "wakeful.toml").write_text(f"port = {port}\nproxy_port = {proxy_port}\nproxy = true\n")
    with serving(tmp_path, "--data-dir", str(data)) as proc:  # no WAKEFUL_DATA_DIR: only the flag names the dir
        wait_until(lambda: _healthy(proc, port, tmp_path), SERVE_START,
                   "serve to answer on the port its config file names")
        wait_until(lambda: f"wakeful serving on http://127.0.0.1:{port}" in _said(tmp_path, "stderr"), 10,
                   "serve to say where it serves")
        assert _listening(proxy_port)
        child = re.search(rf"egress proxy listening on 127\.0\.0\.1:{proxy_port} \(pid (\d+)\)",
                          _said(tmp_path, "stderr"))
        assert child, _said(tmp_path, "stderr")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in CLEAN_EXIT
    wait_until(lambda: _gone(int(child[1])), 15, "the proxy child to end with its parent")
    assert not _listening(proxy_port) and not _listening(port)
    assert "Traceback" not in _said(tmp_path, "stderr")


@pytest.mark.parametrize("command", [
    ["status"], ["serve"], ["token"], ["user-add", "alice"], ["migrate"], ["stop"], ["ledger", "export"],
    ["egress", "log"], ["secret", "list"], ["proxy", "ca"], ["proxy"], ["demo"], ["image", "build"],
    ["replay", "run_x"],
], ids=" ".join)
def test_a_config_error_stops_every_command_with_the_field_the_file_and_the_line(tmp_path: Path,
                                                                                command: list[str]) -> None:
    (tmp_path / "wakeful.toml").write_text('port = 8787\n[sources.gh]\nkind = "gitlab"\nsecret = "x"\n')
    result = subprocess.run([WAKEFUL, *command, "--data-dir", str(tmp_path)], env=_env(), capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert f"sources.gh.kind ({tmp_path / 'wakeful.toml'} line 3)" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_bad_value_from_the_environment_names_the_variable(tmp_path: Path) -> None:
    result = subprocess.run([WAKEFUL, "status"], env=_env(WAKEFUL_DATA_DIR=str(tmp_path), WAKEFUL_PORT="eighty"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "port (environment WAKEFUL_PORT)" in result.stderr


def test_a_config_file_named_by_wakeful_config_must_exist(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.toml"
    result = subprocess.run([WAKEFUL, "status"], env=_env(WAKEFUL_DATA_DIR=str(tmp_path), WAKEFUL_CONFIG=str(missing)),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"{missing}: WAKEFUL_CONFIG names this file" in result.stderr


def test_a_config_file_that_is_not_toml_is_reported_with_its_line(tmp_path: Path) -> None:
    (tmp_path / "wakeful.toml").write_text("port = 1\nproxy_port = = 2\n")
    result = run(tmp_path, "status", check=False)
    assert result.returncode == 2 and "not valid TOML" in result.stderr and "line 2" in result.stderr


# -- serve's first start -------------------------------------------------------------------------------------------


def test_the_first_start_prints_the_owner_token_alone_on_stdout_and_the_migration_logs_on_stderr(
        tmp_path: Path) -> None:
    port = free_port()
    env = _env(WAKEFUL_DATA_DIR=str(tmp_path), WAKEFUL_PORT=str(port), WAKEFUL_PROXY="false")
    with serving(tmp_path, env=env) as proc:
        wait_until(lambda: _healthy(proc, port, tmp_path), SERVE_START, "serve to answer")
        token = _said(tmp_path, "stdout")
        assert re.fullmatch(r"wk_\S+\n", token), token
        assert "Running upgrade" in _said(tmp_path, "stderr") and token.strip() not in _said(tmp_path, "stderr")
        assert "setup plugin" not in _said(tmp_path, "stderr")  # alembic's own start-up chatter
        assert httpx.get(f"http://127.0.0.1:{port}/v1/control", timeout=5,
                         headers={"Authorization": f"Bearer {token.strip()}"}).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in CLEAN_EXIT


def test_serve_on_a_taken_port_says_so_in_one_line_and_never_that_it_serves(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = _env(WAKEFUL_DATA_DIR=str(tmp_path), WAKEFUL_PORT=str(port), WAKEFUL_PROXY="false")
        with serving(tmp_path, env=env) as proc:
            assert proc.wait(timeout=60) == 2
    said = _said(tmp_path, "stderr")
    assert f"wakeful: port_in_use: 127.0.0.1:{port}: address already in use" in said
    assert "serving on" not in said and "Traceback" not in said


# -- the command line itself ---------------------------------------------------------------------------------------


def test_version_and_short_help_are_answered(tmp_path: Path) -> None:
    assert re.fullmatch(r"wakeful \d+\.\d+\.\d+\S*\n", run(tmp_path, "--version").stdout)
    assert "user-add" in run(tmp_path, "-h").stdout
    assert "--data-dir" in run(tmp_path, "status", "-h").stdout
    assert "--host" in run(tmp_path, "secret", "set", "-h").stdout


@pytest.mark.parametrize("args", [
    ["stop", "--user", "nobody"], ["start", "--user", "nobody"], ["token", "--user", "nobody"],
    ["pause", "tsk_nope"], ["resume", "tsk_nope"], ["close", "tsk_nope"], ["ledger", "tsk_nope"],
    ["approve", "act_nope"], ["deny", "act_nope"], ["replay", "run_nope"], ["egress", "log", "--user", "nobody"],
    ["egress", "log", "--verdict", "maybe"], ["egress", "client", "vm", "--user", "nobody"], ["secret", "rm", "nope"],
    ["user-add"], ["status", "--bogus"], ["bogus"], ["egress", "log", "--limit", "0"], ["status", "--data-dir"],
    ["ledger", "export", "-o", "/nonexistent/dir/ledger.jsonl"],
    ["serve", "--host", "192.0.2.1"],  # an address of no interface here (TEST-NET-1): nothing is sent to it
    ["migrate", "--to", "0022", "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/none"],
], ids=" ".join)
def test_wrong_input_is_one_clear_line_and_a_nonzero_exit_never_a_traceback(tmp_path: Path, args: list[str]) -> None:
    run(tmp_path, "token")  # the owner exists, as after the first `wakeful serve`
    result = run(tmp_path, *args, check=False)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr + result.stdout
    problems = [line for line in result.stderr.splitlines() if line.startswith(("wakeful: ", "Error: "))]
    assert len(problems) == 1, result.stderr


@pytest.mark.parametrize("args", [["status"], ["stop"], ["approve", "act_x"], ["ledger", "export"], ["replay", "r"]],
                         ids=" ".join)
def test_a_mistyped_data_directory_is_refused_and_left_uncreated(tmp_path: Path, args: list[str]) -> None:
    run(tmp_path / "wakeful", "token")  # the real one
    mistyped = tmp_path / "wakefull"
    result = subprocess.run([WAKEFUL, *args, "--data-dir", str(mistyped)], env=_env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith(f"wakeful: no_data: {mistyped} holds no wakeful database"), result.stderr
    assert not mistyped.exists()


def test_an_unknown_user_hint_names_the_real_command(tmp_path: Path) -> None:
    run(tmp_path, "migrate")
    hint = run(tmp_path, "stop", "--user", "nobody", check=False).stderr
    command = re.search(r"`wakeful ([a-z-]+)", hint)
    assert command and command[1] == "user-add"
    assert run(tmp_path, command[1], "nobody").stdout.startswith("wk_")


def _a_task(data_dir: Path) -> str:
    engine = make_engine(f"sqlite:///{data_dir / 'wakeful.db'}")
    try:
        with write(engine) as conn:
            owner, now = user_id_by_name(conn, "owner"), SystemClock().now()
            session = sessions.create_session(conn, user_id=owner, now=now)
            return control.create_task(conn, user_id=owner, session_id=session, title="cancel the gym", now=now)
    finally:
        engine.dispose()


def test_status_json_parses_and_counts_by_state(tmp_path: Path) -> None:
    run(tmp_path, "migrate")
    run(tmp_path, "stop")
    status = json.loads(run(tmp_path, "status", "--json").stdout)
    assert status["stop"] == {"everything": True, "users": []} and status["events"]["pending"] == 0


def test_ledger_json_parses_and_holds_the_tasks_entries(tmp_path: Path) -> None:
    run(tmp_path, "token")
    task = _a_task(tmp_path)
    ledger = json.loads(run(tmp_path, "ledger", task, "--json").stdout)
    assert ledger["task_id"] == task and {"task", "task_version", "event"} <= {e["type"] for e in ledger["entries"]}


def test_egress_log_json_parses_as_one_list(tmp_path: Path) -> None:
    assert json.loads(run(tmp_path, "egress", "log", "--json").stdout) == []


def test_secret_list_json_parses_and_never_holds_a_value(tmp_path: Path) -> None:
    env = _env(WAKEFUL_DATA_DIR=str(tmp_path))
    subprocess.run([WAKEFUL, "secret", "set", "shop", "--host", "shop.test"], input="s3cret-value\n", env=env,
                   text=True, capture_output=True, timeout=60, check=True)
    listed = run(tmp_path, "secret", "list", "--json").stdout
    assert [s["name"] for s in json.loads(listed)] == ["shop"] and "s3cret-value" not in listed


def test_the_data_directory_is_created_owner_only_and_the_database_0600(tmp_path: Path) -> None:
    data = tmp_path / "fresh" / "wakeful"
    run(data, "migrate")
    assert (data.stat().st_mode & 0o777, (data / "wakeful.db").stat().st_mode & 0o777) == (0o700, 0o600)


# -- without tool computers ----------------------------------------------------------------------------------------


def _hiding(tmp_path: Path, *packages: str) -> str:
    """A PYTHONPATH on which `packages` cannot be found, as on a machine without them."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Absent:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        f"        if name.partition('.')[0] in {packages!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Absent())\n")
    return str(blocked)


@pytest.fixture
def without_vm_packages(tmp_path: Path) -> str:
    return _hiding(tmp_path, "libvirt", "paramiko", "playwright")


def test_a_postgresql_url_without_its_driver_says_what_to_install(tmp_path: Path) -> None:
    result = subprocess.run([WAKEFUL, "status", "--data-dir", str(tmp_path / "data"), "--database-url",
                             "postgresql+psycopg://wakeful@127.0.0.1:1/wakeful"],
                            env=_env(PYTHONPATH=_hiding(tmp_path, "psycopg")), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("wakeful: invalid_settings: database_url (--database-url): PostgreSQL's driver, "
                                    "psycopg 3, is not installed"), result.stderr
    assert "pip install 'psycopg[binary]>=3.1'" in result.stderr


@pytest.mark.parametrize("asked", [False, True], ids=["computers as by default", "computers = true"])
def test_serve_runs_a_delegation_without_the_vm_packages(tmp_path: Path, without_vm_packages: str,
                                                         asked: bool) -> None:
    port = free_port()
    env = _env(WAKEFUL_DATA_DIR=str(tmp_path), WAKEFUL_PORT=str(port), WAKEFUL_PROXY="false",
               PYTHONPATH=without_vm_packages, **({"WAKEFUL_COMPUTERS": "true"} if asked else {}))
    with serving(tmp_path, env=env) as proc:
        wait_until(lambda: _healthy(proc, port, tmp_path), SERVE_START, "serve to answer without the VM packages")
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10)
        if asked:  # tool computers were asked for: not ready, saying what to install
            assert ready.status_code == 503, ready.text
            assert "./scripts/install --computers" in ready.json()["error"]["checks"]["libvirt"]
        else:  # the default follows what is installed: no tool computers, and nothing missing
            assert ready.status_code == 200 and "libvirt" not in ready.json()["checks"], ready.text
        auth = {"Authorization": f"Bearer {_said(tmp_path, 'stdout').strip()}"}
        task = httpx.post(f"http://127.0.0.1:{port}/v1/tasks", json={"title": "t"}, headers=auth, timeout=10).json()
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/tasks/{task['task_id']}", headers=auth,
                                     timeout=5).json()["facts"]["run_ended"], 30, "the delegation's run to end")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in CLEAN_EXIT
    said = _said(tmp_path, "stderr")
    assert "Traceback" not in said
    # said at the start, not at first use, when they were asked for
    assert ("the VM packages are missing (libvirt, paramiko, playwright)" in said) is asked
    assert "no connectors:" in said  # and that the agent has no connector tools, with what to do about it


def test_asking_for_a_tool_computer_without_the_vm_packages_says_what_to_install(tmp_path: Path,
                                                                                without_vm_packages: str) -> None:
    script = ("from wakeful.server.computers.pool import _build_vm_computers\n"
              "from wakeful.server.errors import WakefulError\n"
              "from wakeful.server.settings import Settings\n"
              "from wakeful.proxy.clock import SystemClock\n"
              f"try:\n    _build_vm_computers(Settings(data_dir={str(tmp_path)!r}), SystemClock(), print)\n"
              "except WakefulError as exc:\n    print(exc.code, exc.message)\n")
    done = subprocess.run([sys.executable, "-c", script], env=_env(PYTHONPATH=without_vm_packages),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tool_computer_unavailable ") and "./scripts/install --computers" in done.stdout


def test_the_install_script_leaves_tool_computers_to_an_explicit_choice() -> None:
    def plan(*flags: str) -> str:
        return subprocess.run([str(ROOT / "scripts" / "install"), *flags, "--dry-run"], capture_output=True,
                              text=True, timeout=60, check=True).stdout

    default, computers, everything = plan(), plan("--computers"), plan("--all")
    assert "pip install -e .\n" in default and not re.search(r"libvirt|qemu", default)
    assert "pip install -e .[computers]" in computers and "libvirt-dev" in computers and "qemu.conf" in computers
    assert "pip install -e .[dev,computers]" in everything and "qemu-system-x86" in everything


@pytest.mark.parametrize("script", ["install", "libvirtd", "container-base"])
def test_each_setup_script_explains_itself_and_refuses_what_it_does_not_take(script: str) -> None:
    """They change system configuration (packages, users, daemons): `--help` only reads, and an option a script does
    not take stops it before it does anything."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(ROOT / "scripts" / script), *args], capture_output=True, text=True, timeout=60)

    helped = run("--help")
    assert helped.returncode == 0 and f"scripts/{script}" in helped.stdout and not helped.stderr
    refused = run("--no-such-option")
    assert refused.returncode == 2 and refused.stderr.startswith(f"scripts/{script}: unknown option --no-such-option")
