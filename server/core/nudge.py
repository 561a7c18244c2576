"""Tell a running `wakeful serve` on this machine that another process wrote work, so it looks now.

Best effort by design: if no server answers within a moment, its next idle poll finds the work anyway."""

from __future__ import annotations

import httpx

from wakeful.server.settings import Settings

__all__ = ["nudge"]


def nudge(settings: Settings) -> bool:
    try:
        return httpx.post(f"http://{settings.host}:{settings.port}/v1/wake", timeout=0.5).status_code == 204
    except httpx.HTTPError:
        return False
