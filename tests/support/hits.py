"""A loopback HTTP server that records the paths it was asked for and answers `seen PATH`: what a test reaches
through a forward or a splice, and counts on the server's side."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["Hits"]


class Hits(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.paths: list[str] = []


class _Handler(BaseHTTPRequestHandler):
    server: Hits

    def do_GET(self) -> None:
        self.server.paths.append(self.path)
        body = f"seen {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass
