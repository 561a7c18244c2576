"""Log lines (`server.observe.logs`): JSON when asked, one object per line, and secrets never written."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from wakeful.server.observe.logs import REDACTED, JsonFormatter, Redactor, configure_logging, secrets_of
from wakeful.server.settings import Settings

TOKEN = "wk_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0U1v"
AGENT = "wka_" + "z" * 43


@pytest.fixture
def root_restored() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def _line(formatter: logging.Formatter, message: str, *args: object, exc: bool = False) -> str:
    record = logging.LogRecord("wakeful.test", logging.ERROR, __file__, 1, message, args, None)
    if exc:
        try:
            raise ValueError(f"boom with {TOKEN}")
        except ValueError:
            import sys

            record.exc_info = sys.exc_info()
    return formatter.format(record)


def test_a_json_line_holds_time_level_logger_message_and_the_exception_text() -> None:
    line = json.loads(_line(JsonFormatter(), "run %s failed", "run_1", exc=True))
    assert set(line) == {"time", "level", "logger", "message", "exception"}
    assert (line["level"], line["logger"], line["message"]) == ("ERROR", "wakeful.test", "run run_1 failed")
    assert line["time"].endswith("+00:00")
    assert "Traceback" in line["exception"] and "ValueError: boom with" in line["exception"]
    assert TOKEN not in line["exception"] and REDACTED in line["exception"]


def test_a_line_without_an_exception_has_no_exception_field() -> None:
    assert "exception" not in json.loads(_line(JsonFormatter(), "quiet"))


def test_secret_values_and_credential_shaped_strings_are_redacted() -> None:
    redact = Redactor(["hook-signing-secret", "sk-ant-secret-key", "short"])
    said = redact(f"secret hook-signing-secret, key sk-ant-secret-key, {TOKEN} and {AGENT}; short stays")
    assert said == f"secret {REDACTED}, key {REDACTED}, {REDACTED} and {REDACTED}; short stays"


def test_the_settings_secrets_are_the_sources_and_the_model_key() -> None:
    settings = Settings(sources={"gh": {"kind": "github", "secret": "gh-secret-1"}},
                        anthropic_api_key="sk-ant-xyz-123")
    assert sorted(secrets_of(settings)) == ["gh-secret-1", "sk-ant-xyz-123"]


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_configured_logging_writes_the_chosen_format_with_secrets_redacted(
        log_format: str, root_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    configure_logging(Settings(log_format=log_format, sources={"gh": {"kind": "github", "secret": "gh-secret-1"}}))
    logging.getLogger("wakeful.test").warning("the secret is gh-secret-1 and the token %s", TOKEN)
    written = stream.getvalue().strip()
    assert "gh-secret-1" not in written and TOKEN not in written and written.count(REDACTED) == 2
    if log_format == "json":
        assert json.loads(written)["message"] == f"the secret is {REDACTED} and the token {REDACTED}"
    else:
        assert written.endswith(f"WARNING wakeful.test: the secret is {REDACTED} and the token {REDACTED}")


@pytest.fixture
def uvicorn_loggers_restored() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    kept = [(list(logger.handlers), logger.propagate, logger.level) for logger in loggers]
    yield
    for logger, (handlers, propagate, level) in zip(loggers, kept, strict=True):
        logger.handlers[:], logger.propagate = handlers, propagate
        logger.setLevel(level)


@pytest.mark.parametrize("access_log", [False, True])
def test_a_server_without_an_access_log_has_uvicorn_write_no_access_line(
        tmp_path: object, root_restored: None, uvicorn_loggers_restored: None, access_log: bool) -> None:
    """`wakeful api` turns uvicorn's access log off: routed to the root's handler anyway, uvicorn built the line's
    arguments for every request (and dropped it below its level), ~2% of the event loop at saturation."""
    import uvicorn

    from wakeful.server.faces.http import QuietServer

    configure_logging(Settings(log_format="json"))
    QuietServer(uvicorn.Config(lambda *_: None, log_level="warning", access_log=access_log))
    # uvicorn's protocol writes access lines only when this is true (`httptools_impl`, `h11_impl`)
    assert logging.getLogger("uvicorn.access").hasHandlers() is access_log
    assert logging.getLogger("uvicorn.error").hasHandlers()  # its errors still go to our log
