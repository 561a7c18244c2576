"""Alive and ready: what `GET /healthz` and `GET /readyz` answer.

Alive is only that the process answers. Ready is that what a request may need answers now: the database, the
egress proxy (when `proxy = true`), libvirt (when `computers = true`), and that the process is not draining: from
the first SIGTERM on it answers not ready, for `drain_seconds` before it stops listening, so a load balancer takes
it out of rotation while it still finishes what it was given. Nothing here names a user or reads their records.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sqlalchemy import Engine, text

from wakeful.server.settings import Settings

__all__ = ["Check", "Drain", "readiness"]

log = logging.getLogger(__name__)

TIMEOUT = 2.0
"""Seconds one check may take before it counts as failed (a hung database must not hang the probe)."""


@dataclass(frozen=True, kw_only=True)
class Check:
    """One dependency's answer: `problem` is None when it answered, else what failed, in words."""

    name: str
    problem: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None


class Drain:
    """Whether this process is draining: set once, by the first SIGTERM, and never cleared."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def begin(self) -> None:
        self._event.set()

    @property
    def draining(self) -> bool:
        return self._event.is_set()


async def readiness(settings: Settings, engine: Engine, drain: Drain, *,
                    proxy_refused: Callable[[], bool] = lambda: False) -> list[Check]:
    """Every check this process's settings call for, run together, each bounded by `TIMEOUT`. `proxy_refused`
    says whether the decider channel refuses the proxy's hello (`channel.DeciderServer.hello_refused`)."""
    probes: list[tuple[str, Callable[[], Awaitable[None]]]] = [("database", lambda: _database(engine))]
    if settings.proxy:
        probes.append(("proxy", lambda: _proxy(settings.proxy_port, proxy_refused)))
    if settings.computers:
        probes.append(("libvirt", lambda: asyncio.to_thread(_libvirt, settings.libvirt_uri)))
    checks = list(await asyncio.gather(*(_bounded(name, probe) for name, probe in probes)))
    checks.append(Check(name="draining", problem="the process is stopping (SIGTERM)" if drain.draining else None))
    return checks


async def _bounded(name: str, probe: Callable[[], Awaitable[None]]) -> Check:
    try:
        await asyncio.wait_for(probe(), TIMEOUT)
    except TimeoutError:
        return Check(name=name, problem=f"no answer within {TIMEOUT:g} s")
    except _Unreachable as exc:
        return Check(name=name, problem=str(exc))
    except Exception as exc:  # what failed is the operator's to read in the log; the answer names only its kind
        log.warning("readiness: %s is unreachable: %s", name, exc)
        return Check(name=name, problem=f"unreachable ({type(exc).__name__})")
    return Check(name=name)


class _Unreachable(Exception):
    """A check's own words for what failed."""


async def _database(engine: Engine) -> None:
    def ping() -> None:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    await asyncio.to_thread(ping)


async def _proxy(port: int, refused: Callable[[], bool]) -> None:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        said = os.strerror(exc.errno).lower() if exc.errno else type(exc).__name__
        raise _Unreachable(f"nothing answers on 127.0.0.1:{port} ({said})") from None
    writer.close()
    await writer.wait_closed()
    if refused():  # it answers, but refuses every request with decider_unavailable until it reads this run's token
        raise _Unreachable("the decider refuses the proxy's hello: it holds a token from an earlier run of the api "
                           "(it reads run/decider.token again as it reconnects; an older proxy must be restarted)")


def _libvirt(uri: str) -> None:
    try:
        from wakeful.vm.libvirt_adapter import LibvirtHypervisor
    except ImportError as exc:
        raise _Unreachable(f"the VM packages are not installed ({exc.name}): ./scripts/install --computers, or "
                           "computers = false") from None
    from wakeful.vm.errors import VmError

    try:
        LibvirtHypervisor(uri).names()
    except VmError as exc:
        raise _Unreachable(f"{uri}: {exc.code}") from None
