"""The desktop adapter's guest commands, checked through the in-memory channel: quoting, the focus guard, parsing."""

from __future__ import annotations

import base64
import shlex

import pytest

from wakeful.vm.desktop import BadKeys, DesktopError, FocusChanged, XDesktop, png_size
from wakeful.vm.fake_guest import FakeChannel, tiny_png
from wakeful.vm.guest import RunResult
from wakeful.vm.observe import FrameSize, Surface


def desktop_with(status: int = 0, stdout: bytes = b"", stderr: bytes = b"") -> tuple[XDesktop, FakeChannel]:
    channel = FakeChannel(lambda cmd, data: RunResult(status=status, stdout=stdout, stderr=stderr))
    channel.connect()
    return XDesktop(channel, display=":1"), channel


def last_line(channel: FakeChannel) -> list[str]:
    return shlex.split(channel.commands[-1].splitlines()[-1])


@pytest.mark.parametrize("text", ["plain", "it's", '"$(id)"', "`id`; rm -rf / #", "a\nb", "--", "-x", "ünï"])
def test_typed_text_is_one_quoted_argument_after_the_end_of_options(text: str) -> None:
    desktop, channel = desktop_with()
    desktop.type_text(text, expect_window=None)
    assert channel.commands[-1].startswith("export DISPLAY=:1\n")
    command = channel.commands[-1].split("\n", 1)[1]
    assert shlex.split(command) == ["xdotool", "type", "--delay", "0", "--", text]


def test_the_focus_guard_runs_before_the_input_in_the_same_command() -> None:
    desktop, channel = desktop_with()
    desktop.key("ctrl+l Return", expect_window="4194311")
    script = channel.commands[-1]
    guard, act = script.index('[ "$w" = 4194311 ]'), script.index("xdotool key")
    assert guard < act and "exit 75" in script[guard:act]
    assert last_line(channel) == ["xdotool", "key", "--clearmodifiers", "--", "ctrl+l", "Return"]


def test_an_observed_window_id_is_quoted_too() -> None:
    desktop, channel = desktop_with()
    desktop.click(1, 2, expect_window="1; reboot")
    assert "'1; reboot'" in channel.commands[-1]


def test_a_focus_change_reported_by_the_guard_is_focus_changed() -> None:
    desktop, _ = desktop_with(status=75, stdout=b"999")
    with pytest.raises(FocusChanged) as changed:
        desktop.type_text("x", expect_window="1")
    assert changed.value.window == "999" and changed.value.code == "focus_changed"


def test_any_other_failure_is_a_desktop_error() -> None:
    desktop, _ = desktop_with(status=1, stderr=b"Can't open display")
    with pytest.raises(DesktopError, match="Can't open display"):
        desktop.click(5, 5, expect_window=None)


@pytest.mark.parametrize("keys", ["", "ctrl+a;id", "$(id)", "a'b", "--help", "ctrl++"])
def test_key_names_are_checked_before_anything_is_sent(keys: str) -> None:
    desktop, channel = desktop_with()
    with pytest.raises(BadKeys):
        desktop.key(keys, expect_window=None)
    assert channel.commands == []


def test_a_capture_is_parsed_into_window_title_and_screenshot() -> None:
    png = tiny_png(800, 600)
    desktop, _ = desktop_with(stdout=b"4194311\n" + base64.b64encode("Inbox — Mail\n(2)".encode()) + b"\n" + png)
    shot = desktop.capture()
    assert (shot.view.surface, shot.view.window, shot.view.frame) == (Surface.DESKTOP, "4194311",
                                                                      FrameSize(width=800, height=600))
    assert shot.title == "Inbox — Mail\n(2)" and shot.screenshot == png


def test_a_screenshot_that_is_not_a_png_is_an_error() -> None:
    with pytest.raises(DesktopError):
        png_size(b"GIF89a" + b"\0" * 30)


def test_the_display_must_look_like_a_display() -> None:
    with pytest.raises(ValueError, match="display"):
        XDesktop(FakeChannel(), display=":1; id")
