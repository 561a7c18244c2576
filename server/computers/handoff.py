"""Handoff state: one-time links to a user's tool computer, the live sessions they become, and when each ends.

A token is good once. Redeeming it makes a live session with two secrets, both random and held only in memory (as
digests): the session id, which names it in URLs, and a binder, which only the browser that redeemed the link holds
(in a cookie). Every later request must show both, so a leaked link or page URL is worthless after its first use.
A session dies with the lease (or when the view-only link expires). The page and the websocket bridge that use it
are `server.faces.liveview`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from wakeful.proxy.clock import Clock
from wakeful.server.computers.pool import Computers

__all__ = ["CONTROL_VNC_PORT", "NOVNC_DIR", "VIEW_MINUTES", "VIEW_VNC_PORT", "LiveViews", "LiveSession"]

NOVNC_DIR = Path("/usr/share/novnc")
"""Debian's `novnc` package: the page loads its RFB module from here (served at /novnc)."""
CONTROL_VNC_PORT = 5900
"""x11vnc on the guest's loopback taking input: what a handoff bridges to."""
VIEW_VNC_PORT = 5901
"""x11vnc on the guest's loopback started with `-viewonly`: what a view-only link bridges to."""
VIEW_MINUTES = (1, 120)


@dataclass(frozen=True)
class LiveSession:
    user_id: str
    view_until: datetime | None = None
    """When a view-only link (and the session it became) expires; None for a handoff, which its lease bounds."""
    lease_id: str | None = None
    """The handoff lease this session holds the screen under (known once the link is redeemed)."""
    binder_sha256: str | None = None
    """The digest of the binder given to the browser that redeemed the link (known once it is redeemed)."""

    @property
    def view_only(self) -> bool:
        return self.view_until is not None


class LiveViews:
    """Tokens waiting to be redeemed, and the live sessions they became."""

    def __init__(self, computers: Computers, clock: Clock) -> None:
        self.computers = computers
        self._clock = clock
        self._tokens: dict[str, LiveSession] = {}  # sha256(token) -> the session it becomes (lease id not yet known)
        self._sessions: dict[str, LiveSession] = {}
        self._lock = threading.Lock()

    def offer(self, user_id: str, token: str) -> None:
        """The one-time token of a handoff link (the tool computer checks it against its lease on redemption)."""
        with self._lock:
            self._tokens[_digest(token)] = LiveSession(user_id=user_id)

    def offer_view(self, user_id: str, ttl: timedelta) -> tuple[str, datetime]:
        """A new one-time token for a view-only link, and when it (and the view it opens) expires."""
        token = secrets.token_urlsafe(32)
        now = self._clock.now()
        with self._lock:
            for digest, offered in list(self._tokens.items()):  # forget view links that expired unused
                if offered.view_until is not None and offered.view_until <= now:
                    del self._tokens[digest]
            self._tokens[_digest(token)] = LiveSession(user_id=user_id, view_until=now + ttl)
        return token, now + ttl

    def redeem(self, token: str) -> tuple[str, str] | None:
        """A session id and its binder for a valid, unused token; None otherwise (unknown, used, expired, control
        returned). The binder goes to the redeeming browser alone."""
        from wakeful.vm.observe import Accepted

        with self._lock:
            offered = self._tokens.pop(_digest(token), None)
        if offered is None:
            return None
        if offered.view_until is not None:
            if self._clock.now() >= offered.view_until:
                return None
            found = offered
        else:
            tc = self.computers.computer(offered.user_id)
            if not isinstance(tc.redeem_handoff(token), Accepted) or tc.lease is None:
                return None
            found = dataclasses.replace(offered, lease_id=tc.lease.lease_id)
        session, binder = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        with self._lock:
            self._sessions[session] = dataclasses.replace(found, binder_sha256=_digest(binder))
        return session, binder

    def live(self, session: str, binder: str | None) -> LiveSession | None:
        """The session while it lasts, to the browser holding its binder: a handoff's while its lease is the one in
        force, a view-only one until its link expires. One that ended is forgotten."""
        with self._lock:
            found = self._sessions.get(session)
        if found is None or binder is None or not hmac.compare_digest(found.binder_sha256 or "", _digest(binder)):
            return None
        if found.view_until is not None:
            ended = self._clock.now() >= found.view_until
        else:
            lease = self.computers.computer(found.user_id).lease
            ended = lease is None or lease.lease_id != found.lease_id
        if ended:
            with self._lock:
                self._sessions.pop(session, None)
            return None
        return found

    def give_back(self, session: str, binder: str | None) -> int | None:
        """Ends a handoff session and returns control (the new epoch); None if there is no control to return."""
        found = self.live(session, binder)
        if found is None or found.view_only:
            return None
        with self._lock:
            self._sessions.pop(session, None)
        return self.computers.computer(found.user_id).return_control(found.lease_id)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
