"""The egress commands docs/egress.md shows, run with bash exactly as written, and `wakeful serve` running the
proxy as its child: refusals land in the audit that `wakeful egress log` and `GET /v1/egress` show."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import httpx

from tests.integration.test_cli import run
from tests.support.docs import section
from tests.support.polling import wait_until
from tests.support.serve import WAKEFUL, ServeProcess, free_port
from wakeful.proxy.contract import RefusalCode
from wakeful.proxy.rewrite import COOKIE_HEADERS, CREDENTIAL_HEADERS
from wakeful.proxy.vault import Vault, load_keys
from wakeful.proxy.wire import REQUEST_TOO_LARGE, UPSTREAM_FAILED, UPSTREAM_TIMEOUT, refusal_status
from wakeful.server.egress.proxyctl import new_decider_token
from wakeful.server.settings import Settings

DOC = (Path(__file__).resolve().parents[2] / "docs" / "egress.md").read_text()
BLOCKS = re.findall(r"```bash\n(.*?)```", DOC, re.S)


def _env(data_dir: Path, **env: str) -> dict[str, str]:
    """This environment without any WAKEFUL_ setting, pointed at `data_dir`."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}
    return clean | {"WAKEFUL_DATA_DIR": str(data_dir), **env}


def _bash(data_dir: Path, script: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = _env(data_dir, PATH=f"{WAKEFUL.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}", **env)
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=clean, capture_output=True, text=True,
                            timeout=120, cwd=data_dir)
    assert result.returncode == 0, result.stderr
    return result


def test_the_secret_commands_in_the_docs_store_list_remove_and_rotate_without_showing_a_value(tmp_path: Path) -> None:
    key, session = "mk_live_0123456789abcdef", "sess-feedface"
    out = _bash(tmp_path, BLOCKS[0], MERCHANT_KEY=key, TOKEN=session)
    assert "merchant_api" in out.stdout and "shop.example.com" in out.stdout  # the list before the rm
    assert key not in out.stdout + out.stderr and session not in out.stdout + out.stderr
    vault = Vault(tmp_path / "vault.json", load_keys(tmp_path / "vault.key"))
    assert [i.name for i in vault.list()] == ["merchant_api"]  # shop_session was removed
    credential = vault.get("merchant_api")
    assert credential.render() == f"Bearer {key}" and credential.host == "merchant.example.com"
    assert key.encode() not in (tmp_path / "vault.json").read_bytes()
    assert "every credential and the deployment CA's key are now encrypted under key" in out.stdout  # rotate-key
    assert vault.list()[0].key_id == load_keys(tmp_path / "vault.key").current.key_id


def test_a_secret_is_never_taken_from_the_command_line(tmp_path: Path) -> None:
    refused = run(tmp_path, "secret", "set", "x", "--host", "a.example.com", "--value", "s3cret", check=False)
    assert refused.returncode == 2 and "No such option" in refused.stderr
    empty = subprocess.run([WAKEFUL, "secret", "set", "x", "--host", "a.example.com"], input="", text=True,
                           capture_output=True, env={**os.environ, "WAKEFUL_DATA_DIR": str(tmp_path)}, timeout=60)
    assert empty.returncode == 2 and "empty_secret" in empty.stderr
    bad = subprocess.run([WAKEFUL, "secret", "set", "x", "--host", "10.0.0.1"], input="v", text=True,
                         capture_output=True, env={**os.environ, "WAKEFUL_DATA_DIR": str(tmp_path)}, timeout=60)
    assert bad.returncode == 2 and "invalid_credential" in bad.stderr
    assert run(tmp_path, "secret", "rm", "nope", check=False).stderr.count("unknown_credential") == 1


def test_the_ca_in_the_docs_is_a_certificate_and_its_key_is_stored_encrypted(tmp_path: Path) -> None:
    (block,) = [b for b in BLOCKS if "proxy ca" in b]
    _bash(tmp_path, block)
    pem = (tmp_path / "wakeful-ca.pem").read_text()
    assert pem.startswith("-----BEGIN CERTIFICATE-----") and "PRIVATE KEY" not in pem
    key_file = (tmp_path / "proxy" / "ca.key.enc").read_bytes()
    assert b"PRIVATE KEY" not in key_file and (tmp_path / "proxy" / "ca.key.enc").stat().st_mode & 0o077 == 0
    assert run(tmp_path, "proxy", "ca").stdout == pem  # the same CA every time


def test_a_key_rotation_carries_the_ca_along_so_the_proxy_still_starts_with_the_ca_the_computers_trust(
        tmp_path: Path) -> None:
    pem = run(tmp_path, "proxy", "ca").stdout
    for _ in range(2):  # the old key leaves the key file at once: the CA must not stay sealed under it
        run(tmp_path, "secret", "rotate-key")
        current = load_keys(tmp_path / "vault.key")
        assert not current.previous
        assert json.loads((tmp_path / "proxy" / "ca.key.enc").read_text())["key_id"] == current.current.key_id
        assert run(tmp_path, "proxy", "ca").stdout == pem


def test_proxy_help_says_that_without_a_subcommand_it_starts_the_proxy(tmp_path: Path) -> None:
    out = " ".join(run(tmp_path, "proxy", "--help").stdout.split())
    assert "Usage: wakeful proxy [OPTIONS] [COMMAND [ARGS]...]" in out
    assert "Without a subcommand, `wakeful proxy` starts the proxy on 127.0.0.1:<proxy_port>" in out


def test_the_refusal_table_in_the_docs_gives_every_code_the_status_the_proxy_answers_with() -> None:
    refusals = section(DOC, "## Refusals")
    documented = {code: int(status) for codes, status in re.findall(r"^\| (`[^|]+`) \| (\d{3}) \|", refusals, re.M)
                  for code in re.findall(r"`(\w+)`", codes)}
    answered = {*RefusalCode, REQUEST_TOO_LARGE, UPSTREAM_FAILED, UPSTREAM_TIMEOUT}
    assert documented == {code: refusal_status(code) for code in answered}


def test_the_docs_name_every_client_header_the_proxy_strips_as_a_credential() -> None:
    paragraph = " ".join(DOC.split("## Credentials", 1)[1].split("```", 2)[2].split("\n\n", 2)[1].split())
    named = {name.lower() for name in re.findall(r"`([A-Za-z0-9-]+)`", paragraph.split("are removed first")[0])}
    assert CREDENTIAL_HEADERS | COOKIE_HEADERS <= named


def test_serve_runs_the_proxy_and_its_refusals_are_in_the_audit(tmp_path: Path) -> None:
    proxy_port = free_port()
    env = {"WAKEFUL_DATA_DIR": str(tmp_path), "WAKEFUL_PROXY": "true", "WAKEFUL_PROXY_PORT": str(proxy_port)}
    with ServeProcess(env, log_path=tmp_path / "serve.log") as server:
        token = run(tmp_path, "token").stdout.strip()
        (client_block,) = [b for b in BLOCKS if "egress client" in b and "--revoke" not in b]
        credential = _bash(tmp_path, client_block).stdout.strip()
        user_id, _, secret = credential.partition(":")
        assert user_id.startswith("usr_") and secret and secret.encode() not in (tmp_path / "wakeful.db").read_bytes()
        proxy = f"http://{credential}@127.0.0.1:{proxy_port}"
        with httpx.Client(proxy=proxy, timeout=10.0) as client:
            refused = client.get("http://nowhere.example/")
        assert (refused.status_code, refused.headers["x-wakeful-refusal"]) == (403, "host_not_allowed")
        with httpx.Client(proxy=f"http://127.0.0.1:{proxy_port}", timeout=10.0) as client:
            anonymous = client.get("http://nowhere.example/")
        assert anonymous.headers["x-wakeful-refusal"] == "not_admitted"

        def audited() -> list[dict[str, object]]:
            body = httpx.get(f"{server.url}/v1/egress", headers={"Authorization": f"Bearer {token}"}).json()
            return body["requests"]
        from tests.support.polling import wait_until
        (mine,) = wait_until(audited, 10, "the refusal in GET /v1/egress")  # only the caller's own request
        assert (mine["host"], mine["verdict"], mine["code"], mine["user_id"]) == (
            "nowhere.example", "refuse", "host_not_allowed", user_id)
        (log_block,) = [b for b in BLOCKS if "egress log" in b]
        out = _bash(tmp_path, log_block).stdout
        (document,) = [json.loads(line) for line in out.splitlines() if line.startswith("[")]
        assert {r["code"] for r in document} == {"host_not_allowed", "not_admitted"}
        assert "nowhere.example" in out.split("\n[", 1)[0]  # the table above the JSON
    assert "egress proxy listening" in server.log()


def test_an_egress_policy_with_a_typo_stops_serve_with_the_line(tmp_path: Path) -> None:
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "egress.toml").write_text('[[allow]]\nname = "x"\nhots = "a.example.com"\n')
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}, "WAKEFUL_DATA_DIR": str(tmp_path),
           "WAKEFUL_PROXY": "true", "WAKEFUL_PROXY_PORT": str(free_port()), "WAKEFUL_PORT": str(free_port())}
    result = subprocess.run([WAKEFUL, "serve"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "invalid_egress_policy" in result.stderr and "line 3" in result.stderr and "hots" in result.stderr


def _answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_proxy_await_api_waits_for_the_api_to_open_the_channel_then_serves(tmp_path: Path) -> None:
    """Under systemd the proxy's unit starts as soon as the api's: without `--await-api` it would fail and be
    restarted until the api has written the channel's token."""
    port = free_port()
    log = tmp_path / "proxy.log"
    with log.open("w") as out:
        proc = subprocess.Popen([WAKEFUL, "proxy", "--await-api", "60"],
                                env=_env(tmp_path, WAKEFUL_PROXY_PORT=str(port)), stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        waiting = "waiting up to 60 s for `wakeful api`"
        wait_until(lambda: proc.poll() is not None or waiting in log.read_text(), 60, "the proxy saying it waits")
        assert proc.poll() is None and not _answers(port), log.read_text()
        new_decider_token(Settings(data_dir=tmp_path))  # what `wakeful api` does as it starts
        wait_until(lambda: _answers(port), 60, "the proxy listening once the token is there")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text()


def test_proxy_await_api_gives_up_with_decider_unavailable(tmp_path: Path) -> None:
    result = subprocess.run([WAKEFUL, "proxy", "--await-api", "1"],
                            env=_env(tmp_path, WAKEFUL_PROXY_PORT=str(free_port())), capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert "decider_unavailable" in result.stderr and "within 1 s" in result.stderr
    assert "Traceback" not in result.stderr
