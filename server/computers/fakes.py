"""Tool computers on the vm layer's in-memory fakes, for tests of whole processes (`computer_fakes = true`).

One `ToolComputer` per user on `vm.fake_guest` and `vm.fake_browser`, showing a checkout form: "Pay 19.99 EUR"
leads to a page titled "Paid", so a test in another process sees from an observation alone that an act ran.
Idle ones are reaped like VMs (the next use "restores" them: `after_restore` moves the epoch), so the sweeper's
reaping shows the same way. No guest image, no libvirt.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta

from wakeful.proxy.clock import Clock
from wakeful.vm.fake_browser import FakeBrowser
from wakeful.vm.fake_guest import FakeChannel, FakeDesktop
from wakeful.vm.observe import Element
from wakeful.vm.toolcomputer import ToolComputer

__all__ = ["CHECKOUT", "PAID", "FakeVmComputers"]

CHECKOUT = (Element(node=1, role="heading", name="Checkout", level=1), Element(node=2, role="textbox", name="Name"),
            Element(node=3, role="button", name="Next"), Element(node=4, role="button", name="Pay 19.99 EUR"))
PAID = (Element(node=5, role="heading", name="Paid", level=1),)


class FakeVmComputers:
    """`Computers` on fakes: one computer per user, suspended by `reap` once idle for `idle_after`."""

    def __init__(self, clock: Clock, idle_after: timedelta) -> None:
        self._clock = clock
        self._idle_after = idle_after
        self._computers: dict[str, ToolComputer] = {}
        self._busy: dict[str, int] = {}
        self._last: dict[str, datetime] = {}
        self._suspended: set[str] = set()
        self._lock = threading.RLock()

    def _new(self, user_id: str) -> ToolComputer:
        browser = FakeBrowser()
        browser.on_click[4] = lambda b: b.show("https://shop.test/paid", PAID, title="Paid")
        tc = ToolComputer(vm_id=f"fake-{user_id}", channel=FakeChannel(), clock=self._clock, browser=browser,
                          desktop=FakeDesktop())
        tc.connect()
        browser.show("https://shop.test/checkout", CHECKOUT, title="Checkout")
        return tc

    def computer(self, user_id: str) -> ToolComputer:
        with self._lock:
            tc = self._computers.get(user_id)
            if tc is None:
                tc = self._computers[user_id] = self._new(user_id)
            if user_id in self._suspended:
                self._suspended.discard(user_id)
                tc.after_restore()
            return tc

    @contextlib.contextmanager
    def activity(self, user_id: str, kind: str) -> Iterator[None]:
        with self._lock:
            self._busy[user_id] = self._busy.get(user_id, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._busy[user_id] -= 1
                self._last[user_id] = self._clock.now()

    def reap(self) -> list[str]:
        now = self._clock.now()
        with self._lock:
            idle = [u for u in self._computers if u not in self._suspended and not self._busy.get(u)
                    and now - self._last.get(u, now) >= self._idle_after]
            self._suspended.update(idle)
        return idle
