"""Desktop observe/act over the guest channel: `scrot` screenshots and `xdotool` input on the guest's X display.

Every command is built from fixed words and `shlex.quote`d values, never by pasting untrusted text into shell.
Acts carry the window id the agent observed as focused; the guard that compares it with the window focused *now*
runs in the same shell command, before the input, so a focus change refuses the act with nothing typed or clicked
(`FocusChanged`, exit status 75).
"""

from __future__ import annotations

import base64
import re
import shlex
import struct
from dataclasses import dataclass, field
from typing import Protocol

from wakeful.vm.errors import VmError
from wakeful.vm.guest import Channel
from wakeful.vm.observe import FrameSize, Surface, View

__all__ = ["BadKeys", "Desktop", "DesktopCapture", "DesktopError", "FocusChanged", "XDesktop", "png_size"]

_FOCUS_CHANGED = 75
_KEY = re.compile(r"^[A-Za-z0-9_]+(\+[A-Za-z0-9_]+)*$")
# The focused window: the window manager's active window, or X's input focus when there is no window manager.
_WINDOW = 'w=$(xdotool getactivewindow 2>/dev/null || xdotool getwindowfocus 2>/dev/null) || w=""'


class DesktopError(VmError):
    code = "desktop_error"


class FocusChanged(DesktopError):
    """The focused window is not the one observed: nothing was done."""

    code = "focus_changed"

    def __init__(self, message: str, *, window: str) -> None:
        super().__init__(message)
        self.window = window


class BadKeys(DesktopError):
    code = "bad_keys"


@dataclass(frozen=True, kw_only=True)
class DesktopCapture:
    view: View
    title: str
    """The focused window's name."""
    screenshot: bytes = field(repr=False)


class Desktop(Protocol):
    def capture(self) -> DesktopCapture: ...

    def click(self, x: int, y: int, *, expect_window: str | None, button: int = 1) -> None: ...

    def type_text(self, text: str, *, expect_window: str | None) -> None: ...

    def key(self, keys: str, *, expect_window: str | None) -> None: ...


def png_size(data: bytes) -> FrameSize:
    """Width and height from a PNG's IHDR chunk."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise DesktopError("the screenshot is not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return FrameSize(width=width, height=height)


class XDesktop:
    def __init__(self, channel: Channel, *, display: str = ":1", timeout: float = 20.0) -> None:
        if not re.fullmatch(r":\d+(\.\d+)?", display):
            raise ValueError(f"not an X display: {display!r}")
        self._channel = channel
        self._display = display
        self._timeout = timeout

    def _run(self, script: str, what: str) -> bytes:
        result = self._channel.run(f"export DISPLAY={self._display}\n{script}", timeout=self._timeout)
        if result.status == _FOCUS_CHANGED:
            window = result.stdout.decode(errors="replace").strip()
            raise FocusChanged(f"another window has the focus now ({window or 'none'}); nothing was done",
                               window=window)
        if result.status != 0:
            raise DesktopError(f"{what} failed ({result.status}): {result.stderr.decode(errors='replace')[-300:]}")
        return result.stdout

    def capture(self) -> DesktopCapture:
        """Screenshot, screen size and focused window in one round trip."""
        out = self._run(
            f'{_WINDOW}\nprintf "%s\\n" "$w"\n'
            '[ -n "$w" ] && n=$(xdotool getwindowname "$w" 2>/dev/null) || n=""\n'
            'printf "%s" "$n" | base64 -w0; printf "\\n"\n'
            "exec scrot --overwrite -", "the desktop screenshot")
        window, name, png = out.split(b"\n", 2)
        view = View(surface=Surface.DESKTOP, frame=png_size(png), window=window.decode())
        return DesktopCapture(view=view, title=base64.b64decode(name).decode(errors="replace"), screenshot=png)

    def _guarded(self, expect_window: str | None, command: str, what: str) -> None:
        guard = ""
        if expect_window is not None:
            expected = shlex.quote(expect_window)
            guard = f'{_WINDOW}\n[ "$w" = {expected} ] || {{ printf "%s" "$w"; exit {_FOCUS_CHANGED}; }}\n'
        self._run(guard + command, what)

    def click(self, x: int, y: int, *, expect_window: str | None, button: int = 1) -> None:
        if not 1 <= button <= 9:
            raise ValueError(f"not a mouse button: {button}")
        # `mousemove --sync` to where the pointer already is waits ~15 s for a motion that never comes: skip it.
        x, y = int(x), int(y)
        self._guarded(expect_window,
                      f'eval "$(xdotool getmouselocation --shell)"\n'
                      f'[ "$X" = {x} ] && [ "$Y" = {y} ] || xdotool mousemove --sync {x} {y}\n'
                      f"xdotool click {int(button)}", "the click")

    def type_text(self, text: str, *, expect_window: str | None) -> None:
        self._guarded(expect_window, f"xdotool type --delay 0 -- {shlex.quote(text)}", "typing")

    def key(self, keys: str, *, expect_window: str | None) -> None:
        words = keys.split()
        if not words or not all(_KEY.match(w) for w in words):
            raise BadKeys(f"not xdotool key names: {keys!r} (use names like ctrl+l, Return, alt+Tab)")
        self._guarded(expect_window, "xdotool key --clearmodifiers -- " + " ".join(words), "the key press")

    def window(self) -> tuple[str, str]:
        """The focused window's id and name (for focus-change detection without a screenshot)."""
        out = self._run(f'{_WINDOW}\nprintf "%s\\n" "$w"\n[ -n "$w" ] && xdotool getwindowname "$w" || true',
                        "reading the focused window")
        window, _, name = out.decode(errors="replace").partition("\n")
        return window, name.rstrip("\n")
