"""An in-memory browser for unit tests of the tool computer: pages are lists of elements, acts are recorded."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from wakeful.vm.browser import BrowserDisconnected, Effect, ElementGone, NoSuchTab, PageCapture, Tab
from wakeful.vm.fake_guest import tiny_png
from wakeful.vm.observe import Element, FrameSize, Surface, View

__all__ = ["FakeBrowser", "FakePage"]


@dataclass
class FakePage:
    tab_id: str
    url: str
    title: str = ""
    elements: list[Element] = field(default_factory=list)


class FakeBrowser:
    """`show(...)` sets what the current tab displays; `on_click[node]` scripts what a click does.

    Every act that ran is appended to `acts` as a tuple, so a test can assert that a refused act ran nothing.
    """

    def __init__(self, *, frame: FrameSize | None = None) -> None:
        self.frame = frame or FrameSize(width=1280, height=720)
        self.pages: dict[str, FakePage] = {"T1": FakePage(tab_id="T1", url="about:blank")}
        self.current = "T1"
        self.acts: list[tuple[Any, ...]] = []
        self.on_click: dict[int, Callable[[FakeBrowser], None]] = {}
        self.cdp_url: str | None = None
        self.connects = 0
        self.refuse_connects = 0
        """The next this many `connect` calls fail, as an attach through a forward whose SSH is not back yet."""
        self._connected = False
        self._next_tab = 2

    # test helpers

    def show(self, url: str, elements: Sequence[Element], *, title: str = "") -> None:
        page = self.pages[self.current]
        page.url, page.title, page.elements = url, title, list(elements)

    def drop(self) -> None:
        self._connected = False

    # Browser

    @property
    def connected(self) -> bool:
        return self._connected

    def connect(self, cdp_url: str) -> None:
        self.cdp_url = cdp_url
        self.connects += 1
        if self.refuse_connects:
            self.refuse_connects -= 1
            self._connected = False
            raise BrowserDisconnected("fake browser: the connection was reset")
        self._connected = True

    def reconnect(self) -> None:
        if self.cdp_url is None:
            raise BrowserDisconnected("connect() was never called")
        self.connect(self.cdp_url)

    def _page(self) -> FakePage:
        if not self._connected:
            raise BrowserDisconnected("fake browser: not connected")
        return self.pages[self.current]

    def tabs(self) -> list[Tab]:
        self._page()
        return [Tab(tab_id=p.tab_id, url=p.url, title=p.title, current=p.tab_id == self.current)
                for p in self.pages.values()]

    def view(self) -> View:
        page = self._page()
        return View(surface=Surface.BROWSER, frame=self.frame, tab_id=page.tab_id, url=page.url)

    def capture(self, *, screenshot: bool = True) -> PageCapture:
        page = self._page()
        png = tiny_png(self.frame.width, self.frame.height) if screenshot else b""
        return PageCapture(view=self.view(), title=page.title, tabs=tuple(self.tabs()),
                           elements=tuple(page.elements), truncated=False, screenshot=png)

    def screenshot(self) -> bytes:
        self._page()
        return tiny_png(self.frame.width, self.frame.height)

    def new_tab(self, url: str | None = None) -> str:
        self._page()
        tab_id = f"T{self._next_tab}"
        self._next_tab += 1
        self.pages[tab_id] = FakePage(tab_id=tab_id, url=url or "about:blank")
        self.current = tab_id
        self.acts.append(("new_tab", url))
        return tab_id

    def select_tab(self, tab_id: str) -> None:
        self._page()
        if tab_id not in self.pages:
            raise NoSuchTab(f"no tab {tab_id}")
        self.current = tab_id
        self.acts.append(("select_tab", tab_id))

    def close_tab(self, tab_id: str) -> None:
        self._page()
        if self.pages.pop(tab_id, None) is None:
            raise NoSuchTab(f"no tab {tab_id}")
        if self.current == tab_id:
            self.current = next(iter(self.pages), "")
        self.acts.append(("close_tab", tab_id))

    def navigate(self, url: str) -> Effect:
        page = self._page()
        page.url, page.elements = url, []
        self.acts.append(("navigate", url))
        return Effect(navigated=True, detail=url)

    def _element(self, node: int) -> Element:
        for e in self._page().elements:
            if e.node == node:
                return e
        raise ElementGone("the element is no longer in the page; observe again")

    def click(self, node: int) -> Effect:
        self._element(node)
        self.acts.append(("click", node))
        before = self._page().url
        if node in self.on_click:
            self.on_click[node](self)
        return Effect(navigated=self._page().url != before)

    def fill(self, node: int, text: str) -> Effect:
        self._element(node)
        self.acts.append(("fill", node, text))
        return Effect()

    def press(self, key: str, node: int | None = None) -> Effect:
        if node is not None:
            self._element(node)
        self.acts.append(("press", key, node))
        return Effect()

    def select_option(self, node: int, option: str) -> Effect:
        self._element(node)
        self.acts.append(("select", node, option))
        return Effect(detail=option)

    def scroll(self, node: int | None = None, *, dx: int = 0, dy: int = 0) -> Effect:
        if node is not None:
            self._element(node)
        self.acts.append(("scroll", node, dx, dy))
        return Effect()

    def cookies(self, urls: Sequence[str] = ()) -> list[dict[str, Any]]:
        return []

    def close(self) -> None:
        self._connected = False
