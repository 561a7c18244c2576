"""What processes of one data directory share under `<data_dir>/run/`: an owner's lock file and a private socket.

    fd = hold_lock(run / "worker.lock", lambda pid: Conflict("worker_running", f"... (pid {pid}) ..."))
    sock = bind_private(run / "wake.sock", socket.SOCK_DGRAM)   # 0600: only this uid connects

The lock is `flock`: the kernel releases it when its holder ends, however it ends, so a socket file left behind by
a holder that died may be unlinked by the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Callable
from pathlib import Path

__all__ = ["bind_private", "hold_lock"]


def hold_lock(path: Path, refused: Callable[[str], Exception]) -> int:
    """Take `path`'s exclusive lock without waiting and write this pid in it; the open descriptor (closing it
    releases the lock). Held by another process: raises `refused(its pid)`."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise refused(holder) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def bind_private(path: Path, kind: socket.SocketKind) -> socket.socket:
    """A Unix socket of `kind` bound at `path`, mode 0600 from its first moment (no window where another uid could
    connect). A file left at `path` is replaced: call it holding the lock that makes this process its owner."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, kind)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return sock
