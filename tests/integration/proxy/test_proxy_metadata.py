"""A host allowed to be private that resolves to a cloud-metadata or link-local address is refused, never dialled.

The resolver is the static map (a stub answering what a hostile DNS would), and the dialler is replaced by a spy
that records and refuses: no test here ever connects to a link-local address for real.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from proxy_world import CLIENT_TOKEN, RecordingMap, allow_tool, refusal_code, world

pytestmark = pytest.mark.anyio


def spy_dials(w: object, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Every dial the proxy attempts, recorded and failed instead of made."""
    dials: list[tuple[str, ...]] = []

    async def pooled(ips: list[str], port: int, scheme: str, host: str) -> object:
        dials.append((host, *ips))
        raise OSError("the spy does not connect")

    async def raw(ips: list[str], port: int, host: str) -> object:
        dials.append((host, *ips))
        raise OSError("the spy does not connect")

    monkeypatch.setattr(w.proxy._shared.pool, "dial", pooled)  # type: ignore[attr-defined]
    monkeypatch.setattr(w.proxy, "_dial_raw", raw)  # type: ignore[attr-defined]
    return dials


@pytest.mark.parametrize("address", ["169.254.169.254", "::ffff:169.254.169.254", "fd00:ec2::254",
                                     "64:ff9b::a9fe:a9fe", "fe80::1"])
async def test_an_allowed_private_host_resolving_to_a_metadata_address_is_refused_before_any_dial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, address: str) -> None:
    resolve = RecordingMap({"merchant.test": [address], "plain.test": ["127.0.0.1", address]})
    async with world(tmp_path, allow_tool(None), resolve=resolve) as w, w.client() as client:
        dials = spy_dials(w, monkeypatch)
        for url in (w.url("merchant.test", "/latest/meta-data/"), w.url("plain.test", "/x", scheme="http")):
            response = await client.get(url)
            assert (response.status_code, refusal_code(response)) == (403, "address_not_allowed"), url
        assert dials == [] and w.dialled == 0
        assert resolve.looked_up == ["merchant.test", "plain.test"]  # allowed by the decider, then resolved
        records = await w.decider.wait_records(2)
        assert [(r.verdict, r.code) for r in records] == [("refuse", "address_not_allowed")] * 2


async def test_a_pinned_tunnel_to_a_metadata_address_is_refused_before_any_dial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resolve = RecordingMap({"pinned.test": ["fd00:ec2::254"]})
    async with world(tmp_path, allow_tool(None), resolve=resolve) as w:
        dials = spy_dials(w, monkeypatch)
        async with httpx.AsyncClient(proxy=f"http://usr_1:{CLIENT_TOKEN}@127.0.0.1:{w.proxy.port}",
                                     trust_env=False, timeout=10) as client:
            with pytest.raises(httpx.ProxyError, match="403"):
                await client.get(w.url("pinned.test", "/"))
        assert dials == [] and w.pinned.connections == 0
        [record] = await w.decider.wait_records(1, tunnels=True)
        assert (record.method, record.verdict, record.code) == ("CONNECT", "refuse", "address_not_allowed")
