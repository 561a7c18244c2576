"""Every setting is held to what it can mean when the settings load: durations in both spellings, numbers in their
ranges, URLs, host names and database URLs that are ones, and a value the environment should give as JSON and did
not refused by its field's name (not by an error from inside pydantic-settings)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from wakeful.server.settings import ConfigFileError, Settings, child_environment, load_settings

SECONDS_FIELDS = ("connector_timeout", "proxy_decider_timeout", "reconcile_interval", "poll_interval",
                  "idle_poll_max", "sweep_interval", "coalesce_seconds", "drain_seconds", "run_max_seconds")
"""The durations the code reads as a float of seconds."""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("WAKEFUL_"):
            monkeypatch.delenv(name)


def _refused_field(exc: pytest.ExceptionInfo[ValidationError]) -> set[str]:
    return {".".join(str(part) for part in error["loc"]) for error in exc.value.errors()}


@pytest.mark.parametrize("field", SECONDS_FIELDS)
def test_a_duration_read_as_seconds_takes_iso_8601_as_well_as_seconds_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    read = []
    for spelling in ("PT1M30S", "90", "90.0"):
        monkeypatch.setenv(f"WAKEFUL_{field.upper()}", spelling)
        read.append(getattr(load_settings(data_dir=tmp_path), field))
    assert read == [90.0, 90.0, 90.0] and {type(value) for value in read} == {float}


@pytest.mark.parametrize("field", SECONDS_FIELDS)
def test_a_duration_read_as_seconds_takes_iso_8601_in_the_config_file_and_a_child_gets_the_same_float(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    (tmp_path / "wakeful.toml").write_text(f'{field} = "PT0.5S"\n')
    parent = load_settings(data_dir=tmp_path)
    assert getattr(parent, field) == 0.5
    monkeypatch.setenv("WAKEFUL_RESOLVED_SETTINGS", child_environment(parent, base={})["WAKEFUL_RESOLVED_SETTINGS"])
    assert getattr(Settings(), field) == 0.5


@pytest.mark.parametrize("spelling", ["soon", "PT", "inf", "nan", "1 minute"])
def test_a_duration_read_as_seconds_that_is_neither_spelling_is_refused_saying_both(
        monkeypatch: pytest.MonkeyPatch, spelling: str) -> None:
    monkeypatch.setenv("WAKEFUL_CONNECTOR_TIMEOUT", spelling)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert _refused_field(refused) == {"connector_timeout"}
    assert "ISO 8601" in str(refused.value)


REFUSED = [
    ("WAKEFUL_WORKERS", "0", "workers"),
    ("WAKEFUL_WORKERS", "100", "workers"),  # `--workers` takes 1..64 too
    ("WAKEFUL_POLL_INTERVAL", "0", "poll_interval"),
    ("WAKEFUL_IDLE_POLL_MAX", "0", "idle_poll_max"),
    ("WAKEFUL_SWEEP_INTERVAL", "0", "sweep_interval"),
    ("WAKEFUL_RECONCILE_INTERVAL", "0", "reconcile_interval"),
    ("WAKEFUL_LEASE", "0", "lease"),
    ("WAKEFUL_RUN_MAX_STEPS", "0", "run_max_steps"),
    ("WAKEFUL_RUN_MAX_SECONDS", "0", "run_max_seconds"),
    ("WAKEFUL_RUN_MAX_TOKENS", "0", "run_max_tokens"),
    ("WAKEFUL_DAILY_MAX_STEPS", "0", "daily_max_steps"),
    ("WAKEFUL_HELPER_MAX_STEPS", "0", "helper_max_steps"),
    ("WAKEFUL_EVENT_MAX_ATTEMPTS", "0", "event_max_attempts"),
    ("WAKEFUL_DISPATCH_MAX_ATTEMPTS", "0", "dispatch_max_attempts"),
    ("WAKEFUL_FOLLOWUP_CAP", "-1", "followup_cap"),
    ("WAKEFUL_MAX_BODY_BYTES", "-1", "max_body_bytes"),
    ("WAKEFUL_CONNECTOR_TIMEOUT", "-1", "connector_timeout"),
    ("WAKEFUL_CONNECTOR_TIMEOUT", "0", "connector_timeout"),
    ("WAKEFUL_PROXY_DECIDER_TIMEOUT", "0", "proxy_decider_timeout"),
    ("WAKEFUL_EGRESS_GRANT_TTL", "0", "egress_grant_ttl"),
    ("WAKEFUL_DISPATCH_BACKOFF", "0", "dispatch_backoff"),
    ("WAKEFUL_RESEND_AFTER", "PT0S", "resend_after"),
    ("WAKEFUL_SCHEDULE_MIN_INTERVAL", "0", "schedule_min_interval"),
    ("WAKEFUL_HELPER_MAX_TIME", "0", "helper_max_time"),
    ("WAKEFUL_COMPUTER_IDLE_AFTER", "0", "computer_idle_after"),
    ("WAKEFUL_CHECK_WAKES_PER_DAY", "-1", "check_wakes_per_day"),
    ("WAKEFUL_PORT", "99999", "port"),
    ("WAKEFUL_PORT", "0", "port"),
    ("WAKEFUL_PROXY_PORT", "70000", "proxy_port"),
    ("WAKEFUL_HOST", "not a host", "host"),
    ("WAKEFUL_HOST", "", "host"),
    ("WAKEFUL_NOTIFY_URL", "nope", "notify_url"),
    ("WAKEFUL_NOTIFY_URL", "ftp://example.org/x", "notify_url"),
    ("WAKEFUL_NOTIFY_URL", "https://exa mple.org/", "notify_url"),
    ("WAKEFUL_CONNECTOR_URLS__MERCHANT", "notaurl", "connector_urls.merchant"),
    ("WAKEFUL_CONNECTOR_URLS__MERCHANT", "http://merchant.test:99999", "connector_urls.merchant"),
    ("WAKEFUL_EGRESS_ALLOW_PRIVATE", '["not a host"]', "egress_allow_private.0"),
    ("WAKEFUL_EGRESS_NO_INTERCEPT", '["pinned.example", ""]', "egress_no_intercept.1"),
    ("WAKEFUL_EGRESS_RESOLVE", '{"merchant.test": ["localhost"]}', "egress_resolve.merchant.test.0"),
    ("WAKEFUL_COMPUTER_IMAGE", "../../etc", "computer_image"),
    ("WAKEFUL_MODEL", "", "model"),
]


@pytest.mark.parametrize(("variable", "value", "field"), REFUSED, ids=[f"{v}={x!r}" for v, x, _ in REFUSED])
def test_a_value_out_of_its_settings_range_is_refused_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert _refused_field(refused) == {field}


@pytest.mark.parametrize(("variable", "value", "field"), [
    ("WAKEFUL_EGRESS_ALLOW_PRIVATE", "merchant.test", "egress_allow_private"),
    ("WAKEFUL_EGRESS_NO_INTERCEPT", "pinned.example", "egress_no_intercept"),
    ("WAKEFUL_EGRESS_RESOLVE", "merchant.test=127.0.0.1", "egress_resolve"),
    ("WAKEFUL_COMPUTER_HOSTS", "notjson", "computer_hosts"),
])
def test_a_value_the_environment_gives_as_json_and_did_not_is_refused_naming_the_setting(
        monkeypatch: pytest.MonkeyPatch, variable: str, value: str, field: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as refused:  # not pydantic-settings' SettingsError, which names no variable
        Settings()
    assert _refused_field(refused) == {field}


@pytest.mark.parametrize(("url", "said"), [
    ("garbage", "not a database URL"),
    ("mysql://wakeful:secret@db/wakeful", "'mysql' is not a database wakeful runs on"),
    ("postgresql://wakeful:secret@db/wakeful", "psycopg 3, not psycopg2"),
    ("sqlite://", "SQLite needs a file"),
    ("sqlite:///:memory:", "SQLite needs a file"),
])
def test_a_database_url_wakeful_cannot_run_on_is_refused_without_repeating_the_url(
        monkeypatch: pytest.MonkeyPatch, url: str, said: str) -> None:
    monkeypatch.setenv("WAKEFUL_DATABASE_URL", url)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert _refused_field(refused) == {"database_url"}
    message = refused.value.errors()[0]["msg"]
    assert said in message and "secret" not in message


def test_a_webhook_source_needs_a_name_its_url_can_carry(tmp_path: Path) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(data_dir=tmp_path, sources={"my hook": {"kind": "generic", "secret": "s"}})
    assert {str(error["loc"][0]) for error in refused.value.errors()} == {"sources"}


def test_an_empty_database_url_is_unset_so_the_data_directorys_sqlite_file_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAKEFUL_DATABASE_URL", "")  # as an env file's `WAKEFUL_DATABASE_URL=` leaves it
    settings = load_settings(data_dir=tmp_path)
    assert settings.database_url is None and settings.db_url == f"sqlite:///{tmp_path / 'wakeful.db'}"


def test_wakeful_config_naming_a_directory_says_it_is_a_directory(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAKEFUL_CONFIG", str(tmp_path))
    with pytest.raises(ConfigFileError, match="names this directory: name the TOML file itself"):
        load_settings()


def test_a_config_file_that_is_not_utf_8_is_refused_as_a_config_file_error(tmp_path: Path) -> None:
    (tmp_path / "wakeful.toml").write_bytes(b"port = 8787\n# caf\xe9\n")
    with pytest.raises(ConfigFileError, match="not UTF-8"):
        load_settings(data_dir=tmp_path)
