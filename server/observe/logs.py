"""Log lines: text for a terminal, or one JSON object per line for a log pipeline (`log_format = "json"`).

A JSON line holds `time` (ISO 8601, UTC), `level`, `logger`, `message`, and `exception` (the traceback's text) when
there is one. Either way, what could be a secret is replaced before a line is written: the values of the secrets in
the settings (webhook signing secrets, the model's API key) and anything shaped like a wakeful credential (`wk_…`,
`wka_…`), wherever they appear in the message or the traceback.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Literal

from wakeful.server.settings import Settings

__all__ = ["JsonFormatter", "Redactor", "announce", "configure_logging", "route_uvicorn_to_root", "secrets_of"]

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
REDACTED = "[redacted]"
_CREDENTIAL = re.compile(r"\bwka?_[A-Za-z0-9_\-]{16,}")
"""A user's token or an agent credential (`server.store.users`, `server.faces.auth`): prefix and random part."""


class Redactor:
    """Replaces known secret values and credential-shaped strings in text."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        # Longest first: a secret that contains another is replaced whole. Very short values would redact words.
        self._secrets = sorted({s for s in secrets if len(s) >= 6}, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, REDACTED)
        return _CREDENTIAL.sub(REDACTED, text)


def secrets_of(settings: Settings) -> list[str]:
    """The secret values the settings hold."""
    found = [source.secret.get_secret_value() for source in settings.sources.values()]
    if settings.anthropic_api_key is not None:
        found.append(settings.anthropic_api_key.get_secret_value())
    return found


class _RedactingText(logging.Formatter):
    def __init__(self, redact: Redactor) -> None:
        super().__init__(TEXT_FORMAT)
        self._redact = redact

    def format(self, record: logging.LogRecord) -> str:
        return self._redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and exception when there is one."""

    def __init__(self, redact: Redactor | None = None) -> None:
        super().__init__()
        self._redact = redact or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": self._redact(record.getMessage()),
        }
        if record.exc_info:
            line["exception"] = self._redact(self.formatException(record.exc_info))
        elif record.exc_text:
            line["exception"] = self._redact(record.exc_text)
        return json.dumps(line, ensure_ascii=False)


def configure_logging(settings: Settings, *, level: int = logging.INFO) -> None:
    """The root logger writes to stderr in the settings' `log_format`, redacting their secrets; called once by
    each `wakeful` process that runs the server, replacing whatever handlers were there."""
    redact = Redactor(secrets_of(settings))
    chosen: Literal["text", "json"] = settings.log_format
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(redact) if chosen == "json" else _RedactingText(redact))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)


def announce(line: str) -> None:
    """A line for whoever started the process (where it serves, that it stops): as it is on a terminal, a log record
    where the logs are JSON, whose stderr then holds nothing but one object per line."""
    if any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers):
        logging.getLogger("wakeful").info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def route_uvicorn_to_root(*, access_log: bool = True) -> None:
    """uvicorn's loggers write through the root's handler (and so in its format) once `configure_logging` ran;
    uvicorn gives them handlers of their own each time a server is configured. Without `access_log` (the server's
    config turned it off) its access logger stays without any: uvicorn formats an access line for every request
    whenever that logger has a handler, even one its level then drops."""
    if not any(isinstance(h.formatter, JsonFormatter | _RedactingText) for h in logging.getLogger().handlers):
        return
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = access_log or name != "uvicorn.access"
