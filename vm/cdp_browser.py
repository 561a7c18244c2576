"""The browser adapter: Playwright over CDP (the only module that imports Playwright).

It implements `vm.browser.Browser`; the values it returns and the errors it raises are declared there.

    browser = CdpBrowser()
    browser.connect("http://127.0.0.1:<local forward to the guest's 9222>")
    page = browser.capture()                 # view, tabs, interesting accessibility nodes, PNG screenshot
    browser.click(page.elements[3].node)      # acts name elements by backendDOMNodeId, never by selector

Accessibility comes from CDP (`Accessibility.getFullAXTree`) through one session per page, reused; acts resolve
a backendDOMNodeId (`DOM.scrollIntoViewIfNeeded`, `DOM.getContentQuads`, `DOM.resolveNode`) and use Playwright's
mouse and keyboard. A click first checks that the element is what the pointer would hit, so an overlay is
reported (`element_obscured`) instead of clicked.

Playwright's objects belong to one event loop: the adapter runs its own loop on a private thread and every public
method is a bounded call into it, so callers may use it from any thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from playwright.async_api import Browser as PwBrowser  # noqa: TID251 - the one module that uses Playwright
from playwright.async_api import BrowserContext, CDPSession, Page, Playwright, Request, Response, async_playwright  # noqa: TID251
from playwright.async_api import Error as PwError  # noqa: TID251

from wakeful.vm.accessibility import interesting_elements
from wakeful.vm.browser import (
    BrowserDisconnected,
    BrowserError,
    BrowserTimeout,
    Effect,
    ElementGone,
    ElementObscured,
    NavigationFailed,
    NoSuchOption,
    NoSuchTab,
    NotEditable,
    PageCapture,
    Tab,
)
from wakeful.vm.observe import FrameSize, Surface, View

__all__ = ["CdpBrowser"]

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------ page JS

_HIT_TEST = """function(x, y) {
  const target = this.nodeType === Node.TEXT_NODE ? this.parentElement : this;
  let hit = document.elementFromPoint(x, y);
  while (hit && hit.shadowRoot) {
    const inner = hit.shadowRoot.elementFromPoint(x, y);
    if (!inner || inner === hit) break;
    hit = inner;
  }
  return !!(target && hit && (target === hit || target.contains(hit)));
}"""

_PREPARE_FILL = """function() {
  const e = this;
  const blocked = ["checkbox", "radio", "button", "submit", "reset", "file", "image", "color", "range", "hidden"];
  let ok = false;
  if (e.isContentEditable) ok = true;
  else if (e instanceof HTMLTextAreaElement) ok = !e.readOnly && !e.disabled;
  else if (e instanceof HTMLInputElement) ok = !blocked.includes(e.type) && !e.readOnly && !e.disabled;
  if (!ok) return false;
  e.focus();
  if (typeof e.select === "function") e.select();
  else document.getSelection().selectAllChildren(e);
  return true;
}"""

_SELECT_OPTION = """function(wanted) {
  if (!(this instanceof HTMLSelectElement)) return {error: "not a drop-down (<select>)"};
  const options = Array.from(this.options);
  const norm = s => s.trim().toLowerCase();
  const o = options.find(o => o.value === wanted) || options.find(o => o.label === wanted)
         || options.find(o => norm(o.label) === norm(wanted));
  if (!o) return {error: "no option " + JSON.stringify(wanted), options: options.map(o => o.label).slice(0, 50)};
  if (o.disabled) return {error: "option " + JSON.stringify(o.label) + " is disabled"};
  this.value = o.value;
  this.dispatchEvent(new Event("input", {bubbles: true}));
  this.dispatchEvent(new Event("change", {bubbles: true}));
  return {value: o.value, label: o.label};
}"""


# ------------------------------------------------------------------------------------------------ internals


class _Loop:
    """An asyncio loop on its own daemon thread; `call` runs a coroutine there and waits a bounded time."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="browser-loop", daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("the browser adapter cannot be called from its own loop")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise BrowserTimeout(f"the browser did not answer within {timeout:g} s") from None

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass(eq=False)
class _PageSession:
    page: Page
    cdp: CDPSession
    target_id: str
    navigations: int = 0
    """Main-frame navigations seen so far: asked for by the page (`Page.frameRequestedNavigation`, which the renderer
    sends before it answers anything asked after the act) or requested from the network."""
    checked: int = 0
    """`navigations` when `cdp` was last known to reach the tab's document."""
    loaded: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the main frame's document reached DOMContentLoaded, or its navigation turned out to load none
    (`nowhere`); cleared by each navigation."""
    nowhere: str = ""
    """Why the main frame's last navigation loads no document, "" while it may: the download its answer began, or an
    answer without content (204, 205)."""
    watched: CDPSession | None = None
    """The CDP session `Page.frameRequestedNavigation` is counted from (None until the first act)."""

    def navigating(self) -> None:
        """The main frame asked for a navigation, or the network for its document: no document of it loaded yet."""
        self.navigations += 1
        self.nowhere = ""
        self.loaded.clear()

    def ends_nowhere(self, why: str) -> None:
        """The main frame's navigation loads no document, and the page stays."""
        self.nowhere = why
        self.loaded.set()


class CdpBrowser:
    def __init__(self, *, timeout: float = 30.0, navigation_timeout: float = 15.0, max_elements: int = 300,
                 max_text: int = 160) -> None:
        """`timeout` bounds every call (chromium under TCG needs ~10 s for a new tab); `navigation_timeout` bounds
        the wait for a navigation an act started."""
        self._timeout = timeout
        self._nav_timeout = navigation_timeout
        self._max_elements = max_elements
        self._max_text = max_text
        self._loop = _Loop()
        self._url: str | None = None
        self._endpoints: dict[str, str] = {}
        """The DevTools websocket learnt for each http:// address (its /json/version): a reconnect to the same
        address goes straight to it, one HTTP round trip through the guest fewer after a restore (the browser, and
        the id in its websocket's path, outlive a save and restore)."""
        self._pw: Playwright | None = None
        self._browser: PwBrowser | None = None
        self._sessions: dict[Page, _PageSession] = {}
        self._current: str | None = None

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        try:
            return self._loop.call(coro, self._timeout if timeout is None else timeout)
        except PwError as exc:
            if self._browser is None or not self._browser.is_connected():
                raise BrowserDisconnected(f"the CDP connection is gone: {exc.message}") from None
            raise BrowserError(exc.message) from None

    # -------------------------------------------------------------------------------------- connection

    @property
    def connected(self) -> bool:
        return self._browser is not None and self._browser.is_connected()

    def connect(self, cdp_url: str) -> None:
        self._url = cdp_url
        self._call(self._connect())

    def reconnect(self) -> None:
        """Drop the old CDP connection (dead after a restore) and attach again to the same URL."""
        if self._url is None:
            raise BrowserDisconnected("connect() was never called")
        self._call(self._connect())

    async def _connect(self) -> None:
        assert self._url is not None
        if self._pw is None:
            self._pw = await async_playwright().start()
        old, self._browser = self._browser, None
        self._sessions.clear()
        if old is not None:
            with contextlib.suppress(PwError, TimeoutError):
                await asyncio.wait_for(old.close(), 5)
        known = self._endpoints.get(self._url)
        if known is not None:
            try:
                self._browser = await self._pw.chromium.connect_over_cdp(known, timeout=self._timeout * 1000,
                                                                         no_defaults=True)
                return
            except PwError:
                del self._endpoints[self._url]  # another browser answers there now: ask it over HTTP
        endpoint = await self._websocket_of(self._url)
        self._browser = await self._pw.chromium.connect_over_cdp(endpoint or self._url, timeout=self._timeout * 1000,
                                                                 no_defaults=True)
        if endpoint is not None:
            self._endpoints[self._url] = endpoint

    async def _websocket_of(self, url: str) -> str | None:
        """The browser's DevTools websocket address from `url`/json/version (what Playwright would ask for), or None
        to leave the asking, and the error, to Playwright."""
        try:
            async with httpx.AsyncClient(timeout=self._timeout, trust_env=False) as client:
                reply = await client.get(f"{url.rstrip('/')}/json/version")
                reply.raise_for_status()
                endpoint = reply.json()["webSocketDebuggerUrl"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return None
        return endpoint if isinstance(endpoint, str) and endpoint.startswith("ws") else None

    def _context(self) -> BrowserContext:
        if self._browser is None or not self._browser.is_connected():
            raise BrowserDisconnected("not connected to the browser")
        contexts = self._browser.contexts
        if not contexts:
            raise BrowserDisconnected("the browser has no default context")
        return contexts[0]

    async def _session(self, page: Page) -> _PageSession:
        session = self._sessions.get(page)
        if session is None:
            cdp = await page.context.new_cdp_session(page)
            info = await cdp.send("Target.getTargetInfo")
            session = _PageSession(page=page, cdp=cdp, target_id=info["targetInfo"]["targetId"])
            page.on("request", lambda request: self._on_request(session, request))
            page.on("response", lambda response: self._on_response(session, response))
            page.on("domcontentloaded", lambda _page: session.loaded.set())
            page.on("close", self._forget)
            self._sessions[page] = session
        elif session.checked != session.navigations:
            session.checked = session.navigations
            try:
                await session.cdp.send("Page.getFrameTree")
            except PwError:
                await self._reattach(session)
        return session

    async def _reattach(self, session: _PageSession) -> None:
        """A navigation moved the tab's document to another renderer (an error page; a cross-site page), and the
        CDP session attached to the old one now answers "Not attached to an active page": attach a new one to the
        same tab, keeping what was counted on it."""
        with contextlib.suppress(PwError):
            await session.cdp.detach()
        session.cdp = await session.page.context.new_cdp_session(session.page)
        info = await session.cdp.send("Target.getTargetInfo")
        if self._current == session.target_id:
            self._current = info["targetInfo"]["targetId"]
        session.target_id = info["targetInfo"]["targetId"]

    @staticmethod
    async def _watch_requests(session: _PageSession) -> None:
        """Count the main frame's navigations as the page asks for them, from before the first act on this CDP
        session (not at attach: the first observation after a restore waits for nothing it does not need). The
        network request comes later, from the browser process, and on a loaded host after the act's round trip
        through the renderer: a form's submission (a task Chromium posts) was then taken for no navigation."""
        if session.watched is session.cdp:
            return
        def requested(event: dict[str, Any]) -> None:
            if event.get("frameId") == session.target_id and event.get("disposition") == "currentTab":
                session.navigating()

        def download(event: dict[str, Any]) -> None:  # the navigation's answer was a file: no document will load
            if event.get("frameId") == session.target_id:
                name = event.get("suggestedFilename") or event.get("url") or "a file"
                session.ends_nowhere(f"a download began: {name}")
        session.cdp.on("Page.frameRequestedNavigation", requested)
        session.cdp.on("Page.downloadWillBegin", download)
        await session.cdp.send("Page.enable")
        session.watched = session.cdp

    def _forget(self, page: Page) -> None:
        self._sessions.pop(page, None)

    @staticmethod
    def _on_request(session: _PageSession, request: Request) -> None:
        if request.is_navigation_request() and request.frame == session.page.main_frame:
            session.navigating()

    @staticmethod
    def _on_response(session: _PageSession, response: Response) -> None:
        if response.status in (204, 205) and response.request.is_navigation_request() \
                and response.frame == session.page.main_frame:
            session.ends_nowhere(f"the answer had no content ({response.status}): the page stays")

    async def _pages(self) -> list[_PageSession]:
        return [await self._session(p) for p in self._context().pages if not p.is_closed()]

    async def _current_session(self) -> _PageSession:
        sessions = await self._pages()
        if not sessions:
            raise NoSuchTab("the browser has no open tab")
        for s in sessions:
            if s.target_id == self._current:
                return s
        chosen = sessions[0]
        for s in sessions:  # after a (re)connect: the tab the user can see, if the browser says which
            with contextlib.suppress(PwError):
                if await s.page.evaluate("document.visibilityState") == "visible":
                    chosen = s
                    break
        self._current = chosen.target_id
        return chosen

    async def _by_id(self, tab_id: str) -> _PageSession:
        for s in await self._pages():
            if s.target_id == tab_id:
                return s
        raise NoSuchTab(f"no tab {tab_id}")

    # -------------------------------------------------------------------------------------- reading

    def tabs(self) -> list[Tab]:
        return self._call(self._tabs())

    async def _tabs(self) -> list[Tab]:
        current = await self._current_session()
        return [Tab(tab_id=s.target_id, url=s.page.url, title=await _title(s), current=s is current)
                for s in await self._pages()]

    def view(self) -> View:
        return self._call(self._view())

    async def _view(self) -> View:
        s = await self._current_session()
        return View(surface=Surface.BROWSER, frame=await _viewport(s.cdp), tab_id=s.target_id, url=s.page.url)

    def capture(self, *, screenshot: bool = True) -> PageCapture:
        return self._call(self._capture(screenshot))

    async def _capture(self, screenshot: bool) -> PageCapture:
        s = await self._current_session()
        with contextlib.suppress(PwError, TimeoutError):
            await s.page.wait_for_load_state("domcontentloaded", timeout=self._nav_timeout * 1000)
        tree, frame, png, tabs = await asyncio.gather(
            s.cdp.send("Accessibility.getFullAXTree"), _viewport(s.cdp),
            _screenshot(s.cdp) if screenshot else _nothing(), self._tabs())
        elements, truncated = interesting_elements(tree["nodes"], limit=self._max_elements, max_text=self._max_text)
        view = View(surface=Surface.BROWSER, frame=frame, tab_id=s.target_id, url=s.page.url)
        title = next((t.title for t in tabs if t.tab_id == s.target_id), "")
        return PageCapture(view=view, title=title, tabs=tuple(tabs), elements=elements, truncated=truncated,
                           screenshot=png)

    def screenshot(self) -> bytes:
        async def shot() -> bytes:
            return await _screenshot((await self._current_session()).cdp)
        return self._call(shot())

    def cookies(self, urls: Sequence[str] = ()) -> list[dict[str, Any]]:
        async def read() -> list[dict[str, Any]]:
            return [dict(c) for c in await self._context().cookies(list(urls))]
        return self._call(read())

    # -------------------------------------------------------------------------------------- tabs

    def new_tab(self, url: str | None = None) -> str:
        async def open_tab() -> str:
            page = await self._context().new_page()
            s = await self._session(page)
            if url is not None:
                await _goto(page, url, self._nav_timeout)
            await page.bring_to_front()
            self._current = s.target_id
            return s.target_id
        return self._call(open_tab())

    def select_tab(self, tab_id: str) -> None:
        async def select() -> None:
            s = await self._by_id(tab_id)
            await s.page.bring_to_front()
            self._current = s.target_id
        self._call(select())

    def close_tab(self, tab_id: str) -> None:
        async def close() -> None:
            s = await self._by_id(tab_id)
            await s.page.close()
            self._sessions.pop(s.page, None)
            if self._current == tab_id:
                self._current = None
        self._call(close())

    # -------------------------------------------------------------------------------------- acts

    def navigate(self, url: str) -> Effect:
        async def go() -> Effect:
            s = await self._current_session()
            await _goto(s.page, url, self._nav_timeout)
            return Effect(navigated=True, detail=s.page.url)
        return self._call(go())

    def click(self, node: int) -> Effect:
        return self._call(self._click(node))

    async def _click(self, node: int) -> Effect:
        s = await self._current_session()
        x, y = await _point(s.cdp, node)
        if not await _call_on(s.cdp, node, _HIT_TEST, x, y):
            raise ElementObscured("another element covers this one where it would be clicked; nothing was clicked")
        return await self._input(s, s.page.mouse.click(x, y))

    def fill(self, node: int, text: str) -> Effect:
        async def fill() -> Effect:
            s = await self._current_session()
            await _scroll_into_view(s.cdp, node)
            if not await _call_on(s.cdp, node, _PREPARE_FILL):
                raise NotEditable("this element does not take text; nothing was typed")
            keyboard = s.page.keyboard
            return await self._input(s, keyboard.insert_text(text) if text else keyboard.press("Delete"))
        return self._call(fill())

    def press(self, key: str, node: int | None = None) -> Effect:
        async def press() -> Effect:
            s = await self._current_session()
            if node is not None:
                await _cdp(s.cdp, "DOM.focus", {"backendNodeId": node})
            return await self._input(s, s.page.keyboard.press(key))
        return self._call(press())

    def select_option(self, node: int, option: str) -> Effect:
        async def select() -> Effect:
            s = await self._current_session()
            await self._watch_requests(s)
            before = s.navigations
            chosen = await _call_on(s.cdp, node, _SELECT_OPTION, option)
            if "error" in chosen:
                raise NoSuchOption(chosen["error"] + (f"; options: {chosen['options']}" if "options" in chosen else ""))
            return await self._settle(s, before, detail=str(chosen["label"]))
        return self._call(select())

    def scroll(self, node: int | None = None, *, dx: int = 0, dy: int = 0) -> Effect:
        async def scroll() -> Effect:
            s = await self._current_session()
            if node is not None:
                await _scroll_into_view(s.cdp, node)
            else:
                frame = await _viewport(s.cdp)
                await s.page.mouse.move(frame.width / 2, frame.height / 2)
                await s.page.mouse.wheel(dx, dy)
            return Effect()
        return self._call(scroll())

    async def _input(self, s: _PageSession, action: Coroutine[Any, Any, None]) -> Effect:
        await self._watch_requests(s)
        before = s.navigations
        await action
        return await self._settle(s, before)

    async def _settle(self, s: _PageSession, before: int, *, detail: str = "") -> Effect:
        """If the act started a main-frame navigation, wait (bounded) for the new document's DOMContentLoaded, or
        for the answer that loads none (a download, no content: then the page stays, and the act navigated
        nowhere)."""
        with contextlib.suppress(PwError):
            await s.cdp.send("Runtime.evaluate", {"expression": "0"})  # one round trip through the renderer
        if s.navigations == before:
            return Effect(detail=detail)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(s.loaded.wait(), self._nav_timeout)
        if s.nowhere:
            return Effect(detail=f"{detail + '; ' if detail else ''}{s.nowhere}")
        return Effect(navigated=True, detail=detail or s.page.url)

    def close(self) -> None:
        async def shutdown() -> None:
            if self._browser is not None:
                with contextlib.suppress(PwError, TimeoutError):
                    await asyncio.wait_for(self._browser.close(), 5)
            if self._pw is not None:
                with contextlib.suppress(PwError, TimeoutError):
                    await asyncio.wait_for(self._pw.stop(), 10)
            self._browser = self._pw = None
        with contextlib.suppress(BrowserError):
            self._call(shutdown(), timeout=20)
        self._loop.stop()


# ------------------------------------------------------------------------------------------------ CDP helpers


async def _nothing() -> bytes:
    return b""


async def _cdp(cdp: CDPSession, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    try:
        return dict(await cdp.send(method, params or {}))
    except PwError as exc:
        if "No node" in exc.message or "Could not find node" in exc.message or "not found" in exc.message:
            raise ElementGone("the element is no longer in the page; observe again") from None
        if "not focusable" in exc.message:
            raise NotEditable("the element cannot take keyboard focus") from None
        raise


async def _title(s: _PageSession) -> str:
    info = await s.cdp.send("Target.getTargetInfo")
    return str(info["targetInfo"].get("title", ""))


async def _viewport(cdp: CDPSession) -> FrameSize:
    metrics = await cdp.send("Page.getLayoutMetrics")
    vp = metrics["cssLayoutViewport"]
    return FrameSize(width=int(vp["clientWidth"]), height=int(vp["clientHeight"]))


async def _screenshot(cdp: CDPSession) -> bytes:
    # Still a lossless PNG, compressed with zlib's fastest setting: the encoding is most of a screenshot's cost in a
    # guest under TCG, and it is on the path from a restore to the first observation.
    shot = await cdp.send("Page.captureScreenshot", {"format": "png", "optimizeForSpeed": True})
    return base64.b64decode(shot["data"])


async def _scroll_into_view(cdp: CDPSession, node: int) -> None:
    await _cdp(cdp, "DOM.scrollIntoViewIfNeeded", {"backendNodeId": node})


async def _point(cdp: CDPSession, node: int) -> tuple[float, float]:
    """The centre of the element's first visible box, in viewport CSS pixels, after scrolling it into view."""
    await _scroll_into_view(cdp, node)
    quads = (await _cdp(cdp, "DOM.getContentQuads", {"backendNodeId": node}))["quads"]
    for q in quads:
        xs, ys = q[0::2], q[1::2]
        if max(xs) - min(xs) >= 1 and max(ys) - min(ys) >= 1:
            return sum(xs) / 4, sum(ys) / 4
    raise ElementGone("the element is not rendered (no visible box); observe again")


async def _call_on(cdp: CDPSession, node: int, function: str, *args: Any) -> Any:
    obj = (await _cdp(cdp, "DOM.resolveNode", {"backendNodeId": node}))["object"]
    try:
        result = await _cdp(cdp, "Runtime.callFunctionOn", {
            "objectId": obj["objectId"], "functionDeclaration": function,
            "arguments": [{"value": a} for a in args], "returnByValue": True})
    finally:
        with contextlib.suppress(PwError):
            await cdp.send("Runtime.releaseObject", {"objectId": obj["objectId"]})
    if "exceptionDetails" in result:
        raise BrowserError(f"the page refused: {result['exceptionDetails'].get('text', 'exception')}")
    return result["result"].get("value")


async def _goto(page: Page, url: str, seconds: float) -> None:
    try:
        await page.goto(url, wait_until="domcontentloaded", timeout=seconds * 1000)
    except PwError as exc:
        raise NavigationFailed(f"could not open {url}: {exc.message.splitlines()[0]}") from None
