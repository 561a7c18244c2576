"""A user's tool computer through `wakeful serve` itself, driven by an MCP client over HTTP, on the real guest image
under real libvirt/QEMU: the first observe boots the VM; a handoff link reaches the user's notification sink and
opens, in headless Chromium, a live view that shows the guest's own desktop; while the user holds the screen the
agent's acts are refused and the user's input reaches the guest; "Return control" moves the epoch; a view-only link
(asked for with the curl command in docs/tool-computers.md) shows the same screen and carries no input; idle, the
sweeper suspends the VM to disk, and the next observe restores it.

The tests run in file order on one VM (a cold boot under TCG takes minutes). Timings are printed (-s), never
asserted; every wait is bounded.
"""

from __future__ import annotations

import base64
import json
import os
import re
import struct
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx2
import libvirt
import pytest
import websockets
from computer_lab import URI, qemu_pid
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from PIL import Image, ImageChops, ImageStat
from playwright.async_api import Page, async_playwright

from tests.support.chromium import CHROMIUM
from tests.support.polling import wait_until
from tests.support.serve import ServeProcess
from tests.support.sink import Sink
from wakeful.proxy.clock import FakeClock
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.lifecycle import VmInfo, VmManager, VmSettings
from wakeful.vm.lifecycle_rules import VmState
from wakeful.vm.ssh_channel import GuestChannel

pytestmark = [pytest.mark.vm, pytest.mark.anyio, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
WAKEFUL = Path(sys.executable).parent / "wakeful"
IDLE_AFTER = 30
"""Seconds without observe, act, handoff or live view before the sweeper suspends the VM (default 10 minutes)."""
TCG_CACHE_MIB = 384
"""`computer_tcg_cache`, not its default (512), so the domain shows the setting reached it."""
VCPUS = 1
"""`computer_vcpus`, not its default (2), likewise."""
TOOL_CALL_TIMEOUT = 900.0
"""The first observe cold-boots the guest and waits for Chromium: minutes under TCG."""
VIEWPORT = {"width": 1280, "height": 848}
"""The guest's screen is 1280x800; the live view's header takes 48 px."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Served:
    server: ServeProcess
    token: str
    sink: Sink
    data_dir: Path
    image: Path
    story: dict[str, Any] = field(default_factory=dict)
    """What one test leaves for the next (task id, the agent's observations)."""

    def manager(self) -> VmManager:
        """The VM records `wakeful serve` keeps under the data dir, read through the same library."""
        settings = VmSettings(data_dir=self.data_dir, base_image=self.image / "base.qcow2",
                              kernel=self.image / "vmlinux", initrd=self.image / "initrd.img")
        return VmManager(settings, LibvirtHypervisor(URI), clock=FakeClock())

    def vm(self) -> VmInfo:
        (vm,) = self.manager().vms()
        return vm

    def guest(self) -> GuestChannel:
        """A shell in the guest for the test's own checks, with the keys made at provisioning."""
        vm = self.vm()
        host, port = vm.ssh_endpoint
        channel = GuestChannel(host=host, port=port, user="root", client_key_path=vm.keys.client_key,
                               pinned_host_key=vm.keys.host_public)
        channel.connect(timeout=60)
        return channel

    def delivered(self, kind: str) -> list[dict[str, Any]]:
        """Bodies of the messages of this kind the user's notification sink received."""
        applied, _, _ = self.sink.snapshot()
        return [m["body"] for m in applied.values() if m["body"].get("kind") == kind]


@pytest.fixture(scope="module")
def served(libvirtd: None, guest_image: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    data_dir = tmp_path_factory.mktemp("served")
    (data_dir / "images").mkdir()
    (data_dir / "images" / "guest").symlink_to(guest_image)  # as if `wakeful image build` had run here
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")} | {"WAKEFUL_DATA_DIR": str(data_dir)}
    token = subprocess.run([str(WAKEFUL), "token"], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    with Sink() as sink:
        served = Served(server=ServeProcess({"WAKEFUL_DATA_DIR": str(data_dir), "WAKEFUL_NOTIFY_URL": sink.url,
                                             "WAKEFUL_COMPUTERS": "true",
                                             "WAKEFUL_COMPUTER_IDLE_AFTER": str(IDLE_AFTER),
                                             "WAKEFUL_COMPUTER_TCG_CACHE": str(TCG_CACHE_MIB),
                                             "WAKEFUL_COMPUTER_VCPUS": str(VCPUS),
                                             "WAKEFUL_SWEEP_INTERVAL": "5"},
                                            log_path=data_dir / "serve.log"),
                        token=token, sink=sink, data_dir=data_dir, image=guest_image)
        try:
            with served.server:
                yield served
        finally:
            manager = served.manager()  # the server is gone: destroy the domain it made
            for vm in manager.vms():
                manager.destroy(vm.user)


@asynccontextmanager
async def agent(served: Served) -> AsyncIterator[Client]:
    """An MCP client session over streamable HTTP with the user's token, as Claude Code would hold one."""
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {served.token}"},
                                  timeout=httpx2.Timeout(TOOL_CALL_TIMEOUT)) as http, \
            Client(streamable_http_client(f"{served.server.url}/mcp", http_client=http),
                   read_timeout_seconds=TOOL_CALL_TIMEOUT) as client:
        yield client


async def call(client: Client, tool: str, args: dict[str, Any]) -> tuple[dict[str, Any], bytes | None]:
    """A tool call that must succeed: its JSON, and the PNG if it carried one."""
    result = await client.call_tool(tool, args)
    assert not result.is_error, f"{tool}: {result.content}"
    body = json.loads(result.content[0].text)  # type: ignore[union-attr]
    images = [base64.b64decode(c.data) for c in result.content if c.type == "image"]  # type: ignore[union-attr]
    return body, images[0] if images else None


async def refused(client: Client, tool: str, args: dict[str, Any]) -> str:
    result = await client.call_tool(tool, args)
    assert result.is_error, f"{tool} was not refused: {result.content}"
    return result.content[0].text  # type: ignore[union-attr]


# -- the picture -----------------------------------------------------------------------------------------------------


INK = 24
"""Grey levels two pixels must differ by to count as different (above compression and scaling noise)."""


def _grey(png: bytes) -> Image.Image:
    return Image.open(BytesIO(png)).convert("L")


def mismatch(a: bytes, b: bytes) -> float:
    """The share of pixels that differ between two screenshots (the second brought to the first's size)."""
    first = _grey(a)
    differ = ImageChops.difference(first, _grey(b).resize(first.size)).point(lambda v: 255 if v > INK else 0)
    return float(ImageStat.Stat(differ).mean[0]) / 255


def ink(png: bytes) -> float:
    """The share of pixels that stand out from the picture's median grey: how much there is to recognise."""
    grey = _grey(png)
    return mismatch(png, _png(Image.new("L", grey.size, int(ImageStat.Stat(grey).median[0]))))


def _png(image: Image.Image) -> bytes:
    out = BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


CANVAS_DRAWN = """() => {
  const c = document.querySelector('#screen canvas');
  if (!c || c.width < 640) return false;
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let lit = 0;
  for (let i = 0; i < d.length; i += 4 * 101) if (d[i] + d[i + 1] + d[i + 2] > 60) lit++;
  return lit > 200;
}"""


async def live_view_shot(page: Page, link: str) -> bytes:
    """Open a live-view link, wait (bounded) until noVNC is connected and has drawn the guest's screen, and take a
    screenshot of the screen's canvas."""
    await page.goto(link)
    await page.wait_for_function("document.getElementById('status').textContent === 'connected'", timeout=120_000)
    await page.wait_for_function(CANVAS_DRAWN, timeout=120_000)
    return await page.locator("#screen canvas").screenshot()


async def rfb_pointer(page: Page, x: int, y: int) -> None:
    """A raw VNC viewer over the live view's websocket, as the page's own browser (its binder cookie, its origin):
    handshake, move the pointer to (x, y), then wait for the answer to an update request sent after it (x11vnc
    handles a client's messages in order)."""
    cookies = "; ".join(f"{c['name']}={c['value']}" for c in await page.context.cookies(page.url))
    origin = "/".join(page.url.split("/")[:3])
    async with websockets.connect(ws_url(page.url), subprotocols=["binary"], max_size=None, open_timeout=60,
                                  origin=origin, additional_headers={"Cookie": cookies}) as ws:
        pending = bytearray()

        async def take(n: int) -> bytes:
            while len(pending) < n:
                message = await ws.recv()
                pending.extend(message if isinstance(message, bytes) else message.encode())
            out = bytes(pending[:n])
            del pending[:n]
            return out

        assert (await take(12)).startswith(b"RFB 003.")
        await ws.send(b"RFB 003.008\n")
        (count,) = await take(1)
        assert 1 in await take(count), "x11vnc offers no authentication (-nopw): the SSH tunnel is the boundary"
        await ws.send(bytes([1]))
        assert await take(4) == b"\0\0\0\0"
        await ws.send(bytes([1]))  # ClientInit: shared
        server_init = await take(24)
        await take(int.from_bytes(server_init[20:24], "big"))
        await ws.send(struct.pack(">BBHH", 5, 0, x, y))  # PointerEvent, no buttons
        await ws.send(struct.pack(">BBHHHH", 3, 0, 0, 0, 1, 1))  # FramebufferUpdateRequest, not incremental
        assert (await take(1)) == b"\0", "a FramebufferUpdate answers the request"


def pointer(channel: GuestChannel) -> tuple[int, int]:
    out = channel.run(["env", "DISPLAY=:1", "xdotool", "getmouselocation"], timeout=60).check("xdotool")
    found = re.match(r"x:(\d+) y:(\d+)", out.stdout.decode())
    assert found, out.stdout
    return int(found[1]), int(found[2])


def ws_url(page_url: str) -> str:
    return page_url.replace("http://", "ws://", 1) + "/ws"


# -- the story -------------------------------------------------------------------------------------------------------


async def test_the_first_observe_through_wakeful_serve_boots_the_users_tool_computer(served: Served) -> None:
    async with agent(served) as client:
        created, _ = await call(client, "create_responsibility", {"title": "buy a ticket on the tool computer"})
        task_id = created["task_id"]
        started = time.perf_counter()
        seen, png = await call(client, "computer__observe", {"task_id": task_id, "surface": "desktop"})
        booted = time.perf_counter() - started
    vm = served.vm()
    assert vm.state is VmState.RUNNING and qemu_pid(vm.name) is not None
    assert png is not None and Image.open(BytesIO(png)).size == (1280, 800)
    domain = ET.fromstring(libvirt.open(URI).lookupByName(vm.name).XMLDesc(0))
    assert domain.findtext("vcpu") == str(VCPUS)
    cache = domain.find("features/tcg/tb-cache")
    if domain.get("type") == "qemu":  # TCG: the translation cache `computer_tcg_cache` asked for (libvirt says KiB)
        assert cache is not None and (cache.text, cache.get("unit")) == (str(TCG_CACHE_MIB * 1024), "KiB")
    else:
        assert cache is None
    served.story.update(task_id=task_id, epoch=seen["epoch"], observation=seen["observation"])
    accel = re.search(r"tool computers run under (\S+ \([^)]*\))", served.server.log())
    print(f"\ncold boot to first observation through wakeful serve: {booted:.1f} s "
          f"({accel[1] if accel else 'accel not logged'})")


async def test_a_handoff_link_shows_the_guest_desktop_and_takes_input_while_agent_acts_are_refused(
        served: Served) -> None:
    task_id = served.story["task_id"]
    async with agent(served) as client:
        await call(client, "computer__request_handoff", {"task_id": task_id, "reason": "a CAPTCHA"})
        (handoff,) = wait_until(lambda: served.delivered("handoff"), 60, "the handoff link at the user's sink")
        assert handoff["link"].startswith(f"{served.server.url}/v1/live/")
        blocked = await refused(client, "computer__act", {"task_id": task_id, "act": {
            "kind": "desktop_click", "x": 10, "y": 10, "observation": served.story["observation"]}})
        assert blocked.startswith("human_in_control"), blocked

        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = await browser.new_page(viewport=VIEWPORT)  # type: ignore[arg-type]
            shot = await live_view_shot(page, handoff["link"])
            Path(served.data_dir / "live-view.png").write_bytes(shot)
            # What the agent's own observation of the desktop shows at the same moment (reads go on meanwhile).
            _, desktop = await call(client, "computer__observe", {"task_id": task_id, "surface": "desktop"})
            assert desktop is not None
            off, there = mismatch(shot, desktop), ink(desktop)
            print(f"\nlive view vs the guest's desktop: {off:.2%} of pixels differ; {there:.2%} of the desktop "
                  f"stands out from its background; saved {served.data_dir / 'live-view.png'}")
            assert there > 0.01, "the guest desktop has something on it to recognise"
            assert off < there / 10, "the live view shows the guest's own desktop"
            assert mismatch(_png(Image.new("L", (1280, 800))), desktop) > 0.5, "and a black screen would not pass"

            # The user's input reaches the guest through the live view (the server taking input: x11vnc :5900).
            with served.guest() as guest:
                await rfb_pointer(page, 101, 77)
                assert pointer(guest) == (101, 77)
            served.story["live_session"] = page.url

            await page.get_by_role("button", name="Return control").click()
            await page.wait_for_load_state()
            assert "Control is back" in await page.content()
            await browser.close()

        seen, _ = await call(client, "computer__observe", {"task_id": task_id})
        assert seen["epoch"] > served.story["epoch"], "control came back: a new epoch, observed afresh"
        served.story["epoch"] = seen["epoch"]


def _docs_curl() -> str:
    """The view-only curl command exactly as docs/tool-computers.md shows it."""
    text = (ROOT / "docs" / "tool-computers.md").read_text()
    (command,) = re.findall(r"^    (curl .*?/v1/live/view)$", text.replace("\\\n", ""), re.M | re.S)
    return command


async def test_a_view_only_link_from_the_docs_shows_the_screen_and_carries_no_input(served: Served) -> None:
    command = _docs_curl().replace("http://127.0.0.1:8787", served.server.url)
    issued = subprocess.run(["bash", "-c", command], env={**os.environ, "TOKEN": served.token}, capture_output=True,
                            text=True, timeout=60, check=True)
    link = json.loads(issued.stdout)
    assert link["view_only"] is True and link["link"].startswith(f"{served.server.url}/v1/live/")

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = await browser.new_page(viewport=VIEWPORT)  # type: ignore[arg-type]
        shot = await live_view_shot(page, link["link"])
        assert await page.get_by_role("button", name="Return control").count() == 0
        with served.guest() as guest:
            before = pointer(guest)
            assert before != (333, 222)
            await rfb_pointer(page, 333, 222)
            assert pointer(guest) == before, "x11vnc -viewonly dropped the viewer's pointer"
        await browser.close()

    async with agent(served) as client:  # watching took nothing from the agent
        seen, desktop = await call(client, "computer__observe", {"task_id": served.story["task_id"],
                                                                 "surface": "desktop"})
    assert desktop is not None and mismatch(shot, desktop) < ink(desktop) / 10
    assert seen["epoch"] == served.story["epoch"], "a view-only session moves no epoch"


async def test_idle_the_sweeper_suspends_the_vm_to_disk_and_the_next_observe_restores_it(served: Served) -> None:
    t = time.perf_counter()
    wait_until(lambda: served.vm().state is VmState.SUSPENDED, IDLE_AFTER + 240,
               "the sweeper to suspend the idle tool computer")
    suspended_after = time.perf_counter() - t
    assert qemu_pid(served.vm().name) is None, "a suspended tool computer holds no RAM: its QEMU is gone"

    async with agent(served) as client:
        t = time.perf_counter()
        seen, png = await call(client, "computer__observe", {"task_id": served.story["task_id"],
                                                             "surface": "desktop"})
        restored = time.perf_counter() - t
    assert served.vm().state is VmState.RUNNING and png is not None
    assert seen["epoch"] > served.story["epoch"], "a restore moves the epoch"
    print(f"\nsuspended {suspended_after:.0f} s into the idle wait (idle_after {IDLE_AFTER} s); "
          f"restore to first observation through wakeful serve {restored:.1f} s")
