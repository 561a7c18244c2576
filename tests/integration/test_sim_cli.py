"""`wakeful sim` as a user runs it: a real process serving the simulators on loopback, sending signed webhooks to a
real `wakeful serve`, stopped by a signal."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.docs import doc_commands
from tests.support.polling import wait_until
from tests.support.serve import WAKEFUL, ServeProcess, free_port
from wakeful.server.sims.fleet import CORRELATION

SECRET = "change-me"  # the doc's
SIMS = ("merchant", "airline", "hotel", "mail")


def test_the_docs_sim_commands_are_the_ones_these_tests_run() -> None:
    assert doc_commands("evaluation.md", "sim") == [
        ["all", "--webhook-url", "http://127.0.0.1:8787/v1/hooks/{sim}"],
        ["all", "--tls", "--cert-out", "sims.pem", "--port", "9101", "--port", "9102", "--port", "9103", "--port",
         "9104"]]


@contextmanager
def sim_process(*args: str, lines_before_ready: int, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`wakeful sim ARGS`, with the lines it prints once its servers listen (five per simulator, one more for
    the webhook target)."""
    process = subprocess.Popen([str(WAKEFUL), "sim", *args], env={**os.environ, **(env or {})}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, cwd=cwd)
    try:
        lines: list[str] = []
        assert process.stdout is not None
        while len(lines) < lines_before_ready:
            line = process.stdout.readline()
            assert line, f"wakeful sim ended early: {process.stderr.read() if process.stderr else ''}"
            lines.append(line.strip())
        yield process, lines
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=15)


def test_the_simulators_send_signed_webhooks_that_a_real_server_records_and_stop_cleanly_on_sigterm(
        tmp_path: Path) -> None:
    env = {"WAKEFUL_DATA_DIR": str(tmp_path)}
    for sim in SIMS:
        env |= {f"WAKEFUL_SOURCES__{sim.upper()}__KIND": "generic", f"WAKEFUL_SOURCES__{sim.upper()}__SECRET": SECRET,
                f"WAKEFUL_SOURCES__{sim.upper()}__SESSION_KEY": CORRELATION[sim]}
    with ServeProcess(env, log_path=tmp_path / "serve.log") as server:
        args = [a.replace("8787", str(server.port)) for a in doc_commands("evaluation.md", "sim")[0]]
        with sim_process(*args, lines_before_ready=21, env={"WAKEFUL_SIM_WEBHOOK_SECRET": SECRET}) as (process, lines):
            urls = dict(line.split() for line in lines if len(line.split()) == 2)
            assert list(urls) == list(SIMS) and all(u.startswith("http://127.0.0.1:") for u in urls.values())
            assert f"{urls['merchant']}/_sim/records" in lines
            assert lines[-1] == f"webhooks -> {server.url}/v1/hooks/{{sim}}"
            assert SECRET not in " ".join(process.args)  # the secret came from the environment, not argv
            httpx.post(f"{urls['merchant']}/_sim/faults", json={"late_webhook": True}).raise_for_status()
            httpx.post(f"{urls['merchant']}/v1/subscriptions/sub_1/cancel_renewal", headers={"Idempotency-Key": "k1"},
                       json={}).raise_for_status()
            httpx.post(f"{urls['airline']}/_sim/cancel_flight", json={"flight": "AB100"}).raise_for_status()
            thread = httpx.post(f"{urls['mail']}/_sim/inbound", json={"from": "client@example.test", "subject": "hi"})
            delivered = {sim: wait_until(lambda sim=sim: httpx.get(f"{urls[sim]}/_sim/webhooks").json()["delivered"],
                                         15, f"the {sim}'s webhook to be delivered")
                         for sim in ("merchant", "airline", "mail")}
            token = subprocess.run([str(WAKEFUL), "token"], env={**os.environ, **env}, capture_output=True,
                                   text=True, check=True, timeout=60).stdout.strip()
            for sim, (sent,) in delivered.items():
                event = httpx.get(f"{server.url}/v1/events/{sent['answer']['event_id']}",
                                  headers={"Authorization": f"Bearer {token}"}).json()
                assert (event["source"], event["source_id"]) == (sim, sent["delivery_id"])
            assert delivered["mail"][0]["payload"]["thread_id"] == thread.json()["thread_id"]

            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=15) == 0
            assert "stopped" in (process.stderr.read() if process.stderr else "")


def test_all_simulators_serve_https_on_the_ports_given_with_the_certificate_they_write(tmp_path: Path) -> None:
    ports = {str(doc_port): str(free_port()) for doc_port in range(9101, 9105)}
    args = [ports.get(a, a) for a in doc_commands("evaluation.md", "sim")[1]]
    with sim_process(*args, lines_before_ready=20, cwd=tmp_path) as (process, lines):
        urls = [line.split()[1] for line in lines if len(line.split()) == 2]
        assert urls == [f"https://127.0.0.1:{p}" for p in ports.values()]
        written = (tmp_path / "sims.pem").read_text()
        assert "PRIVATE KEY" not in written
        trusting = ssl.create_default_context(cafile=str(tmp_path / "sims.pem"))  # that certificate alone
        booking = httpx.get(f"https://localhost:{ports['9102']}/v1/bookings/PNR123", verify=trusting).json()
        assert booking["pnr"] == "PNR123"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0


def test_a_webhook_url_without_a_secret_is_refused_before_anything_starts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WAKEFUL_SIM_WEBHOOK_SECRET"}
    result = subprocess.run([str(WAKEFUL), "sim", "merchant", "--webhook-url", "http://127.0.0.1:9/v1/hooks/m"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no_webhook_secret" in result.stderr and result.stdout == ""


def test_a_port_already_taken_is_named_in_a_one_line_refusal() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([str(WAKEFUL), "sim", "merchant", "--port", str(port)], capture_output=True,
                                text=True, timeout=60)
    assert result.returncode == 2
    assert "wakeful: not_started: " in result.stderr and str(port) in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr


def test_a_certificate_file_without_tls_is_refused_before_anything_starts(tmp_path: Path) -> None:
    result = subprocess.run([str(WAKEFUL), "sim", "merchant", "--cert-out", str(tmp_path / "c.pem")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid_parameter" in result.stderr and result.stdout == ""
    assert not (tmp_path / "c.pem").exists()
