"""Host stand-ins for the guest's browser and screen: Debian's chromium with remote debugging on loopback, and Xvfb.

    with Xvfb(tmp_path) as screen, HostChromium(tmp_path / "chr", display=screen.display) as chromium:
        chromium.port       # its DevTools port on 127.0.0.1 (read from DevToolsActivePort)

Both are started by the test, die with the test process, and are stopped by their own PID.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import TracebackType

from tests.support.polling import wait_until
from tests.support.sshd import stop_process, tied_process

__all__ = ["CHROMIUM", "HostChromium", "Xvfb"]

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


class HostChromium:
    def __init__(self, user_data_dir: Path, *, display: str | None = None, size: tuple[int, int] = (1000, 700),
                 url: str = "about:blank") -> None:
        """Headless unless `display` is given (then a window on that X display)."""
        self.user_data_dir = user_data_dir
        self.display = display
        self.size = size
        self.url = url
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> HostChromium:
        self.user_data_dir.mkdir(parents=True, exist_ok=True)
        active = self.user_data_dir / "DevToolsActivePort"
        active.unlink(missing_ok=True)
        mode = ["--headless=new"] if self.display is None else []
        env = {**os.environ, **({"DISPLAY": self.display} if self.display else {})}
        argv = [CHROMIUM, *mode, *FLAGS, f"--user-data-dir={self.user_data_dir}",
                f"--window-size={self.size[0]},{self.size[1]}", "--window-position=0,0", self.url]
        self._proc = tied_process(argv, log_path=self.user_data_dir.parent / f"{self.user_data_dir.name}.log",
                                  env=env)
        self.port = int(wait_until(lambda: self._active_port(active), 30.0, "chromium's DevToolsActivePort"))
        return self

    def _active_port(self, active: Path) -> int | None:
        if self._proc is not None and self._proc.poll() is not None:
            raise AssertionError(f"chromium exited with {self._proc.returncode}")
        try:
            first = active.read_text().splitlines()[0]
        except (OSError, IndexError):
            return None
        return int(first) if first.isdigit() else None

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
            self._proc = None

    def __enter__(self) -> HostChromium:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class Xvfb:
    """`Xvfb :N -nolisten tcp -noreset` on a free display number (without -noreset the server resets, pointer and
    all, whenever its last client disconnects — every xdotool call would start from scratch)."""

    def __init__(self, log_dir: Path, *, size: tuple[int, int] = (1024, 768)) -> None:
        self.log_dir = log_dir
        self.size = size
        self.number = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def display(self) -> str:
        return f":{self.number}"

    def start(self) -> Xvfb:
        for number in range(90, 200):
            if Path(f"/tmp/.X11-unix/X{number}").exists() or Path(f"/tmp/.X{number}-lock").exists():
                continue
            self.number = number
            self._proc = tied_process(
                ["/usr/bin/Xvfb", self.display, "-nolisten", "tcp", "-noreset",
                 "-screen", "0", f"{self.size[0]}x{self.size[1]}x24"],
                log_path=self.log_dir / f"xvfb-{number}.log")
            try:
                wait_until(self._ready, 15.0, f"Xvfb on {self.display}")
            except _Lost:
                continue  # another process took this display number first
            return self
        raise AssertionError("no free X display number")

    def _ready(self) -> bool:
        assert self._proc is not None
        if self._proc.poll() is not None:
            raise _Lost()
        return Path(f"/tmp/.X11-unix/X{self.number}").exists()

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
            self._proc = None

    def __enter__(self) -> Xvfb:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


class _Lost(Exception):
    pass
