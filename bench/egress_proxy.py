"""The egress proxy beside direct requests and beside mitmproxy, in one run: added latency p50/p99 and requests per
second, for HTTP and HTTPS, with keep-alive and with a fresh connection per request.

wakeful is measured as it runs: `wakeful serve` starts the proxy, which asks the server's decider for every request
(a tool computer's proxy credential is checked in SQLite and the egress allowlist matched) and injects a credential
from the vault into HTTPS requests. mitmproxy (`mitmdump` from PyPI, in .tools/mitmproxy) runs an add-on that adds
the same header to the same requests and asks nobody. Upstream and load generator are the same raw-asyncio
processes for all three (bench/_proxyload.py); everything listens on 127.0.0.1.
"""

from __future__ import annotations

import base64
import json
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    BENCH_DIR,
    PYTHON,
    ROOT,
    WAKEFUL,
    Row,
    Table,
    bench_args,
    fmt_ms,
    fmt_rate,
    free_port,
    percentile,
    print_and_save,
    reproduce,
    start_serve,
    verdict,
)

sys.path.insert(0, str(ROOT))  # the throwaway upstream CA lives with the tests
from tests.support.tlsca import make_test_ca

MITMDUMP = ROOT / ".tools" / "mitmproxy" / "bin" / "mitmdump"
HOST = "upstream.test"
SECRET = "bench-secret-value"

ADDON = """\
from mitmproxy import http


class Inject:
    def request(self, flow: http.HTTPFlow) -> None:
        if flow.request.scheme == "https" and flow.request.pretty_host == "127.0.0.1":
            for name in ("authorization", "proxy-authorization", "x-api-key"):
                flow.request.headers.pop(name, None)
            flow.request.headers["authorization"] = "Bearer {secret}"


addons = [Inject()]
"""
# mitmproxy is given the upstream's address, not its name: it has no static resolver, and rewriting the address in
# a server_connect hook makes it reconnect per request (and, here, stall a keep-alive connection).


def _listening(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listened on 127.0.0.1:{port} within {timeout} s")


def _client(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run([str(PYTHON), str(BENCH_DIR / "_proxyload.py"), "client", json.dumps(spec)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"load client failed for {spec}: {out.stderr[-600:]}")
    return json.loads(out.stdout)


def _wakeful_setup(tmp: Path, http_port: int, https_port: int, upstream_ca: Path) -> tuple[Any, int, str, Path]:
    data = tmp / "wakeful"
    (data / "policies").mkdir(parents=True)
    (data / "policies" / "egress.toml").write_text(
        f'[[allow]]\nname = "bench https"\nhost = "{HOST}"\nports = [{https_port}]\nmethods = ["GET"]\n'
        f'credential = "bench_api"\n\n[[allow]]\nname = "bench http"\nhost = "{HOST}"\nports = [{http_port}]\n'
        'methods = ["GET"]\n')
    proxy_port = free_port()
    (data / "wakeful.toml").write_text(
        f'proxy = true\nproxy_port = {proxy_port}\negress_upstream_ca = "{upstream_ca}"\n'
        f'egress_allow_private = ["{HOST}"]\negress_resolve = {{ "{HOST}" = ["127.0.0.1"] }}\n')
    env = {"WAKEFUL_DATA_DIR": str(data), "WAKEFUL_CONFIG": str(data / "wakeful.toml"), "PATH": "/usr/bin:/bin"}
    subprocess.run([str(WAKEFUL), "secret", "set", "bench_api", "--host", HOST], input=SECRET.encode(), env=env,
                   check=True, capture_output=True)
    server = start_serve(data, env={"WAKEFUL_PROXY": "true", "WAKEFUL_PROXY_PORT": str(proxy_port)})
    credential = subprocess.run([str(WAKEFUL), "egress", "client", "bench"], env=env, check=True,
                                capture_output=True, text=True).stdout.strip()
    ca = data / "deployment-ca.pem"
    subprocess.run([str(WAKEFUL), "proxy", "ca", "-o", str(ca)], env=env, check=True, capture_output=True)
    return server, proxy_port, "Basic " + base64.b64encode(credential.encode()).decode(), ca


def _trivial_setup(tmp: Path, upstream_ca: Path) -> tuple[list[subprocess.Popen[bytes]], int, Path]:
    """The same `wakeful proxy` (same vault secret, same settings) asking a decider that allows everything at once
    and stores no audit: the difference to the real run is what the server's decision and audit cost."""
    data = tmp / "trivial"
    run_dir = data / "run"
    run_dir.mkdir(parents=True, mode=0o700)
    port = free_port()
    (data / "wakeful.toml").write_text(
        f'proxy = true\nproxy_port = {port}\negress_upstream_ca = "{upstream_ca}"\n'
        f'egress_allow_private = ["{HOST}"]\negress_resolve = {{ "{HOST}" = ["127.0.0.1"] }}\n')
    env = {"WAKEFUL_DATA_DIR": str(data), "WAKEFUL_CONFIG": str(data / "wakeful.toml"), "PATH": "/usr/bin:/bin"}
    subprocess.run([str(WAKEFUL), "secret", "set", "bench_api", "--host", HOST], input=SECRET.encode(), env=env,
                   check=True, capture_output=True)
    token = run_dir / "decider.token"
    token.write_text(secrets.token_urlsafe(32))
    token.chmod(0o600)
    socket_path = run_dir / "decider.sock"
    procs = [subprocess.Popen([str(PYTHON), str(BENCH_DIR / "_proxyload.py"), "decider", str(socket_path),
                               str(token), "bench_api"])]
    deadline = time.monotonic() + 30
    while not socket_path.exists():
        if time.monotonic() > deadline or procs[0].poll() is not None:
            raise RuntimeError("the always-allow decider did not start")
        time.sleep(0.05)
    procs.append(subprocess.Popen([str(WAKEFUL), "proxy"], env=env, stdout=subprocess.DEVNULL,
                                  stderr=(tmp / "trivial-proxy.log").open("wb")))
    _listening(port)
    ca = data / "deployment-ca.pem"
    subprocess.run([str(WAKEFUL), "proxy", "ca", "-o", str(ca)], env=env, check=True, capture_output=True)
    return procs, port, ca


def _mitm_setup(tmp: Path, upstream_ca: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    confdir = tmp / "mitm"
    confdir.mkdir()
    addon = confdir / "inject.py"
    addon.write_text(ADDON.format(secret=SECRET))
    port = free_port()
    proc = subprocess.Popen(
        [str(MITMDUMP), "--listen-host", "127.0.0.1", "-p", str(port), "-q", "-s", str(addon),
         "--set", f"confdir={confdir}", "--set", f"ssl_verify_upstream_trusted_ca={upstream_ca}"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "mitm.log").open("wb"))
    _listening(port)
    return proc, port, confdir / "mitmproxy-ca-cert.pem"


def _target(scheme: str, port: int, cafile: Path, proxy: int | None = None, auth: str | None = None,
            host: str = HOST) -> dict[str, Any]:
    return {"scheme": scheme, "host": host, "port": port, "cafile": str(cafile), "proxy": proxy, "proxy_auth": auth}


def run(quick: bool) -> list[Table]:
    n_keep, n_fresh = (300, 60) if quick else (2000, 300)
    seconds, connections = (2.0, 8) if quick else (6.0, 16)
    tables: list[Table] = []
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-proxy-") as tmp_name:
        tmp = Path(tmp_name)
        ca = make_test_ca(tmp, [HOST])
        http_port, https_port = free_port(), free_port()
        upstream = subprocess.Popen([str(PYTHON), str(BENCH_DIR / "_proxyload.py"), "upstream", str(http_port),
                                     str(https_port), str(ca.leaf_file)])
        server = mitm = None
        trivial: list[subprocess.Popen[bytes]] = []
        try:
            _listening(http_port)
            _listening(https_port)
            server, wk_port, wk_auth, wk_ca = _wakeful_setup(tmp, http_port, https_port, ca.ca_file)
            trivial, tr_port, tr_ca = _trivial_setup(tmp, ca.ca_file)
            mitm, mitm_port, mitm_ca = _mitm_setup(tmp, ca.ca_file)
            for scheme, port in (("https", https_port), ("http", http_port)):
                targets = {
                    "direct": _target(scheme, port, ca.ca_file),
                    "wakeful": _target(scheme, port, wk_ca, wk_port, wk_auth),
                    "always-allow": _target(scheme, port, tr_ca, tr_port, wk_auth),
                    "mitmproxy": _target(scheme, port, mitm_ca, mitm_port, host="127.0.0.1"),
                }
                rows: list[Row] = []
                for fresh, n in ((False, n_keep), (True, n_fresh)):
                    mode = "fresh connections" if fresh else "keep-alive"
                    lat = {name: _client({"kind": "latency", "target": t, "n": n, "fresh": fresh})["samples"]
                           for name, t in targets.items()}
                    direct50, direct99 = percentile(lat["direct"], 50), percentile(lat["direct"], 99)
                    for p, direct in ((50, direct50), (99, direct99)):
                        ours = percentile(lat["wakeful"], p) - direct
                        theirs = percentile(lat["mitmproxy"], p) - direct
                        target = "≤ 2 ms" if (scheme, fresh, p) == ("https", False, 50) else "-"
                        met = ours <= 0.002 if target != "-" else None
                        rows.append(Row(f"{mode}: added latency p{p} (direct p{p} {fmt_ms(direct)})", fmt_ms(ours),
                                        f"{fmt_ms(theirs)} (mitmproxy)", target, verdict(met)))
                        rows.append(Row(f"{mode}: added latency p{p}, always-allow decider",
                                        fmt_ms(percentile(lat["always-allow"], p) - direct), "-"))
                    rate = {name: _client({"kind": "throughput", "target": t, "connections": connections,
                                           "seconds": seconds, "fresh": fresh}) for name, t in targets.items()}
                    ratio = rate["wakeful"]["rate"] / rate["mitmproxy"]["rate"] if rate["mitmproxy"]["rate"] else 0
                    errors = {k: int(v["errors"]) for k, v in rate.items() if v["errors"]}
                    rows.append(Row(f"{mode}: requests/s, {connections} connections "
                                    f"(direct {fmt_rate(rate['direct']['rate'])})",
                                    f"{fmt_rate(rate['wakeful']['rate'])} ({ratio:.2f}x mitmproxy)",
                                    f"{fmt_rate(rate['mitmproxy']['rate'])} (mitmproxy)", "≥ 3x mitmproxy",
                                    verdict(ratio >= 3.0) + (f" errors {errors}" if errors else "")))
                    rows.append(Row(f"{mode}: requests/s, always-allow decider",
                                    f"{fmt_rate(rate['always-allow']['rate'])}", "-"))
                notes = ["added latency = the proxied percentile minus the direct one, same client, same upstream",
                         "wakeful asks its decider (SQLite, allowlist) per request; mitmproxy's add-on asks nobody",
                         "always-allow decider: the same proxy, its decider answering at once and storing no audit",
                         "mitmproxy is addressed by IP (it has no static resolver); wakeful by name via egress_resolve"]
                if scheme == "https":
                    notes.append("HTTPS: both proxies intercept TLS with their own CA and inject Authorization")
                tables.append(Table(title=f"egress proxy, {scheme.upper()}: wakeful vs direct vs mitmproxy",
                                    rows=rows, reproduce=reproduce("egress_proxy.py", quick), notes=notes))
        finally:
            for proc in (mitm, upstream, *reversed(trivial)):
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=10)
            if server is not None:
                server.stop()
    return tables


if __name__ == "__main__":
    args = bench_args(__doc__ or "")
    print_and_save(run(args.quick), "egress_proxy.txt")
