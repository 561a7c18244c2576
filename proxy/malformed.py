"""Audit rows for connections that send no readable HTTP/1.1 request (400 `malformed_request`), bounded.

Such a connection costs its sender one write, so one row each would let a flood fill the disk. Each is answered
and refused all the same; a burst of them is recorded one row each, then one per interval (`limits.RowBudget`), and
the rest are counted: one row, `malformed_summary_every` seconds after the first it counts, says how many there
were and when. Nothing goes unaccounted; a flood writes a few rows a minute.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime

from wakeful.proxy.channel import DeciderClient
from wakeful.proxy.config import ProxyConfig
from wakeful.proxy.contract import RefusalCode
from wakeful.proxy.exchange import Exchange
from wakeful.proxy.limits import RowBudget

__all__ = ["MalformedRows"]

log = logging.getLogger("wakeful.proxy")


class MalformedRows:
    """Where the proxy records its `malformed_request` refusals: `record` each one, `close` at shutdown."""

    def __init__(self, config: ProxyConfig, decider: DeciderClient) -> None:
        self._budget = RowBudget(burst=config.malformed_rows_burst, every=config.malformed_rows_every)
        self._summary_every = config.malformed_summary_every
        self._decider = decider
        self._counted = 0
        self._first: datetime | None = None
        self._last: datetime | None = None
        self._timer: asyncio.TimerHandle | None = None

    def record(self, ex: Exchange) -> None:
        """Record one refused connection: its own row while the budget allows, else counted."""
        if self._budget.take(time.monotonic()):
            ex.record(self._decider)
            return
        if self._counted == 0:
            self._first = ex.at
            self._timer = asyncio.get_running_loop().call_later(self._summary_every, self._summarise)
            log.warning("connections are sending no readable HTTP/1.1 request faster than the audit records one by "
                        "one; counting them, one row every %g s", self._summary_every)
        self._counted += 1
        self._last = ex.at

    def close(self) -> None:
        """Write the count now rather than after its interval: the proxy is stopping."""
        if self._timer is not None:
            self._timer.cancel()
            self._summarise()

    def _summarise(self) -> None:
        self._timer = None
        if self._counted == 0 or self._first is None or self._last is None:
            return
        ex = Exchange(method="", scheme="http", host=None, port=None)
        ex.refused(RefusalCode.MALFORMED_REQUEST, (
            f"{self._counted} more connections sent no readable HTTP/1.1 request between "
            f"{self._first.isoformat(timespec='seconds')} and {self._last.isoformat(timespec='seconds')}; each was "
            f"refused (400 malformed_request) without a row of its own: past {self._budget.burst} such rows, one "
            f"is written every {self._budget.every:g} s"))
        self._counted, self._first, self._last = 0, None, None
        ex.record(self._decider)
