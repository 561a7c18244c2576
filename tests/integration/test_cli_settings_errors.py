"""A new user's wrong settings and names, through the real `wakeful` command: each is one line that names the setting
(or says what a name must be) with a stable code and exit 2, never `unexpected_error` or a traceback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_cli import WAKEFUL
from tests.support.serve import free_port


def wakeful(data_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_") and k != "ANTHROPIC_API_KEY"}
    return subprocess.run([WAKEFUL, *args], env=base | {"WAKEFUL_DATA_DIR": str(data_dir), **env},
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def refused(result: subprocess.CompletedProcess[str], code: str) -> str:
    """The one line the command said, once it is known to be the refusal `code` with exit 2."""
    assert result.returncode == 2, result.stderr
    assert "unexpected_error" not in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"wakeful: {code}: "), result.stderr
    return result.stderr


SETTINGS = [
    ("WAKEFUL_EGRESS_ALLOW_PRIVATE", "merchant.test", "egress_allow_private", "a list is JSON"),
    ("WAKEFUL_EGRESS_NO_INTERCEPT", "pinned.example", "egress_no_intercept", "a list is JSON"),
    ("WAKEFUL_COMPUTER_HOSTS", "notjson", "computer_hosts", "a list is JSON"),
    ("WAKEFUL_DATABASE_URL", "garbage", "database_url", "not a database URL"),
    ("WAKEFUL_DATABASE_URL", "mysql://wakeful@db/wakeful", "database_url", "only SQLite and PostgreSQL"),
    ("WAKEFUL_WORKERS", "0", "workers", "greater than or equal to 1"),
    ("WAKEFUL_POLL_INTERVAL", "0", "poll_interval", "greater than or equal to 0.01"),
    ("WAKEFUL_PORT", "99999", "port", "less than or equal to 65535"),
    ("WAKEFUL_HOST", "not a host", "host", "is not an address to listen on"),
    ("WAKEFUL_NOTIFY_URL", "nope", "notify_url", "is not an http:// or https:// URL"),
    ("WAKEFUL_CONNECTOR_URLS__MERCHANT", "notaurl", "connector_urls.merchant", "is not an http:// or https:// URL"),
    ("WAKEFUL_CONNECTOR_TIMEOUT", "soon", "connector_timeout", "nor an ISO 8601 duration (PT30S)"),
]


@pytest.mark.parametrize(("variable", "value", "field", "said"), SETTINGS,
                         ids=[f"{variable}={value}" for variable, value, _, _ in SETTINGS])
def test_a_setting_a_new_user_gets_wrong_is_refused_naming_it_and_its_variable(
        tmp_path: Path, variable: str, value: str, field: str, said: str) -> None:
    line = refused(wakeful(tmp_path, "status", **{variable: value}), "invalid_settings")
    assert f"{field} (environment {variable}): " in line and said in line
    assert "Value error," not in line  # our own words, not pydantic's wrapping of them


def test_a_duration_read_as_seconds_is_taken_in_iso_8601(tmp_path: Path) -> None:
    result = wakeful(tmp_path, "token", WAKEFUL_CONNECTOR_TIMEOUT="PT5S", WAKEFUL_POLL_INTERVAL="PT0.5S",
                     WAKEFUL_DRAIN_SECONDS="PT1M")
    assert result.returncode == 0 and result.stdout.startswith("wk_"), result.stderr


def test_a_database_that_does_not_answer_is_database_unreachable_without_its_password(tmp_path: Path) -> None:
    url = f"postgresql+psycopg://wakeful:hunter2@127.0.0.1:{free_port()}/wakeful"  # nothing listens there
    line = refused(wakeful(tmp_path, "token", WAKEFUL_DATABASE_URL=url), "database_unreachable")
    assert "Connection refused" in line and "127.0.0.1" in line and "hunter2" not in line


def test_a_config_file_that_is_not_utf_8_is_refused_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "wakeful.toml").write_bytes(b"port = 8787\n# caf\xe9\n")
    line = refused(wakeful(tmp_path, "status"), "invalid_settings")
    assert f"{tmp_path / 'wakeful.toml'}: not UTF-8" in line


def test_wakeful_config_naming_a_directory_says_it_is_one(tmp_path: Path) -> None:
    line = refused(wakeful(tmp_path, "status", WAKEFUL_CONFIG=str(tmp_path)), "invalid_settings")
    assert "WAKEFUL_CONFIG names this directory" in line and "does not exist" not in line


@pytest.mark.parametrize("name", ["", "bad name", "two\nlines", "x" * 5000, "Alice", "-flag-like"],
                         ids=["empty", "a space", "a newline", "5000 characters", "upper case", "a leading dash"])
def test_user_add_refuses_a_name_that_is_not_one(tmp_path: Path, name: str) -> None:
    line = refused(wakeful(tmp_path, "user-add", "--", name), "invalid_user_name")
    assert "1 to 40 lower-case letters" in line and len(line) < 400
    listed = wakeful(tmp_path, "user-add", "alice")  # a name that is one still makes a user
    assert listed.returncode == 0 and listed.stdout.startswith("wk_"), listed.stderr
