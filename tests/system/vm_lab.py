"""Helpers for the VM system tests: loopback HTTP recorders, the serial-console reader, the lab bundle."""

from __future__ import annotations

import http.server
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from wakeful.proxy.clock import FakeClock
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.lifecycle import AfterRestore, VmManager

__all__ = ["Count", "Lab", "Recorder", "Serial", "serve"]


@dataclass
class Recorder:
    """A loopback HTTP server that answers `hello-from-<name>` and remembers the paths it was asked for."""

    name: str
    paths: list[str] = field(default_factory=list)
    port: int = 0
    heads: list[tuple[bytes, list[tuple[str, str]]]] = field(default_factory=list)
    """Each request's raw request line (with its CRLF) and its headers in the order they came."""


def serve(recorder: Recorder) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            recorder.paths.append(self.path)
            recorder.heads.append((self.raw_requestline, list(self.headers.items())))
            body = f"hello-from-{recorder.name}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    recorder.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class Lab:
    manager: VmManager
    clock: FakeClock
    events: list[AfterRestore]
    hypervisor: LibvirtHypervisor


_COUNTER = re.compile(r"WK-COUNTER n=(\d+) pid=(\d+) boot=(\S+)")


@dataclass(frozen=True)
class Count:
    n: int
    pid: int
    boot: str


class Serial:
    """Reads a guest's serial log; every wait is bounded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def text(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""

    def wait_for(self, pattern: str, *, after: int = 0, timeout: float = 60.0) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while True:
            found = regex.search(self.text(), after)
            if found:
                return found
            if time.monotonic() > deadline:
                tail = self.text()[-1500:]
                raise AssertionError(f"{pattern!r} not on the serial console within {timeout} s; tail:\n{tail}")
            time.sleep(0.1)

    def last_count(self) -> Count:
        matches = _COUNTER.findall(self.text())
        assert matches, "no counter line yet"
        n, pid, boot = matches[-1]
        return Count(int(n), int(pid), boot)

    def next_count(self, *, timeout: float = 30.0) -> Count:
        """The first counter line written after now."""
        found = self.wait_for(_COUNTER.pattern, after=len(self.text()), timeout=timeout)
        return Count(int(found[1]), int(found[2]), found[3])
