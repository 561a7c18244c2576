"""Settings are resolved once: flags > `WAKEFUL_*` environment > the config file > conventional variables >
defaults; the config file follows the data directory the flags name; a child gets the resolution whole."""

from __future__ import annotations

import importlib.util
import re
from datetime import timedelta
from pathlib import Path

import click
import pytest
import typer

from wakeful.server.faces.cli import app
from wakeful.server.settings import RESOLVED_ENV, ConfigFileError, Settings, child_environment, load_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("WAKEFUL_") or name == "ANTHROPIC_API_KEY":
            monkeypatch.delenv(name)


def test_the_config_file_in_the_data_dir_named_by_a_flag_is_read(tmp_path: Path) -> None:
    (tmp_path / "wakeful.toml").write_text("port = 9001\nproxy_port = 9002\n")
    settings = load_settings(data_dir=tmp_path)
    assert (settings.port, settings.proxy_port) == (9001, 9002)


def test_flags_beat_the_environment_which_beats_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "wakeful.toml").write_text("port = 9001\nproxy_port = 9002\nworkers = 7\n")
    monkeypatch.setenv("WAKEFUL_PORT", "9101")
    monkeypatch.setenv("WAKEFUL_PROXY_PORT", "9102")
    settings = load_settings(data_dir=tmp_path, port=9201)
    assert (settings.port, settings.proxy_port, settings.workers) == (9201, 9102, 7)


def test_wakeful_config_names_the_file_and_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text(f"data_dir = {str(tmp_path / 'data')!r}\nport = 9301\n")
    monkeypatch.setenv("WAKEFUL_CONFIG", str(elsewhere))
    assert (load_settings().data_dir, load_settings().port) == (tmp_path / "data", 9301)
    monkeypatch.setenv("WAKEFUL_CONFIG", str(tmp_path / "missing.toml"))
    with pytest.raises(ConfigFileError, match="missing.toml"):
        load_settings()


def test_the_data_dirs_own_file_cannot_move_the_data_dir(tmp_path: Path) -> None:
    (tmp_path / "wakeful.toml").write_text("data_dir = '/elsewhere'\n")
    with pytest.raises(ConfigFileError, match="data_dir cannot be set"):
        load_settings(data_dir=tmp_path)


def test_a_child_uses_the_parents_resolution_whatever_its_own_environment_says(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "wakeful.toml").write_text(
        "proxy_port = 9402\nlease = 'PT45S'\n[sources.gh]\nkind = 'github'\nsecret = 'shh'\n")
    parent = load_settings(data_dir=tmp_path, port=9401)
    env = child_environment(parent, base={"WAKEFUL_PROXY_PORT": "1"})
    assert env["WAKEFUL_PROXY_PORT"] == "1" and RESOLVED_ENV in env
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    (tmp_path / "wakeful.toml").write_text("proxy_port = 2\n")  # changed since: the child still agrees with us
    child = Settings()
    assert child == parent
    assert (child.port, child.proxy_port, child.lease) == (9401, 9402, timedelta(seconds=45))
    assert child.sources["gh"].secret.get_secret_value() == "shh"


def test_the_anthropic_key_falls_back_to_the_conventional_variable(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(data_dir=tmp_path).anthropic_api_key is None
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-conventional")
    key = load_settings(data_dir=tmp_path).anthropic_api_key
    assert key is not None and key.get_secret_value() == "sk-conventional"


def test_our_own_anthropic_key_beats_the_conventional_one_in_the_environment_and_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-conventional")
    (tmp_path / "wakeful.toml").write_text("anthropic_api_key = 'sk-file'\n")
    from_file = load_settings(data_dir=tmp_path).anthropic_api_key
    assert from_file is not None and from_file.get_secret_value() == "sk-file"
    monkeypatch.setenv("WAKEFUL_ANTHROPIC_API_KEY", "sk-ours")
    ours = load_settings(data_dir=tmp_path).anthropic_api_key
    assert ours is not None and ours.get_secret_value() == "sk-ours"


def _commands(group: click.Group, prefix: str = "") -> set[str]:
    names: set[str] = set()
    for name, command in group.commands.items():
        names.add(f"{prefix}{name}")
        if isinstance(command, click.Group):
            names |= _commands(command, f"{prefix}{name} ")
    return names


def test_a_negative_signature_tolerance_is_refused_when_the_settings_load(tmp_path: Path) -> None:
    # Let through, it would fail every delivery of the source with a 500.
    with pytest.raises(ValueError, match="tolerance_seconds"):
        Settings(data_dir=tmp_path, sources={"hook": {"kind": "generic", "secret": "s", "tolerance_seconds": -1}})


def test_github_has_no_default_delivery_id_locator_since_github_signs_none(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, sources={"gh": {"kind": "github", "secret": "s"},
                                                     "hook": {"kind": "generic", "secret": "s"}})
    assert settings.sources["gh"].delivery_locator() is None
    assert settings.sources["hook"].delivery_locator() == "header:X-Wakeful-Delivery"


def test_every_command_a_message_in_the_code_names_exists() -> None:
    commands = _commands(typer.main.get_group(app))
    named = {(path.relative_to(ROOT), m[1]) for top in ("server", "vm", "proxy") for path in (ROOT / top).rglob("*.py")
             for m in re.finditer(r"`wakeful ([a-z][a-z-]*(?: [a-z][a-z-]*)?)", path.read_text())}
    unknown = {(str(p), n) for p, n in named if n not in commands and n.split(" ")[0] not in commands}
    assert not unknown


@pytest.mark.parametrize("installed", [True, False], ids=["with the VM packages", "without them"])
def test_tool_computers_are_on_by_default_only_where_their_packages_are_installed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed: bool) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: find_spec(name, *a) if installed or name != "libvirt" else None)
    monkeypatch.delenv("WAKEFUL_COMPUTERS", raising=False)
    assert Settings(data_dir=tmp_path).computers is installed
    (tmp_path / "wakeful.toml").write_text("computers = true\n")  # asked for: on, and /readyz says what is missing
    assert load_settings(data_dir=tmp_path).computers is True
