"""The egress path for a test: the server's decider on its unix socket (in a thread with its own event loop), the
real `wakeful proxy` process in front of it, the simulators on HTTPS behind it, and a vault holding a credential.

    with egress_stack(engine, clock, owner, tmp_path) as stack:
        stack.world.call(task, "merchant__list_subscriptions")      # through the proxy, credential injected
        stack.world.received["merchant"][-1].headers                 # what the simulator got
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sqlalchemy import Engine

from tests.support.acting import World, world
from tests.support.polling import wait_until
from tests.support.serve import WAKEFUL, free_port
from tests.support.tlsca import make_test_ca
from wakeful.proxy.channel import Decide, DeciderServer, Record
from wakeful.proxy.clock import FakeClock
from wakeful.proxy.contract import DecisionRequest, Verdict
from wakeful.server.egress import grants as egress
from wakeful.server.egress.outbound import ConnectorHTTP
from wakeful.server.egress.proxyctl import DeciderService, ProxyChild, new_decider_token
from wakeful.server.settings import EXAMPLE_POLICIES, Settings
from wakeful.server.store.db import read

__all__ = ["EgressStack", "decider_on_thread", "egress_stack", "proxy_child"]

SIMS = ("merchant", "airline", "hotel")


@dataclass
class EgressStack:
    world: World
    settings: Settings
    secret: str
    """The merchant credential's value: a canary, unique to this stack."""
    proxy_url: str
    proxy_log: Path
    upstream_ca: Path
    deployment_ca: Path
    before_decide: list[Callable[[DecisionRequest], None]] = field(default_factory=list)
    """Run (in the decider's thread) before each decision: the moment between a request leaving and its verdict."""
    asked: list[DecisionRequest] = field(default_factory=list)
    stop_decider: Callable[[], None] = lambda: None
    """Close the decider's socket, as if the server were gone."""

    def client(self) -> httpx.Client:
        """An HTTP client that goes through the proxy and trusts the deployment CA, with no proxy credential."""
        return httpx.Client(proxy=self.proxy_url, verify=ssl.create_default_context(cafile=self.deployment_ca),
                            timeout=10.0)

    def audit(self, count: int, *, timeout: float = 10.0, tunnels: bool = False) -> list[dict[str, object]]:
        """The audit rows of requests, newest first, once `count` have arrived (the proxy sends them
        asynchronously); with `tunnels`, the rows of CONNECTs too (every tunnel has one of its own)."""
        def rows() -> list[dict[str, object]] | None:
            with read(self.world.engine) as conn:
                found = [r for r in egress.audit_rows(conn, user_id=None, limit=1000)
                         if tunnels or r["method"] != "CONNECT"]
            return found if len(found) >= count else None
        return wait_until(rows, timeout, f"{count} egress audit rows")


def _toml(settings: Settings) -> str:
    resolve = ", ".join(f'"{h}" = ["127.0.0.1"]' for h in settings.egress_resolve)
    allow = ", ".join(f'"{h}"' for h in settings.egress_allow_private)
    return (f'proxy = true\nproxy_port = {settings.proxy_port}\nproxy_decider_timeout = '
            f'{settings.proxy_decider_timeout}\negress_upstream_ca = "{settings.egress_upstream_ca}"\n'
            f'policies_dir = "{settings.policies}"\negress_allow_private = [{allow}]\n'
            f"egress_resolve = {{ {resolve} }}\n")


@contextmanager
def decider_on_thread(settings: Settings, decide: Decide, record: Record) -> Iterator[Callable[[], None]]:
    """The server's decider on its unix socket, served from an event loop on a thread of its own (the test's own
    thread stays free to drive the world). Yields `stop`, which closes the socket early, as if the server were gone."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-decider", daemon=True)
    thread.start()
    server = DeciderServer(settings.decider_socket, new_decider_token(settings), decide, record)
    up = threading.Event()

    def stop() -> None:
        if up.is_set():
            up.clear()
            asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)

    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(10)
        up.set()
        yield stop
    finally:
        stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@contextmanager
def proxy_child(settings: Settings, log_file: Path) -> Iterator[ProxyChild]:
    """The real `wakeful proxy` process, as `wakeful serve` runs it, for the duration of the block."""
    child = ProxyChild(settings, log_file=log_file)
    child.start()
    try:
        yield child
    finally:
        child.stop()


@contextmanager
def _decider(stack: EgressStack, service: DeciderService) -> Iterator[None]:
    async def decide(req: DecisionRequest) -> Verdict:
        stack.asked.append(req)
        for hook in stack.before_decide:
            await asyncio.to_thread(hook, req)
        return await service.decide(req)

    with decider_on_thread(stack.settings, decide, service.record) as stop:
        stack.stop_decider = stop
        yield


@contextmanager
def egress_stack(engine: Engine, clock: FakeClock, owner: str, tmp_path: Path, *,
                 policies: Path = EXAMPLE_POLICIES) -> Iterator[EgressStack]:
    hosts = [f"{name}.test" for name in SIMS] + ["intranet.test"]
    ca = make_test_ca(tmp_path, hosts)
    settings = Settings(data_dir=tmp_path, proxy=True, proxy_port=free_port(), proxy_decider_timeout=1.0,
                        egress_upstream_ca=ca.ca_file, policies_dir=policies,
                        egress_resolve={h: ["127.0.0.1"] for h in hosts},
                        egress_allow_private=[f"{name}.test" for name in SIMS])
    (tmp_path / "wakeful.toml").write_text(_toml(settings))
    secret = f"wkcanary{secrets.token_hex(12)}"
    env = {"WAKEFUL_DATA_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    subprocess.run([str(WAKEFUL), "secret", "set", "merchant_api", "--host", "merchant.test"], input=secret.encode(),
                   env=env, check=True, capture_output=True, timeout=60)
    deployment_ca = tmp_path / "deployment-ca.pem"
    subprocess.run([str(WAKEFUL), "proxy", "ca", "-o", str(deployment_ca)], env=env, check=True,
                   capture_output=True, timeout=60)
    http = ConnectorHTTP.from_settings(settings)
    with world(engine, clock, owner, http=http, tls=ca.leaf_file) as w:
        stack = EgressStack(world=w, settings=settings, secret=secret,
                            proxy_url=f"http://127.0.0.1:{settings.proxy_port}", proxy_log=tmp_path / "proxy.log",
                            upstream_ca=ca.ca_file, deployment_ca=deployment_ca)
        with _decider(stack, DeciderService(engine, clock, settings)), proxy_child(settings, stack.proxy_log):
            yield stack
