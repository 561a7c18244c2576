"""In-memory stand-ins for the guest channel and the desktop, for unit tests of the code above them."""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

from wakeful.vm.desktop import DesktopCapture, FocusChanged
from wakeful.vm.guest import ChannelClosed, ClockSync, GuestUnreachable, NotConnected, ReconnectReport, RunResult
from wakeful.vm.observe import FrameSize, Surface, View

__all__ = ["FakeChannel", "FakeDesktop", "tiny_png"]


def tiny_png(width: int, height: int) -> bytes:
    """Just enough of a PNG for `png_size`: signature and IHDR."""
    return (b"\x89PNG\r\n\x1a\n" + (13).to_bytes(4, "big") + b"IHDR" + width.to_bytes(4, "big")
            + height.to_bytes(4, "big") + b"\x08\x02\x00\x00\x00" + b"\x00" * 4)


class FakeChannel:
    """Commands are answered by `handler` (default: exit 0, no output) and recorded in `commands`.

    `drop()` kills the transport the way a restore under user-mode networking does; a transport not dropped
    outlives a restore (as on an isolated network) unless `silent` (the guest no longer answers on it);
    `unreachable = n` makes the next n connects fail.
    """

    def __init__(self, handler: Callable[[str, bytes | None], RunResult] | None = None) -> None:
        self.handler = handler or (lambda cmd, data: RunResult(status=0, stdout=b"", stderr=b""))
        self.commands: list[str] = []
        self.forwards: dict[tuple[str, int], int] = {}
        self.connects = 0
        self.clock_syncs = 0
        self.keepers = 0
        """Calls of `keep_clock`."""
        self.unreachable = 0
        self.silent = False
        self.probes = 0
        self.closed = False
        self.side_door = False
        """The keeper's side door is open: resyncs work without a transport."""
        self.reconnects: list[threading.Event] = []
        """Each `reconnect` waits for the next event here, if there is one (a reconnect still running)."""
        self._connected = False

    @property
    def connected(self) -> bool:
        return self._connected

    def connect(self, *, timeout: float = 10.0) -> None:
        if self.closed:
            raise ChannelClosed("this guest channel was closed")
        if self.unreachable > 0:
            self.unreachable -= 1
            raise GuestUnreachable("fake guest: nothing listens")
        self.connects += 1
        self._connected = True

    @property
    def side_door_open(self) -> bool:
        return self.side_door

    def alive(self, *, timeout: float = 2.0) -> bool:
        self.probes += 1
        return self._connected and not self.silent

    def drop(self) -> None:
        self._connected = False

    def run(self, cmd: str | Sequence[str], *, input: bytes | None = None, timeout: float) -> RunResult:
        if not self._connected:
            raise NotConnected("fake guest: not connected")
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        self.commands.append(command)
        return self.handler(command, input)

    def forward(self, remote_host: str, remote_port: int) -> int:
        return self.forwards.setdefault((remote_host, remote_port), 40000 + len(self.forwards))

    def resync_clock(self) -> ClockSync:
        if not self._connected and not self.side_door:
            raise NotConnected("fake guest: not connected")
        self.clock_syncs += 1
        return ClockSync(before=timedelta(seconds=-3), after=timedelta(0), round_trip=timedelta(milliseconds=1))

    def keep_clock(self) -> None:
        if not self._connected:
            raise NotConnected("fake guest: not connected")
        self.keepers += 1

    def reconnect(self, *, timeout: float = 30.0) -> ReconnectReport:
        self._connected = False
        if self.reconnects and not self.reconnects.pop(0).wait(timeout):
            raise GuestUnreachable("fake guest: no answer in time")
        self.silent = False
        attempts = 1
        while True:
            try:
                self.connect()
                break
            except GuestUnreachable:
                attempts += 1
        return ReconnectReport(ports=dict(self.forwards), attempts=attempts)

    def close(self) -> None:
        self.closed = True
        self._connected = False


@dataclass
class FakeDesktop:
    """A screen with one focused window; acts are recorded in `acts` (nothing runs when the guard fails)."""

    frame: FrameSize = field(default_factory=lambda: FrameSize(width=1024, height=768))
    window: str = "4194311"
    title: str = "Chromium"
    acts: list[tuple[str, ...]] = field(default_factory=list)

    def capture(self) -> DesktopCapture:
        view = View(surface=Surface.DESKTOP, frame=self.frame, window=self.window)
        return DesktopCapture(view=view, title=self.title, screenshot=tiny_png(self.frame.width, self.frame.height))

    def _guard(self, expect_window: str | None) -> None:
        if expect_window is not None and expect_window != self.window:
            raise FocusChanged("another window has the focus now; nothing was done", window=self.window)

    def click(self, x: int, y: int, *, expect_window: str | None, button: int = 1) -> None:
        self._guard(expect_window)
        self.acts.append(("click", str(x), str(y), str(button)))

    def type_text(self, text: str, *, expect_window: str | None) -> None:
        self._guard(expect_window)
        self.acts.append(("type", text))

    def key(self, keys: str, *, expect_window: str | None) -> None:
        self._guard(expect_window)
        self.acts.append(("key", keys))
