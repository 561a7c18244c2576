"""`proxy.server.run` as a process: reports its port, fails closed with no decider, and exits 0 on SIGTERM; and
`wakeful proxy` as the server starts it, with its relay socket when hosts over SSH share an isolated network."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from tests.support.egress import decider_on_thread, proxy_child
from tests.support.polling import wait_until
from tests.support.serve import free_port
from wakeful.proxy.audit import EgressRecord
from wakeful.proxy.contract import DecisionRequest, Verdict
from wakeful.proxy.vault import KEY_ENV, generate_key
from wakeful.server.egress.proxyctl import _listening
from wakeful.server.settings import Settings, load_settings

pytestmark = pytest.mark.anyio

CHILD = textwrap.dedent("""
    import logging, sys
    from pathlib import Path
    from wakeful.proxy.config import ProxyConfig
    from wakeful.proxy.server import run
    from wakeful.proxy.vault import Vault, keys_from_env

    logging.basicConfig(level=logging.INFO)
    d = Path(sys.argv[1])
    keys = keys_from_env()
    config = ProxyConfig(decider_socket=d / "nobody" / "decider.sock", decider_token="t", ca_dir=d / "ca",
                         keys=keys, vault=Vault(d / "vault.json", keys), decider_timeout=0.5)
    run(config, ready=lambda server: print(server.port, flush=True))
""")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_the_proxy_process_serves_until_a_signal_and_then_exits_cleanly(tmp_path: Path, sig: int) -> None:
    env = {**os.environ, KEY_ENV: generate_key().encoded()}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", CHILD, str(tmp_path), env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        port = int(await asyncio.wait_for(proc.stdout.readline(), 30))  # type: ignore[union-attr]
        async with httpx.AsyncClient(proxy=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as client:
            response = await client.get("http://example.test/")
        assert response.status_code == 502 and response.headers["x-wakeful-refusal"] == "decider_unavailable"
        assert (tmp_path / "ca" / "ca.pem").exists()
        proc.send_signal(sig)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        stderr = await proc.stderr.read()  # type: ignore[union-attr]
        assert b"wakeful proxy stopped" in stderr and b"Traceback" not in stderr
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_a_proxy_child_that_dies_is_started_again_and_stopped_with_the_server(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, proxy_port=free_port())
    (tmp_path / "wakeful.toml").write_text(f"proxy_port = {settings.proxy_port}\n")  # what the child reads
    with decider_on_thread(settings, _refuse, _forget), proxy_child(settings, tmp_path / "proxy.log") as child:
        first = child._proc
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)  # the watcher sleeps until the kernel says it ended: no polling
        second = wait_until(lambda: child._proc if child._proc is not first and _listening(settings.proxy_port)
                            else None, 60, "the proxy to be started again")
    assert second.poll() is not None  # stopped with the server


async def _refuse(_req: DecisionRequest) -> Verdict:
    raise AssertionError("nothing asks the decider in this test")


async def _forget(_records: list[EgressRecord]) -> None:
    return None


HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGzv0lEQXm3B0d+xvXoMIP0u0V0kq4yq3ZK4v3m0LLxT root@kvm2"


def test_wakeful_proxy_takes_other_hosts_computers_on_its_relay_socket_with_hosts_over_ssh_on_a_network(
        tmp_path: Path) -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface: the address listener binds it all the same; nothing is sent there.
    config = textwrap.dedent(f"""\
        proxy_port = {free_port()}
        computer_network = "wakeful"
        proxy_bridge_listen = "192.0.2.1:{free_port()}"
        computer_shared_dir = "{tmp_path / 'shared'}"

        [[computer_hosts]]
        name = "kvm2"
        uri = "qemu+ssh://wakeful@kvm2/system"
        memory_mib = 4096
        ssh = "wakeful@kvm2"
        ssh_host_key = "{HOST_KEY}"
        ssh_key = "{tmp_path / 'hosts_ed25519'}"
        """)
    (tmp_path / "wakeful.toml").write_text(config)
    settings = load_settings(data_dir=tmp_path)  # what the child reads too
    relay = settings.proxy_relay_socket
    assert relay == tmp_path / "run" / "proxy-relay.sock"
    with decider_on_thread(settings, _refuse, _forget), proxy_child(settings, tmp_path / "proxy.log"):
        wait_until(relay.exists, 60, "wakeful proxy to listen on its relay socket")
        assert oct(relay.stat().st_mode & 0o777) == oct(0o600)
    assert not relay.exists(), "removed when the proxy stops"
