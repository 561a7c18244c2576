"""A tool computer's proxy credential stops working the moment it is replaced or revoked: issuing one again for the
same label revokes the earlier one, and `wakeful egress client --revoke LABEL` revokes it. A live proxy (the server's
own decider over the same database) then refuses it with `not_admitted`, and the refusal is in the audit.

The commands run through the `wakeful` entry point, as docs/egress.md shows them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from proxy_world import World, allow_rules, audited, recorded_world
from sqlalchemy import Engine

from tests.integration.test_cli import run
from tests.integration.test_cli_egress import BLOCKS, _bash
from wakeful.proxy.clock import FakeClock
from wakeful.server.settings import Settings


async def issue(data_dir: Path, label: str) -> str:
    """A new credential for `label`, as `wakeful egress client LABEL --user owner` prints it."""
    done = await asyncio.to_thread(run, data_dir, "egress", "client", label, "--user", "owner")
    return done.stdout.strip()


async def answer(w: World, credential: str) -> tuple[int, str | None]:
    """The status and refusal code of one GET through the proxy, in a tunnel opened with `credential`."""
    request = f"GET /shop HTTP/1.1\r\nHost: merchant.test:{w.merchant.port}\r\n\r\n".encode()
    status, headers, _ = await w.raw(request, auth=credential)
    return status, headers.get("x-wakeful-refusal")


@pytest.mark.anyio
async def test_issuing_a_label_again_revokes_its_earlier_credential_at_once_on_a_live_proxy(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        allow_rules(settings, w, ("shop", "merchant.test", '["GET"]'))
        first = await issue(tmp_path, "laptop")
        assert await answer(w, first) == (200, None)
        second, desk = await issue(tmp_path, "laptop"), await issue(tmp_path, "desk")
        assert await answer(w, first) == (403, "not_admitted")
        assert await answer(w, second) == (200, None) and await answer(w, desk) == (200, None)
        rows = await audited(w, engine)
    [refused] = [r for r in rows if r["verdict"] == "refuse"]
    assert (refused["code"], refused["user_id"], refused["path"]) == ("not_admitted", owner, "/shop")
    assert "revoked" in refused["rule"] and "laptop" in refused["rule"]
    assert first.partition(":")[2] not in str(rows)


@pytest.mark.anyio
async def test_the_revoke_command_in_the_docs_cuts_the_credential_off_a_live_proxy(
        tmp_path: Path, engine: Engine, clock: FakeClock, settings: Settings, owner: str) -> None:
    (revoke_block,) = [b for b in BLOCKS if "--revoke" in b]
    async with recorded_world(tmp_path, engine, clock, settings) as w:
        allow_rules(settings, w, ("shop", "merchant.test", '["GET"]'))
        credential = await issue(tmp_path, "my-laptop")
        assert await answer(w, credential) == (200, None)
        out = await asyncio.to_thread(_bash, tmp_path, revoke_block)
        assert "my-laptop" in out.stdout + out.stderr
        assert await answer(w, credential) == (403, "not_admitted")
        rows = await audited(w, engine)
    assert [(r["verdict"], r["code"]) for r in rows if r["path"] == "/shop"] == [
        ("refuse", "not_admitted"), ("allow", None)]


def test_client_help_says_that_issuing_again_revokes_and_how_to_revoke(tmp_path: Path) -> None:
    out = " ".join(run(tmp_path, "egress", "client", "--help").stdout.split())
    assert "--revoke LABEL" in out
    assert "Issuing again for the same LABEL revokes the earlier credential" in out


def test_revoking_a_label_that_has_no_credential_is_a_clear_error(tmp_path: Path, owner: str) -> None:
    refused = run(tmp_path, "egress", "client", "--revoke", "nothing-here", check=False)
    assert refused.returncode == 2 and "unknown_client" in refused.stderr and "nothing-here" in refused.stderr
    both = run(tmp_path, "egress", "client", "laptop", "--revoke", "laptop", check=False)
    assert both.returncode == 2 and "bad_arguments" in both.stderr
