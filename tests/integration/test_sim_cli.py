"""`wakeful sim` as a user runs it: a real process serving the simulators on loopback, sending signed webhooks to a
real `wakeful serve`, stopped by a signal."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support.polling import wait_until
from tests.support.serve import WAKEFUL, ServeProcess

SECRET = "whsec_sim_cli"


@contextmanager
def sim_process(*args: str, lines_before_ready: int,
                env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`wakeful sim ARGS`, with the lines it prints once its servers listen (five per simulator, one more for
    the webhook target)."""
    process = subprocess.Popen([str(WAKEFUL), "sim", *args], env={**os.environ, **(env or {})}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
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


def test_the_simulator_sends_a_signed_webhook_that_a_real_server_records_and_stops_cleanly_on_sigterm(
        tmp_path: Path) -> None:
    env = {"WAKEFUL_DATA_DIR": str(tmp_path), "WAKEFUL_SOURCES__MERCHANT__KIND": "generic",
           "WAKEFUL_SOURCES__MERCHANT__SECRET": SECRET, "WAKEFUL_SOURCES__MERCHANT__SESSION_KEY": "body:subscription"}
    with ServeProcess(env, log_path=tmp_path / "serve.log") as server, \
            sim_process("merchant", "--webhook-url", f"{server.url}/v1/hooks/merchant", "--flush-every", "0.2",
                        lines_before_ready=6, env={"WAKEFUL_SIM_WEBHOOK_SECRET": SECRET}) as (process, lines):
        merchant = lines[0].split()[1]
        assert lines[0] == f"merchant {merchant}" and merchant.startswith("http://127.0.0.1:")
        assert f"{merchant}/_sim/records" in lines
        assert SECRET not in " ".join(process.args)  # the secret came from the environment, not argv
        httpx.post(f"{merchant}/_sim/faults", json={"late_webhook": True}).raise_for_status()
        httpx.post(f"{merchant}/v1/subscriptions/sub_1/cancel_renewal", headers={"Idempotency-Key": "k1"},
                   json={}).raise_for_status()
        delivered = wait_until(lambda: httpx.get(f"{merchant}/_sim/webhooks").json()["delivered"], 15,
                               "the webhook to be delivered")
        event_id = delivered[0]["answer"]["event_id"]
        token = subprocess.run([str(WAKEFUL), "token"], env={**os.environ, **env}, capture_output=True, text=True,
                               check=True, timeout=60).stdout.strip()
        event = httpx.get(f"{server.url}/v1/events/{event_id}", headers={"Authorization": f"Bearer {token}"}).json()
        assert (event["source"], event["source_id"]) == ("merchant", delivered[0]["delivery_id"])

        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        assert "stopped" in (process.stderr.read() if process.stderr else "")


def test_all_simulators_serve_https_on_the_ports_given(tmp_path: Path) -> None:
    from tests.support.serve import free_port

    ports = [free_port(), free_port(), free_port()]
    with sim_process("all", "--tls", *[arg for p in ports for arg in ("--port", str(p))],
                     lines_before_ready=15) as (process, lines):
        urls = [line.split()[1] for line in lines if len(line.split()) == 2]
        assert urls == [f"https://127.0.0.1:{p}" for p in ports]
        booking = httpx.get(f"{urls[1]}/v1/bookings/PNR123", verify=False).json()
        assert booking["pnr"] == "PNR123"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=15) == 0


def test_a_webhook_url_without_a_secret_is_refused_before_anything_starts(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "WAKEFUL_SIM_WEBHOOK_SECRET"}
    result = subprocess.run([str(WAKEFUL), "sim", "merchant", "--webhook-url", "http://127.0.0.1:9/v1/hooks/m"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "no_webhook_secret" in result.stderr and result.stdout == ""
