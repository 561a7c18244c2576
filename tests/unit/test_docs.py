"""Docs stay true to the code."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from wakeful.server.settings import Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_setting_is_documented_with_its_environment_variable() -> None:
    text = (DOCS / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"`{name}`" in text and f"`WAKEFUL_{name.upper()}" in text, name


def test_durations_in_the_environment_may_be_plain_seconds_or_iso(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAKEFUL_RESEND_AFTER", "2")
    monkeypatch.setenv("WAKEFUL_LEASE", "PT3S")
    monkeypatch.setenv("WAKEFUL_DISPATCH_BACKOFF", "0.5")
    settings = Settings()
    assert (settings.resend_after, settings.lease, settings.dispatch_backoff) == (
        timedelta(seconds=2), timedelta(seconds=3), timedelta(seconds=0.5))
