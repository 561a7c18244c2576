"""The tool computer's browser path for real: host chromium reached through an sshd forward (as in production, where
the forward goes to the guest's 127.0.0.1:9222), a loopback site whose own records are the evidence."""

from __future__ import annotations

import contextlib
import html
import re
import secrets
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from tests.support.chromium import HostChromium
from tests.support.polling import wait_until
from tests.support.sshd import Sshd
from tests.support.threaded import serving_on_thread
from wakeful.proxy.clock import FakeClock
from wakeful.vm.browser import NavigationFailed
from wakeful.vm.cdp_browser import CdpBrowser
from wakeful.vm.observe import BumpReason, Click, Fill, Navigate, NewTab, Press, Refused, Select, SwitchTab
from wakeful.vm.ssh_channel import GuestChannel
from wakeful.vm.toolcomputer import ActResult, ObserveResult, ToolComputer

pytestmark = pytest.mark.browser

FORM = """<!doctype html><title>Checkout</title><h1>Checkout</h1>
<form method="post" action="/submit">
  <label for="name">Name</label> <input id="name" name="name" value="placeholder">
  <label for="city">City</label>
  <select id="city" name="city"><option value="">Choose</option><option value="par">Paris</option>
    <option value="ber">Berlin</option></select>
  <button type="submit">Place order</button>
</form>"""

# A form whose page keeps its main thread busy right after the submit (a tracker flushing): Chromium posts the
# submission as a task, so the browser asks the network for it only after the act's round trip through the renderer.
BUSY_FORM = """<!doctype html><title>Busy</title>
<form method="post" action="/submit"
      onsubmit="setTimeout(() => { const t = Date.now(); while (Date.now() - t < 200); })">
  <input name="name" value="busy"> <button type="submit">Place order</button>
</form>"""

REPORT = """<!doctype html><title>Reports</title><h1>Reports</h1><a href="/report.csv">Download the report</a>"""

POST = """<!doctype html><title>Post</title><h1>A post</h1><a href="/like">Like this post</a>"""

OVERLAY = """<!doctype html><title>Overlay</title><h1>Promo</h1>
<button onclick="location='/clicked'">Buy now</button>
<div style="position:fixed;inset:0;background:rgba(0,0,0,.5)">Accept cookies first</div>"""


class Site(ThreadingHTTPServer):
    """The loopback site: what it received is the test's evidence, not what the browser reported."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _SiteHandler)
        self.lock = threading.Lock()
        self.orders: list[dict[str, str]] = []
        self.cookies_seen: list[str] = []
        self.clicked = 0
        self.downloads = 0
        self.likes = 0
        self.session = secrets.token_hex(8)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _SiteHandler(BaseHTTPRequestHandler):
    server: Site

    def _page(self, body: str, *, status: int = 200, headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        site = self.server
        if self.path == "/form":
            self._page(FORM)
        elif self.path == "/busy":
            self._page(BUSY_FORM)
        elif self.path == "/reports":
            self._page(REPORT)
        elif self.path == "/report.csv":
            with site.lock:
                site.downloads += 1
            self._page("month,orders\n2026-11,3\n",
                       headers={"Content-Disposition": 'attachment; filename="report.csv"'})
        elif self.path == "/post":
            self._page(POST)
        elif self.path == "/like":  # recorded, and nothing to show: the browser stays on the page
            with site.lock:
                site.likes += 1
            self.send_response(204)
            self.end_headers()
        elif self.path == "/overlay":
            self._page(OVERLAY)
        elif self.path == "/clicked":
            with site.lock:
                site.clicked += 1
            self._page("<h1>Clicked</h1>")
        elif self.path == "/done":
            self._page("<!doctype html><title>Thanks</title><h1>Thanks</h1><p>Your order is placed.</p>")
        elif self.path == "/whoami":
            cookie = self.headers.get("Cookie", "")
            with site.lock:
                site.cookies_seen.append(cookie)
            self._page(f"<!doctype html><title>Who</title><h1>Who am I</h1><p>{html.escape(cookie) or 'nobody'}</p>")
        else:
            self._page("<h1>Not found</h1>", status=404)

    def do_POST(self) -> None:
        site = self.server
        length = int(self.headers.get("Content-Length", "0"))
        fields = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode(), keep_blank_values=True).items()}
        with site.lock:
            site.orders.append(fields)
        self._page("", status=303, headers={"Location": "/done",
                                             "Set-Cookie": f"session={site.session}; Path=/; HttpOnly"})

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def site() -> Iterator[Site]:
    with serving_on_thread(Site()) as server:
        yield server


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostChromium]:
    with HostChromium(tmp_path_factory.mktemp("chromium") / "profile") as browser:
        yield browser


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    with Sshd(tmp_path / "sshd") as server:
        yield server


@pytest.fixture
def browser() -> CdpBrowser:
    return CdpBrowser()  # closed by the tool computer


@pytest.fixture
def tc(sshd: Sshd, chromium: HostChromium, browser: CdpBrowser, clock: FakeClock) -> Iterator[ToolComputer]:
    channel = GuestChannel(port=sshd.port, user="root", client_key_path=sshd.client_key,
                           pinned_host_key=sshd.host_public_key)
    computer = ToolComputer(vm_id="vm1", channel=channel, clock=clock, browser=browser,
                            cdp=("127.0.0.1", chromium.port))
    computer.connect()
    yield computer
    computer.close()


def done(result: ActResult | Refused) -> ActResult:
    assert isinstance(result, ActResult), result
    assert result.outcome == "done", result
    return result


def open_page(tc: ToolComputer, url: str) -> ObserveResult:
    seen = tc.observe()
    done(tc.act(Navigate(url=url, observation=seen.observation.number)))
    return tc.observe()


def texts(seen: ObserveResult) -> list[str]:
    return [e.name for e in seen.elements if e.role == "StaticText"]


class _Requests:
    """A TCP relay in front of DevTools that records every HTTP request line sent through it (`GET /json/version`,
    the websocket's `GET /devtools/browser/<id>`), keep-alive connections included. Websocket frames from a client
    are masked, so no request line is ever read out of one."""

    def __init__(self, port: int) -> None:
        self._target = ("127.0.0.1", port)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.lines: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self._target, timeout=10)
                threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if requests:
                    self.lines += [line.decode() for line in re.findall(rb"GET /[^ \r\n]*", data)]
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._server.close()


def test_a_reconnect_goes_straight_to_the_browsers_websocket_without_asking_for_it_again(
        chromium: HostChromium) -> None:
    # After a restore the browser (and the id in its websocket's path) is the same: asking /json/version again
    # would only cost an HTTP round trip through the guest.
    relay = _Requests(chromium.port)
    browser = CdpBrowser()
    try:
        browser.connect(relay.url)
        assert browser.tabs()
        browser.reconnect()
        assert browser.tabs()
    finally:
        browser.close()
        relay.close()
    asked = [line for line in relay.lines if line.startswith("GET /json/version")]
    upgrades = [line for line in relay.lines if line.startswith("GET /devtools/browser/")]
    assert (len(asked), len(upgrades)) == (1, 2), relay.lines


def test_the_browser_connection_rides_on_the_ssh_channel(
        tc: ToolComputer, browser: CdpBrowser, sshd: Sshd, chromium: HostChromium) -> None:
    tc.observe()
    assert browser.connected
    sshd.stop()  # chromium keeps running; only the tunnel goes away
    wait_until(lambda: not browser.connected, 15, "the CDP connection to drop with the SSH transport")
    assert chromium.pid is not None


def test_fill_select_and_click_by_ref_place_exactly_one_order(tc: ToolComputer, site: Site) -> None:
    form = open_page(tc, f"{site.url}/form")
    assert form.title == "Checkout"
    assert [(e.role, e.name) for e in form.elements if e.role in ("heading", "textbox", "combobox", "button")] == [
        ("heading", "Checkout"), ("textbox", "Name"), ("combobox", "City"), ("button", "Place order")]

    filled = done(tc.act(Fill(ref=form.ref_for("textbox", "Name"), text="Ada Lovelace")))
    assert (filled.role, filled.name, filled.may_have_changed_page) == ("textbox", "Name", True)
    form = tc.observe()
    assert next(e.value for e in form.elements if e.role == "textbox") == "Ada Lovelace"
    done(tc.act(Select(ref=form.ref_for("combobox", "City"), option="Paris")))
    form = tc.observe()
    submit = form.ref_for("button", "Place order")
    clicked = done(tc.act(Click(ref=submit)))
    assert clicked.navigated

    wait_until(lambda: site.orders, 15, "the site to receive the order")
    thanks = tc.observe()
    assert thanks.observation.view.url == f"{site.url}/done"
    assert thanks.bumped is BumpReason.NAVIGATION and thanks.observation.epoch == form.observation.epoch + 1
    assert "Your order is placed." in texts(thanks)

    # The submit button's ref is from before the navigation: refused, and the site sees no second order.
    again = tc.act(Click(ref=submit))
    assert isinstance(again, Refused) and again.code == "stale_observation"
    assert site.orders == [{"name": "Ada Lovelace", "city": "par"}]


@pytest.mark.parametrize(("path", "title", "detail", "received"), [
    ("/reports", "Reports", "a download began: report.csv", lambda site: site.downloads),
    ("/post", "Post", "the answer had no content (204): the page stays", lambda site: site.likes),
], ids=["download", "no content"])
def test_a_link_whose_answer_loads_no_document_is_no_navigation_and_the_page_stays(
        chromium: HostChromium, site: Site, path: str, title: str, detail: str,
        received: Callable[[Site], int]) -> None:
    browser = CdpBrowser()
    browser.connect(f"http://127.0.0.1:{chromium.port}")
    try:
        browser.navigate(f"{site.url}{path}")
        link = next(e for e in browser.capture().elements if e.role == "link")
        clicked = browser.click(link.node)
        # Before, the act took the answer for a navigation and waited out the whole navigation bound for a
        # document that never came, then said it navigated.
        assert not clicked.navigated
        assert clicked.detail == detail
        assert received(site) == 1  # the site answered the link once
        page = browser.capture()
        assert (page.title, page.view.url) == (title, f"{site.url}{path}")
    finally:
        browser.close()


def test_a_submission_chromium_starts_after_the_acts_round_trip_is_still_a_navigation(
        chromium: HostChromium, site: Site) -> None:
    browser = CdpBrowser()
    browser.connect(f"http://127.0.0.1:{chromium.port}")
    try:
        for n in range(1, 6):
            assert browser.navigate(f"{site.url}/busy").navigated
            page = browser.capture()
            button = next(e for e in page.elements if e.role == "button")
            clicked = browser.click(button.node)
            assert clicked.navigated, f"submission {n}"
            assert browser.capture().title == "Thanks"
            assert len(site.orders) == n
    finally:
        browser.close()


def test_after_a_navigation_that_failed_the_error_page_is_captured_and_the_next_one_works(
        chromium: HostChromium, site: Site) -> None:
    browser = CdpBrowser()
    browser.connect(f"http://127.0.0.1:{chromium.port}")  # straight to DevTools: through the SSH tunnel it hid
    try:
        # Through two sites first (127.0.0.1, then localhost: a renderer each), captured after each.
        for url in (f"{site.url}/form", f"{site.url.replace('127.0.0.1', 'localhost')}/form"):
            assert browser.navigate(url).navigated and browser.capture().title == "Checkout"
        with socket.socket() as probe:  # a port that was free a moment ago: the navigation is refused
            probe.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{probe.getsockname()[1]}/"
        with pytest.raises(NavigationFailed, match="ERR_CONNECTION_REFUSED"):
            browser.navigate(dead)
        # Chromium shows its error page from yet another renderer: the capture follows the tab there.
        assert browser.capture().view.url.startswith("chrome-error://")
        assert browser.navigate(f"{site.url}/form").navigated and browser.capture().title == "Checkout"
    finally:
        browser.close()


def test_a_navigation_behind_the_agents_back_refuses_the_act_and_nothing_runs(
        tc: ToolComputer, site: Site, chromium: HostChromium) -> None:
    form = open_page(tc, f"{site.url}/form")
    other = CdpBrowser()  # someone else drives the same browser (the user, a script on the page)
    try:
        other.connect(f"http://127.0.0.1:{chromium.port}")
        current = next(t for t in other.tabs() if t.url == f"{site.url}/form")
        other.select_tab(current.tab_id)
        other.navigate(f"{site.url}/done")
    finally:
        other.close()
    decision = tc.act(Click(ref=form.ref_for("button", "Place order")))
    assert isinstance(decision, Refused)
    assert (decision.code, decision.bump) == ("stale_observation", BumpReason.NAVIGATION)
    assert site.orders == []
    fresh = tc.observe()
    assert fresh.observation.view.url == f"{site.url}/done" and "Your order is placed." in texts(fresh)


def test_a_session_cookie_set_by_the_site_is_sent_back_and_readable(
        tc: ToolComputer, browser: CdpBrowser, site: Site) -> None:
    form = open_page(tc, f"{site.url}/form")
    done(tc.act(Press(key="Enter", ref=form.ref_for("textbox", "Name"))))  # Enter submits the form
    wait_until(lambda: site.orders, 15, "the site to receive the order")
    seen = tc.observe()
    done(tc.act(Navigate(url=f"{site.url}/whoami", observation=seen.observation.number)))
    who = tc.observe()
    assert f"session={site.session}" in texts(who)
    assert site.cookies_seen == [f"session={site.session}"]
    assert [(c["name"], c["value"]) for c in browser.cookies([site.url])] == [("session", site.session)]


def test_an_element_under_an_overlay_is_not_clicked(tc: ToolComputer, site: Site) -> None:
    page = open_page(tc, f"{site.url}/overlay")
    result = tc.act(Click(ref=page.ref_for("button", "Buy now")))
    assert isinstance(result, ActResult)
    assert (result.outcome, result.code) == ("failed", "element_obscured")
    assert site.clicked == 0


def test_tabs_open_switch_and_keep_their_ids(tc: ToolComputer, site: Site) -> None:
    first = open_page(tc, f"{site.url}/form")
    done(tc.act(NewTab(url=f"{site.url}/done", observation=first.observation.number)))
    second = tc.observe()
    assert second.observation.view.url == f"{site.url}/done"
    assert first.observation.tab_id in {t.tab_id for t in second.tabs}
    assert second.observation.tab_id != first.observation.tab_id
    assert first.observation.tab_id is not None
    done(tc.act(SwitchTab(tab_id=first.observation.tab_id, observation=second.observation.number)))
    back = tc.observe()
    assert back.observation.tab_id == first.observation.tab_id and back.title == "Checkout"


def test_after_a_restore_the_page_is_intact_old_refs_are_refused_and_a_fresh_observation_works(
        tc: ToolComputer, site: Site, sshd: Sshd) -> None:
    form = open_page(tc, f"{site.url}/form")
    done(tc.act(Fill(ref=form.ref_for("textbox", "Name"), text="Grace")))
    form = tc.observe()
    sshd.restart()  # the VM's process was replaced: SSH and CDP connections are dead, the browser lived on

    report = tc.after_restore(observe=True)
    assert report.observation is not None
    assert report.observation.observation.epoch == form.observation.epoch + 1
    assert report.observation.observation.view.url == f"{site.url}/form"
    assert next(e.value for e in report.observation.elements if e.role == "textbox") == "Grace"
    t = report.timings
    assert t.cdp_reconnect is not None and t.first_observation is not None and t.total >= t.ssh_reconnect

    stale = tc.act(Click(ref=form.ref_for("button", "Place order")))
    assert isinstance(stale, Refused) and stale.code == "stale_observation"
    assert site.orders == []
    done(tc.act(Click(ref=report.observation.ref_for("button", "Place order"))))
    wait_until(lambda: site.orders, 15, "the site to receive the order")
    assert site.orders == [{"name": "Grace", "city": ""}]
