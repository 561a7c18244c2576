"""The guest channel's interface: what code above SSH needs from a tool computer, and the errors it raises.

`Channel` is implemented by `vm.ssh_channel.GuestChannel` (paramiko, the only module that imports it) and by
`vm.fake_guest.FakeChannel` (in memory). This module imports neither paramiko nor anything that does, so fakes and
the rest of `vm/` can use it without loading an SSH library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

from wakeful.vm.errors import VmError

__all__ = [
    "AuthFailed",
    "BadKey",
    "Channel",
    "ChannelClosed",
    "ClockSync",
    "CommandFailed",
    "GuestError",
    "GuestTimeout",
    "GuestUnreachable",
    "HostKeyMismatch",
    "NotConnected",
    "OutputTooLarge",
    "ReconnectReport",
    "RunResult",
]


class GuestError(VmError):
    """Something between the host and the guest failed; the subclass's `code` says what."""

    code = "guest_error"


class HostKeyMismatch(GuestError):
    """The guest presented a host key other than the one pinned at provisioning."""

    code = "host_key_mismatch"


class BadKey(GuestError):
    """The pinned host key or the client key file cannot be read."""

    code = "bad_key"


class AuthFailed(GuestError):
    code = "auth_failed"


class GuestUnreachable(GuestError):
    """Nothing answers SSH at the guest's port (yet): retried by `reconnect()`."""

    code = "guest_unreachable"


class NotConnected(GuestError):
    """The SSH transport is down (a restore replaced the VM's process): call `reconnect()`."""

    code = "not_connected"


class ChannelClosed(GuestError):
    code = "channel_closed"


class GuestTimeout(GuestError):
    code = "guest_timeout"


class OutputTooLarge(GuestError):
    code = "output_too_large"


class CommandFailed(GuestError):
    code = "guest_command_failed"

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, kw_only=True)
class RunResult:
    status: int
    stdout: bytes
    stderr: bytes

    def check(self, what: str) -> RunResult:
        """Raise `guest_command_failed` unless the command exited 0."""
        if self.status != 0:
            tail = self.stderr.decode(errors="replace").strip()[-500:]
            raise CommandFailed(f"{what} failed with status {self.status}: {tail}", status=self.status)
        return self


@dataclass(frozen=True, kw_only=True)
class ClockSync:
    before: timedelta
    """Guest clock minus host clock before the resync."""
    after: timedelta
    round_trip: timedelta
    """From sending the guest command until the guest first answered with its clock (the shell's start included), or
    through the clock keeper, from the host's line to the keeper's answer."""
    applied: bool = True
    """False when the clock was left alone because the "guest" is this very machine (see `resync_clock`)."""
    kept: bool = False
    """It went through the clock keeper running in the guest (no shell was started)."""


@dataclass(frozen=True, kw_only=True)
class ReconnectReport:
    ports: dict[tuple[str, int], int] = field(default_factory=dict)
    """(remote host, remote port) → local port, for every forward after the reconnect."""
    moved: dict[tuple[str, int], int] = field(default_factory=dict)
    """Forwards whose local port changed (their old port could not be bound again)."""
    attempts: int = 1


class Channel(Protocol):
    """What code above the guest channel needs; `vm.fake_guest.FakeChannel` is the in-memory stand-in."""

    @property
    def connected(self) -> bool: ...

    def connect(self, *, timeout: float = ...) -> None: ...

    def run(self, cmd: str | Sequence[str], *, input: bytes | None = None, timeout: float) -> RunResult: ...

    def forward(self, remote_host: str, remote_port: int) -> int: ...

    def resync_clock(self) -> ClockSync: ...

    def keep_clock(self) -> None: ...

    def reconnect(self, *, timeout: float = ...) -> ReconnectReport: ...

    def alive(self, *, timeout: float = ...) -> bool: ...

    @property
    def side_door_open(self) -> bool:
        """The guest's clock keeper is reachable without SSH (`vm.keeper.SideDoor`): a resync and forwarded
        connections to the guest's loopback need no SSH transport."""
        ...

    def drop(self) -> None: ...

    def close(self) -> None: ...
