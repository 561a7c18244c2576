"""A loopback notification receiver that honours `Idempotency-Key`, as real messaging APIs do.

Tests assert on the sink's own records (what it applied, what it suppressed as a repeat), never on how often the
dispatcher called it: a call count cannot tell a retry from a duplicate effect.

    with Sink() as sink:
        url = sink.url              # http://127.0.0.1:<port>/messages
        sink.fail_next(3)           # the next three requests get 503 and change nothing
        ...
        assert sink.application_count == {key: 1 for key in sink.applied}
"""

from __future__ import annotations

import json
import sys
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["Sink"]


class Sink:
    """`POST /messages`: the first request with a key is applied; a repeat gets the original response, unapplied."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.applied: dict[str, dict[str, Any]] = {}
        self.application_count: Counter[str] = Counter()
        self.duplicates_suppressed: Counter[str] = Counter()
        self.rejected = 0
        """Requests refused by `fail_next` (they changed nothing)."""
        self._responses: dict[str, bytes] = {}
        self._failures_left = 0
        self._server = _QuietServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="sink", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/messages"

    def fail_next(self, n: int) -> None:
        """Make the next `n` requests fail with 503 before anything is recorded (a receiver outage)."""
        with self._lock:
            self._failures_left = n

    def snapshot(self) -> tuple[dict[str, dict[str, Any]], dict[str, int], dict[str, int]]:
        """A consistent copy of (applied, application_count, duplicates_suppressed)."""
        with self._lock:
            return dict(self.applied), dict(self.application_count), dict(self.duplicates_suppressed)

    def __enter__(self) -> Sink:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    # -- called from the request threads -------------------------------------------------------------------------

    def handle(self, key: str | None, raw: bytes) -> tuple[int, bytes]:
        with self._lock:
            if self._failures_left > 0:
                self._failures_left -= 1
                self.rejected += 1
                return 503, b'{"error": "unavailable"}'
            if not key:
                return 400, b'{"error": "Idempotency-Key is required"}'
            if key in self._responses:
                self.duplicates_suppressed[key] += 1
                return 200, self._responses[key]
            try:
                body = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                return 400, b'{"error": "body is not JSON"}'
            if not isinstance(body, dict):
                return 400, b'{"error": "body must be a JSON object"}'
            # Applying and remembering the response happen under one lock: a concurrent repeat sees both or neither.
            self.applied[key] = body
            self.application_count[key] += 1
            response = json.dumps({"id": key, "status": "applied"}).encode()
            self._responses[key] = response
            return 200, response


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # A sender that dies mid-request (the crash tests kill it on purpose) is normal here, not a sink failure.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _handler_for(sink: Sink) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like a real API; every response carries Content-Length

        def do_POST(self) -> None:  # the name http.server dispatches to
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if self.path != "/messages":
                status, payload = 404, b'{"error": "not found"}'
            else:
                status, payload = sink.handle(self.headers.get("Idempotency-Key"), raw)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            pass

    return Handler
