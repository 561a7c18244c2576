"""A stdlib socketserver (http.server and friends) run on a thread for the length of a block."""

from __future__ import annotations

import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["serving_on_thread"]

S = TypeVar("S", bound=socketserver.BaseServer)


@contextmanager
def serving_on_thread(server: S) -> Iterator[S]:
    """Serve until the block ends, then shut down, close the socket and join the thread (bounded)."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
