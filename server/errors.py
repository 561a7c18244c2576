"""The error tree. Every refusal carries a stable `code` a user or a model can act on.

    WakefulError (code, http_status)
     ├── NotFound            unknown_source, unknown_task, unknown_user ...   404
     ├── Unauthorized        bad_token, signature_*                           401
     ├── BadRequest          malformed_body, invalid_schedule ...             400
     ├── PayloadTooLarge     payload_too_large                                413
     ├── Conflict            invalid_transition, stale_token, wait_terminal   409
     ├── Refused             stopped, paused, cap_exceeded, budget_exhausted  403 / 429
     └── Unavailable         not_ready                                        503

Mapped to HTTP in exactly one place (`server.http.error_response`).
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "BadRequest",
    "Conflict",
    "NotFound",
    "PayloadTooLarge",
    "Refused",
    "StaleToken",
    "Unauthorized",
    "Unavailable",
    "WakefulError",
]


class WakefulError(Exception):
    http_status: ClassVar[int] = 500

    def __init__(self, code: str, message: str, **fields: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.fields = fields

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, **self.fields}}


class NotFound(WakefulError):
    http_status = 404


class Unauthorized(WakefulError):
    http_status = 401


class BadRequest(WakefulError):
    http_status = 400


class PayloadTooLarge(WakefulError):
    http_status = 413


class MethodNotAllowed(WakefulError):
    http_status = 405


class Conflict(WakefulError):
    http_status = 409


class Refused(WakefulError):
    http_status = 403


class Unavailable(WakefulError):
    """Not now: the server or what it depends on cannot answer at the moment (`GET /readyz`)."""

    http_status = 503


class StaleToken(Conflict):
    """A run's fencing token is no longer the session's latest: its commit changed nothing."""

    def __init__(self, session_id: str, token: int) -> None:
        super().__init__("stale_token", f"session {session_id} was taken over; token {token} is stale",
                         session_id=session_id, token=token)
