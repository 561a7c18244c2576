"""Tool computers on the vm layer's in-memory guest, browser and desktop: one computer, a checkout form on show."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from wakeful.proxy.clock import FakeClock
from wakeful.vm.fake_browser import FakeBrowser
from wakeful.vm.fake_guest import FakeChannel, FakeDesktop
from wakeful.vm.observe import Element
from wakeful.vm.toolcomputer import ToolComputer

FORM = [Element(node=1, role="heading", name="Checkout", level=1), Element(node=2, role="textbox", name="Name"),
        Element(node=3, role="button", name="Next"), Element(node=4, role="button", name="Pay 19.99 EUR")]


class FakeComputers:
    """One tool computer per user on the vm fakes; records what kept the VM busy."""

    def __init__(self, clock: FakeClock) -> None:
        self.browser = FakeBrowser()
        self.tc = ToolComputer(vm_id="vm-owner", channel=FakeChannel(), clock=clock, browser=self.browser,
                               desktop=FakeDesktop())
        self.tc.connect()
        self.browser.show("https://shop.test/checkout", FORM, title="Checkout")
        self.activities: list[str] = []
        self.reaped = 0

    def computer(self, user_id: str) -> ToolComputer:
        return self.tc

    @contextlib.contextmanager
    def activity(self, user_id: str, kind: str) -> Iterator[None]:
        self.activities.append(kind)
        yield

    def reap(self) -> list[str]:
        self.reaped += 1
        return []
