"""A real OpenSSH server on the host's loopback, standing in for a tool computer's guest sshd.

    with Sshd(tmp_path / "sshd") as sshd:
        GuestChannel(port=sshd.port, user="root", client_key_path=sshd.client_key,
                     pinned_host_key=sshd.host_public_key)

Everything lives in the given directory: a generated Ed25519 host key and client key, authorized_keys, the config,
the pid file and the log. It listens on 127.0.0.1 only and is only ever signalled by its own PID. `restart()`
stops it and starts it again on the same port, as a restored VM's new QEMU process would come back.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from tests.support.polling import wait_until
from tests.support.serve import free_port

__all__ = ["SSHD", "Sshd", "keygen", "tied_process"]

SSHD = "/usr/sbin/sshd"
# The child asks the kernel to SIGKILL it if the test process dies without cleaning up, then execs in place.
_LAUNCHER = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    os._exit(70)
os.execv(sys.argv[2], sys.argv[2:])
"""
STOP_GRACE = 10.0


def tied_process(argv: Sequence[str], *, log_path: Path,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` so that it dies with the test process (Linux), logging stdout and stderr to `log_path`."""
    command = list(argv) if sys.platform != "linux" else [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *argv]
    with log_path.open("ab") as log:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else None)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM by PID, then SIGKILL if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_GRACE)


def keygen(path: Path) -> str:
    """A new Ed25519 key pair at `path` (OpenSSH format); returns the public key line."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", path.name, "-f", str(path)],
                   check=True, timeout=30)
    return path.with_suffix(".pub").read_text().strip()


class Sshd:
    def __init__(self, directory: Path, *, forwarding: str = "local", netns: str | None = None,
                 gateway_ports: str = "no", log_level: str = "ERROR") -> None:
        """`forwarding`: sshd's AllowTcpForwarding (`all` for a host that forwards back to the egress proxy).
        `gateway_ports`: sshd's GatewayPorts (`clientspecified` for a host on an isolated network, whose forward
        listens on the network's host address).
        `netns`: a network namespace (`/proc/PID/ns/net`) to run in, listening on that namespace's loopback.
        `log_level`: sshd's LogLevel (`INFO` logs each login, which `logins` counts)."""
        self.forwarding, self.netns, self.gateway_ports, self.log_level = forwarding, netns, gateway_ports, log_level
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host_public_key = keygen(self.dir / "host_ed25519")
        self.client_key = self.dir / "client_ed25519"
        (self.dir / "authorized_keys").write_text(keygen(self.client_key) + "\n")
        self.port = free_port()
        self.log_path = self.dir / "sshd.log"
        self._proc: subprocess.Popen[bytes] | None = None

    def _config(self) -> Path:
        config = self.dir / "sshd_config"
        config.write_text("\n".join([
            f"Port {self.port}",
            "ListenAddress 127.0.0.1",
            f"HostKey {self.dir / 'host_ed25519'}",
            f"PidFile {self.dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            f"AllowTcpForwarding {self.forwarding}",
            f"GatewayPorts {self.gateway_ports}",
            "X11Forwarding no",
            "PermitTTY no",
            "MaxStartups 50",
            f"LogLevel {self.log_level}",
        ]) + "\n")
        return config

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self) -> Sshd:
        if self.pid is not None:
            raise RuntimeError(f"sshd (pid {self.pid}) is already running")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # OpenSSH's privilege separation directory
        enter = ["/usr/bin/nsenter", f"--net={self.netns}"] if self.netns is not None else []
        self._proc = tied_process([*enter, SSHD, "-D", "-e", "-f", str(self._config())], log_path=self.log_path)
        wait_until(self._listening, 15.0, f"sshd on 127.0.0.1:{self.port}")
        return self

    def _listening(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            raise AssertionError(f"sshd exited with {self._proc.returncode}: {self.log_path.read_text()}")
        if self.netns is not None:  # another loopback: connect from inside the namespace
            probe = f"exec 3<>/dev/tcp/127.0.0.1/{self.port}"
            return subprocess.run(["nsenter", f"--net={self.netns}", "bash", "-c", probe], capture_output=True,
                                  timeout=10).returncode == 0
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the listener and every session it forked (each connection has its own sshd child, which would
        outlive the listener), so a client's transport dies as it does when a VM's QEMU process is replaced."""
        if self._proc is None:
            return
        sessions = _descendants(self._proc.pid)  # before the listener exits and they are re-parented
        stop_process(self._proc)
        self._proc = None
        for pid in sessions:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def logins(self) -> int:
        """How many connections logged in, from sshd's own log (LogLevel INFO)."""
        assert self.log_level != "ERROR", "sshd logs no logins at LogLevel ERROR"
        return self.log_path.read_text().count("Accepted publickey for ") if self.log_path.exists() else 0

    def sessions(self) -> list[int]:
        """The PIDs of the processes serving its connections (each connection's sshd children), to signal one
        connection without the listener."""
        return _descendants(self._proc.pid) if self._proc is not None else []

    def restart(self) -> Sshd:
        self.stop()
        return self.start()

    def __enter__(self) -> Sshd:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def _descendants(root: int) -> list[int]:
    """The PIDs of every process below `root`, read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found
