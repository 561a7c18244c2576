"""The in-process proxy runs on asyncio's own loop and on uvloop's (what `wakeful proxy` uses when installed)."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> object:
    if request.param == "uvloop":
        pytest.importorskip("uvloop")
        return ("asyncio", {"use_uvloop": True})
    return "asyncio"
