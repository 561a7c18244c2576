"""Docs stay true to the code."""

from __future__ import annotations

from pathlib import Path

from server.settings import Settings

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_setting_is_documented_with_its_environment_variable() -> None:
    text = (DOCS / "configuration.md").read_text()
    for name in Settings.model_fields:
        assert f"`{name}`" in text and f"`WAKEFUL_{name.upper()}" in text, name
