"""The browser's interface: what the tool computer needs from a browser, the values it gets back, the errors.

`Browser` is implemented by `vm.cdp_browser.CdpBrowser` (Playwright over CDP, the only module that imports
Playwright) and by `vm.fake_browser.FakeBrowser` (in memory). This module imports neither Playwright nor anything
that does, so fakes and the rest of `vm/` can use it without loading a browser driver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from wakeful.vm.errors import VmError
from wakeful.vm.observe import Capture, Element, View

__all__ = [
    "Browser",
    "BrowserDisconnected",
    "BrowserError",
    "BrowserTimeout",
    "Effect",
    "ElementGone",
    "ElementObscured",
    "NavigationFailed",
    "NoSuchOption",
    "NoSuchTab",
    "NotEditable",
    "PageCapture",
    "Tab",
]


class BrowserError(VmError):
    code = "browser_error"


class BrowserDisconnected(BrowserError):
    """No CDP connection (never connected, or the guest was restored): reconnect."""

    code = "browser_disconnected"


class BrowserTimeout(BrowserError):
    code = "browser_timeout"


class ElementGone(BrowserError):
    """The element is no longer in the page or not rendered: nothing was done."""

    code = "element_gone"


class ElementObscured(BrowserError):
    """Something else covers the element where it would be clicked: nothing was done."""

    code = "element_obscured"


class NotEditable(BrowserError):
    code = "not_editable"


class NoSuchOption(BrowserError):
    code = "no_such_option"


class NoSuchTab(BrowserError):
    code = "no_such_tab"


class NavigationFailed(BrowserError):
    code = "navigation_failed"


@dataclass(frozen=True, kw_only=True)
class Tab:
    tab_id: str
    """Chromium's target id: stable for the life of the tab, across CDP reconnects."""
    url: str
    title: str
    current: bool


@dataclass(frozen=True, kw_only=True)
class Effect:
    navigated: bool = False
    """The act started a main-frame navigation (and it reached DOMContentLoaded, or the wait ran out). One whose
    answer was a file to download, or had no content (204, 205), is none: the page stays, and `detail` says why."""
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class PageCapture:
    view: View
    title: str
    tabs: tuple[Tab, ...]
    elements: tuple[Element, ...]
    truncated: bool
    """More interesting nodes existed than the snapshot bound allows."""
    screenshot: bytes = field(repr=False)

    def capture(self) -> Capture:
        return Capture(view=self.view, title=self.title, tabs=tuple(t.tab_id for t in self.tabs),
                       elements=self.elements)


class Browser(Protocol):
    """What the tool computer needs from a browser; `vm.fake_browser.FakeBrowser` is the in-memory stand-in."""

    @property
    def connected(self) -> bool: ...
    def connect(self, cdp_url: str) -> None: ...
    def reconnect(self) -> None: ...
    def tabs(self) -> list[Tab]: ...
    def view(self) -> View: ...
    def capture(self, *, screenshot: bool = True) -> PageCapture: ...
    def screenshot(self) -> bytes: ...
    def new_tab(self, url: str | None = None) -> str: ...
    def select_tab(self, tab_id: str) -> None: ...
    def close_tab(self, tab_id: str) -> None: ...
    def navigate(self, url: str) -> Effect: ...
    def click(self, node: int) -> Effect: ...
    def fill(self, node: int, text: str) -> Effect: ...
    def press(self, key: str, node: int | None = None) -> Effect: ...
    def select_option(self, node: int, option: str) -> Effect: ...
    def scroll(self, node: int | None = None, *, dx: int = 0, dy: int = 0) -> Effect: ...
    def cookies(self, urls: Sequence[str] = ()) -> list[dict[str, Any]]: ...
    def close(self) -> None: ...
