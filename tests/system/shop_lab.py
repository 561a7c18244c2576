"""A shop on the host's loopback and the real egress path to it, for tool-computer system tests and the benchmark.

    with shop_egress(tmp, deployment=image_data_dir) as lab:   # the shop, the server's decider, `wakeful proxy`
        lab.credential                      # the VM's proxy identity (a client token issued by the server)
        lab.shop.url                        # http://shop.test:<port>/ — the proxy resolves shop.test to 127.0.0.1
        lab.shop.tls_url                    # https://shop.test:<tls_port>/ — the same shop over TLS
        lab.shop.orders                     # what the shop received: its own records, not the agent's word

The egress allowlist (`<policies>/egress.toml`) lets the shopper reach shop.test on the shop's two ports with GET
and POST and nothing else; on the TLS port a rule binds the vault credential `shop_key` (`lab.secret`), which the
proxy injects as `Authorization: Bearer …`. The shop's TLS leaf comes from its own test CA, which the proxy trusts
(`egress_upstream_ca`). With `deployment` (a data directory holding a deployment CA and its vault key, as the guest
image's build has) the proxy intercepts with that CA, the one the image trusts; without it the proxy makes its own
and only plain HTTP works from the guest. With `network` (an isolated libvirt network's name and host address, see
`computer_lab.isolated_network`) the proxy also listens on that address's port 3128, for tool computers on it; with
`computer_hosts` too (hosts reached over SSH, and `computer_shared_dir`) it also takes those hosts' tool computers
on its relay socket, as `wakeful proxy` does in such a deployment.
"""

from __future__ import annotations

import html
import http.server
import json
import secrets
import shutil
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support.egress import decider_on_thread, proxy_child
from tests.support.serve import free_port
from tests.support.tlsca import make_test_ca
from wakeful.proxy.clock import FakeClock
from wakeful.proxy.contract import DecisionRequest, Verdict
from wakeful.server.egress import grants as egress
from wakeful.server.egress.proxyctl import DeciderService, open_vault
from wakeful.server.settings import Settings
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.users import ensure_user
from wakeful.vm.hypervisor import ProxyCredential

__all__ = ["Request", "Shop", "ShopEgress", "shop_egress"]

HOST = "shop.test"


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    proxy_auth: str | None
    """A Proxy-Authorization that reached the shop (the proxy must strip it: always None)."""
    cookie: str | None
    form: dict[str, list[str]]
    authorization: str | None = None
    tls: bool = False


@dataclass
class Shop:
    port: int = 0
    tls_port: int = 0
    requests: list[Request] = field(default_factory=list)
    orders: list[str] = field(default_factory=list)
    """The names submitted with the order form, in order."""
    sessions: list[str] = field(default_factory=list)
    """Session cookies the shop handed out."""

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"

    @property
    def tls_url(self) -> str:
        return f"https://{HOST}:{self.tls_port}/"

    def count(self, method: str, path: str) -> int:
        return sum(1 for r in self.requests if r.method == method and r.path.split("?")[0] == path)


def _page(title: str, body: str) -> bytes:
    return (f"<!doctype html><html><head><title>{html.escape(title)}</title></head>"
            f"<body><h1>{html.escape(title)}</h1>{body}</body></html>").encode()


FORM = ('<form method="post" action="/order"><label>Name <input name="name" type="text"></label> '
        '<button type="submit">Place order</button></form><p><a href="/login">Log in</a></p>')


def _handler(shop: Shop) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _record(self, form: dict[str, list[str]]) -> None:
            shop.requests.append(Request(method=self.command, path=self.path,
                                         proxy_auth=self.headers.get("Proxy-Authorization"),
                                         cookie=self.headers.get("Cookie"), form=form,
                                         authorization=self.headers.get("Authorization"),
                                         tls=isinstance(self.connection, ssl.SSLSocket)))

        def _send(self, body: bytes, *, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            for name, value in headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._record({})
            path = self.path.split("?")[0]
            if path == "/":
                self._send(_page("Shop", FORM))
            elif path == "/login":
                session = secrets.token_hex(8)
                shop.sessions.append(session)
                self._send(_page("Logged in", FORM), headers=(("Set-Cookie", f"session={session}; Path=/"),))
            else:
                self._send(_page("Not found", ""), status=404)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            form = urllib.parse.parse_qs(self.rfile.read(length).decode())
            self._record(form)
            if self.path == "/order":
                name = form.get("name", [""])[0]
                shop.orders.append(name)
                self._send(_page("Ordered", f"<p>Thanks, {html.escape(name)}.</p>"))
            else:
                self._send(_page("Not found", ""), status=404)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def _serve(handler: type[http.server.BaseHTTPRequestHandler],
           tls: ssl.SSLContext | None) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, name="shop", daemon=True).start()
    return server


@dataclass
class ShopEgress:
    shop: Shop
    settings: Settings
    credential: ProxyCredential
    proxy_log: Path
    secret: str
    """The vault credential the proxy injects on the shop's TLS port (and nowhere else)."""
    asked: list[DecisionRequest] = field(default_factory=list)
    """Every decision the proxy asked for (the tool computer's identity is on each)."""
    decided: list[tuple[DecisionRequest, Verdict]] = field(default_factory=list)
    """Each request the decider answered, with its answer."""


def _config(settings: Settings) -> str:
    resolve = ", ".join(f'"{h}" = ["127.0.0.1"]' for h in settings.egress_resolve)
    allow = ", ".join(f'"{h}"' for h in settings.egress_allow_private)
    paths = "".join(f'{name} = "{path}"\n' for name, path in (("egress_upstream_ca", settings.egress_upstream_ca),
                                                                ("vault_key_file", settings.vault_key_file)) if path)
    bridge = (f'computer_network = "{settings.computer_network}"\nproxy_bridge_listen = '
              f'"{settings.proxy_bridge_listen}"\n') if settings.computer_network else ""
    if settings.computer_hosts:  # JSON strings are TOML basic strings
        bridge += f"computer_shared_dir = {json.dumps(str(settings.computer_shared_dir))}\n" + "".join(
            "\n[[computer_hosts]]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value
                                              in host.model_dump(mode="json", exclude_none=True).items())
            for host in settings.computer_hosts)
    return (f"proxy = true\nproxy_port = {settings.proxy_port}\nproxy_decider_timeout = "
            f'{settings.proxy_decider_timeout}\npolicies_dir = "{settings.policies}"\n'
            f"egress_allow_private = [{allow}]\negress_resolve = {{ {resolve} }}\n{paths}{bridge}")


@contextmanager
def shop_egress(directory: Path, *, user: str = "shopper", proxy_port: int | None = None,
                deployment: Path | None = None, network: tuple[str, str] | None = None,
                computer_hosts: list[dict[str, Any]] | None = None, computer_shared_dir: Path | None = None,
                ) -> Iterator[ShopEgress]:
    directory.mkdir(parents=True, exist_ok=True)
    shop = Shop()
    upstream_ca = make_test_ca(directory, [HOST])
    servers = [_serve(_handler(shop), None), _serve(_handler(shop), upstream_ca.server_context())]
    shop.port, shop.tls_port = (server.server_address[1] for server in servers)
    engine = make_engine(f"sqlite:///{directory / 'wakeful.db'}")
    migrate(engine)
    clock = FakeClock()
    with write(engine) as conn:
        user_id, _ = ensure_user(conn, name=user, now=clock.now())
        _, token = egress.issue_client_token(conn, user_id=user_id, label="tool computer", now=clock.now())
    settings = Settings(data_dir=directory, proxy=True, proxy_port=proxy_port or free_port(), proxy_decider_timeout=5.0,
                        policies_dir=directory / "policies", egress_resolve={HOST: ["127.0.0.1"]},
                        egress_allow_private=[HOST], egress_upstream_ca=upstream_ca.ca_file,
                        vault_key_file=deployment / "vault.key" if deployment is not None else None,
                        computer_network=network[0] if network else None,
                        proxy_bridge_listen=f"{network[1]}:3128" if network else None,
                        computer_hosts=computer_hosts or [], computer_shared_dir=computer_shared_dir)
    if deployment is not None:  # the deployment CA the image trusts, sealed under that deployment's vault key
        shutil.copytree(deployment / "proxy", settings.proxy_dir)
    secret = secrets.token_urlsafe(24)
    open_vault(settings).set("shop_key", secret.encode(), HOST, "Authorization", "Bearer {secret}")
    settings.policies.mkdir(exist_ok=True)
    (settings.policies / "egress.toml").write_text(
        f'[[allow]]\nname = "the test shop"\nhost = "{HOST}"\nports = [{shop.port}]\nmethods = ["GET", "POST"]\n'
        f'users = ["{user}"]\n\n'
        f'[[allow]]\nname = "the test shop over TLS"\nhost = "{HOST}"\nports = [{shop.tls_port}]\n'
        f'methods = ["GET", "POST"]\ncredential = "shop_key"\nusers = ["{user}"]\n')
    (directory / "wakeful.toml").write_text(_config(settings))
    lab = ShopEgress(shop=shop, settings=settings, credential=ProxyCredential(user_id=user_id, token=token),
                     proxy_log=directory / "proxy.log", secret=secret)
    service = DeciderService(engine, clock, settings)

    async def decide(req: DecisionRequest) -> Verdict:
        lab.asked.append(req)
        verdict = await service.decide(req)
        lab.decided.append((req, verdict))
        return verdict

    try:
        with decider_on_thread(settings, decide, service.record), proxy_child(settings, lab.proxy_log):
            yield lab
    finally:
        engine.dispose()
        for server in servers:
            server.shutdown()
            server.server_close()
