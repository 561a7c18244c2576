"""Desktop observe/act for real: scrot and xdotool run through an sshd channel on a host Xvfb display, against a
headed chromium whose pages report every keystroke to a loopback site (the site's records are the evidence)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.support.chromium import HostChromium, Xvfb
from tests.support.polling import wait_until
from tests.support.sshd import Sshd
from tests.support.threaded import serving_on_thread
from wakeful.proxy.clock import FakeClock
from wakeful.vm.desktop import BadKeys, XDesktop, png_size
from wakeful.vm.observe import BumpReason, DesktopClick, DesktopKey, DesktopType, FrameSize, Refused, Surface
from wakeful.vm.ssh_channel import GuestChannel
from wakeful.vm.toolcomputer import ActResult, ToolComputer

pytestmark = pytest.mark.browser

SCREEN = (1024, 768)
TYPING_PAGE = """<!doctype html><title>{where}</title>
<textarea autofocus style="width:95vw;height:80vh"
  oninput="fetch('/typed?where={where}&v=' + encodeURIComponent(this.value))"></textarea>
<script>
  document.addEventListener('keydown', e => {{
    if (e.key === 'F2') window.open('/page/popup', '_blank', 'popup,left=0,top=0,width=700,height=500');
  }});
</script>"""


class KeySite(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _KeyHandler)
        self.typed: list[tuple[str, str]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def values(self, where: str) -> list[str]:
        with self.lock:
            return [v for w, v in self.typed if w == where]


class _KeyHandler(BaseHTTPRequestHandler):
    server: KeySite

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        if parts.path == "/typed":
            q = parse_qs(parts.query, keep_blank_values=True)
            with self.server.lock:
                self.server.typed.append((q["where"][0], q["v"][0]))
            body = b"ok"
        else:
            body = TYPING_PAGE.format(where=parts.path.rsplit("/", 1)[-1]).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def site() -> Iterator[KeySite]:
    with serving_on_thread(KeySite()) as server:
        yield server


@pytest.fixture
def screen(tmp_path: Path, site: KeySite) -> Iterator[Xvfb]:
    with Xvfb(tmp_path, size=SCREEN) as xvfb, \
            HostChromium(tmp_path / "chromium", display=xvfb.display, size=SCREEN, url=f"{site.url}/page/main"):
        yield xvfb


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[GuestChannel]:
    with Sshd(tmp_path / "sshd") as sshd:
        chan = GuestChannel(port=sshd.port, user="root", client_key_path=sshd.client_key,
                            pinned_host_key=sshd.host_public_key)
        chan.connect()
        yield chan
        chan.close()


@pytest.fixture
def desktop(channel: GuestChannel, screen: Xvfb, site: KeySite) -> XDesktop:
    desktop = XDesktop(channel, display=screen.display)
    wait_until(lambda: "main" in desktop.window()[1], 30, "chromium's window to show the page and take the focus")
    return desktop


def pointer(channel: GuestChannel, screen: Xvfb) -> tuple[int, int]:
    out = channel.run(["env", f"DISPLAY={screen.display}", "xdotool", "getmouselocation", "--shell"], timeout=10)
    fields = dict(line.split("=", 1) for line in out.check("getmouselocation").stdout.decode().split())
    return int(fields["X"]), int(fields["Y"])


def test_a_screenshot_is_a_png_of_the_whole_screen_with_the_focused_window(desktop: XDesktop) -> None:
    shot = desktop.capture()
    assert shot.screenshot.startswith(b"\x89PNG\r\n\x1a\n")
    assert png_size(shot.screenshot) == shot.view.frame == FrameSize(width=SCREEN[0], height=SCREEN[1])
    assert shot.view.surface is Surface.DESKTOP and shot.view.window and shot.view.window.isdigit()
    assert "main" in shot.title


def test_a_click_moves_the_pointer_there_even_when_it_is_already_there(
        desktop: XDesktop, channel: GuestChannel, screen: Xvfb) -> None:
    desktop.click(123, 456, expect_window=None)
    assert pointer(channel, screen) == (123, 456)
    desktop.click(123, 456, expect_window=None)
    desktop.click(300, 200, expect_window=None)
    assert pointer(channel, screen) == (300, 200)


def test_typed_text_reaches_the_program_verbatim(desktop: XDesktop, site: KeySite) -> None:
    hostile = """it's "quoted" $(id) `id`; | & \\ done"""
    desktop.click(400, 400, expect_window=None)
    desktop.type_text(hostile, expect_window=None)
    wait_until(lambda: hostile in site.values("main"), 15, "the page to report the typed text")
    desktop.key("ctrl+a BackSpace", expect_window=None)
    wait_until(lambda: site.values("main")[-1:] == [""], 15, "the page to report the text cleared")


def test_key_names_that_are_not_key_names_are_refused_before_anything_runs(desktop: XDesktop, site: KeySite) -> None:
    for keys in ("ctrl+a; touch /tmp/x", "$(id)", "", "a'b", "--help"):
        with pytest.raises(BadKeys):
            desktop.key(keys, expect_window=None)
    assert site.values("main") == []


def test_desktop_acts_go_through_observation_and_a_focus_change_stops_them(
        desktop: XDesktop, channel: GuestChannel, screen: Xvfb, site: KeySite, clock: FakeClock) -> None:
    tc = ToolComputer(vm_id="vm1", channel=channel, clock=clock, desktop=desktop)
    seen = tc.observe(Surface.DESKTOP)
    click = tc.act(DesktopClick(x=400, y=400, observation=seen.observation.number))
    assert isinstance(click, ActResult) and click.outcome == "done"
    seen = tc.observe(Surface.DESKTOP)
    typed = tc.act(DesktopType(text="hello", observation=seen.observation.number))
    assert isinstance(typed, ActResult) and typed.outcome == "done"
    wait_until(lambda: "hello" in site.values("main"), 15, "the page to report the typed text")

    seen = tc.observe(Surface.DESKTOP)
    main_window = seen.observation.view.window
    # Something opens a popup after the agent looked: it takes the keyboard focus.
    channel.run(["env", f"DISPLAY={screen.display}", "xdotool", "key", "F2"], timeout=10).check("F2")
    wait_until(lambda: desktop.window()[0] != main_window, 30, "the popup to take the focus")
    refused = tc.act(DesktopType(text="secret", observation=seen.observation.number))
    assert isinstance(refused, Refused)
    assert (refused.code, refused.bump) == ("stale_observation", BumpReason.FOCUS_CHANGE)

    fresh = tc.observe(Surface.DESKTOP)
    assert fresh.observation.view.window != main_window and "popup" in fresh.title
    typed = tc.act(DesktopType(text="visible", observation=fresh.observation.number))
    assert isinstance(typed, ActResult) and typed.outcome == "done"
    wait_until(lambda: "visible" in site.values("popup"), 15, "the popup to report the typed text")
    # The refused "secret" went nowhere: neither page ever saw it, and the popup saw only what came after.
    assert not any("secret" in v for v in site.values("main") + site.values("popup"))
    # Each keystroke's report is its own request, so they may arrive out of order: every one is a prefix of it.
    assert all("visible".startswith(v) for v in site.values("popup"))
    key = tc.act(DesktopKey(keys="ctrl+a", observation=fresh.observation.number))
    assert isinstance(key, Refused) and key.code == "observation_required"
