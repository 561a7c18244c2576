"""How much the proxy holds or writes on a client's say-so: request-body bytes (per client and over every client)
and audit rows for connections that send no request. Pure bookkeeping.

A body is read whole before it is decided (its digest is part of the decision) and kept until its request is
answered. Without a bound, a few clients parking large uploads hold the proxy's memory; with it, one more body
than the proxy may hold is answered 503 `proxy_busy`, before any of it is read when its length is declared.

A connection that sends bytes that are not a request costs its sender nothing, so a row for each could fill the
disk: `RowBudget` lets a burst of them be recorded one by one, then one per interval; the shell counts the rest.
"""

from __future__ import annotations

from wakeful.proxy.contract import ProxyRefusal, RefusalCode

__all__ = ["BodyBudget", "Held", "RowBudget"]


class BodyBudget:
    """The bytes reserved for request bodies, per client key and in total, against two caps."""

    def __init__(self, *, total: int, per_client: int) -> None:
        if total < 0 or per_client < 0:
            raise ValueError("caps are ≥ 0")
        self.total_cap = total
        self.client_cap = per_client
        self.total = 0
        self._clients: dict[str, int] = {}

    def held_by(self, client: str) -> int:
        return self._clients.get(client, 0)

    def reserve(self, client: str, size: int) -> bool:
        """Reserve `size` more bytes for `client` if both caps allow it; whether they did."""
        if size < 0:
            raise ValueError("size is ≥ 0")
        held = self._clients.get(client, 0)
        if self.total + size > self.total_cap or held + size > self.client_cap:
            return False
        self.total += size
        self._clients[client] = held + size
        return True

    def release(self, client: str, size: int) -> None:
        held = self._clients.get(client, 0)
        if not 0 <= size <= held:
            raise ValueError(f"releasing {size} bytes of {held} held")
        if size == 0:
            return
        self.total -= size
        if held == size:
            del self._clients[client]
        else:
            self._clients[client] = held - size


class Held:
    """What one request holds of a `BodyBudget`; `release()` (always, in a `finally`) gives it all back."""

    __slots__ = ("budget", "client", "size")

    def __init__(self, budget: BodyBudget, client: str) -> None:
        self.budget = budget
        self.client = client
        self.size = 0

    def take(self, size: int) -> None:
        """Raises `ProxyRefusal(proxy_busy)` when the caps do not allow `size` more bytes."""
        if not self.budget.reserve(self.client, size):
            raise ProxyRefusal(RefusalCode.PROXY_BUSY)
        self.size += size

    def release(self) -> None:
        self.budget.release(self.client, self.size)
        self.size = 0


class RowBudget:
    """A token bucket of audit rows: `burst` at once, then one more every `every` seconds. The caller passes the
    (monotonic) time, so the bookkeeping stays pure."""

    def __init__(self, *, burst: int, every: float) -> None:
        if burst < 0 or every <= 0:
            raise ValueError("burst is ≥ 0 and every > 0")
        self.burst = burst
        self.every = every
        self._tokens = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> bool:
        """Whether one more row may be written at `now`; if so, it is counted."""
        if self._at is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) / self.every)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
