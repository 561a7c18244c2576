"""What every `wakeful` command shares: the data-dir and database options, settings that stop on a typo (naming
the field, and the file and line or the environment variable it came from), the data directory kept private, the
migrated engine, and the one way a refusal is printed."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import ValidationError
from pydantic_settings import SettingsError
from rich.console import Console
from rich.markup import escape
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError

from wakeful.server.errors import WakefulError
from wakeful.server.settings import DB_FILE, ConfigFileError, Settings, config_file, load_settings
from wakeful.server.store.db import make_engine, migrate
from wakeful.server.store.toml_lines import TomlLines

__all__ = ["DataDir", "DbUrl", "Json", "err", "fail", "open_engine", "print_json", "say", "settings_or_exit"]

err = Console(stderr=True, highlight=False, soft_wrap=True)

DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Data directory [env WAKEFUL_DATA_DIR].")]
DbUrl = Annotated[str | None, typer.Option("--database-url", help="Database URL [env WAKEFUL_DATABASE_URL].")]
Json = Annotated[bool, typer.Option("--json", help="One JSON document on stdout instead of text.")]


def say(code: str, message: str) -> None:
    """One error line on stderr: `wakeful: <code>: <message>`, never wrapped, never read as markup."""
    err.print(f"[red]wakeful: {escape(code)}:[/red] {escape(message)}", soft_wrap=True)


def fail(exc: WakefulError) -> NoReturn:
    say(exc.code, exc.message)
    raise typer.Exit(2)


def print_json(value: Any) -> None:
    typer.echo(json.dumps(value, sort_keys=True, default=str))


def settings_or_exit(data_dir: Path | None, database_url: str | None, *, existing: bool = False,
                     **more: object) -> Settings:
    """The resolved settings, or exit 2 with what is wrong and where; the data directory exists and is private.

    A command that reads or controls work already there says `existing=True`: on SQLite it then stops with
    `no_data` when the data directory holds no database, instead of creating an empty one in a mistyped directory.
    """
    flags = {"data_dir": data_dir, "database_url": database_url, **more}
    try:
        settings = load_settings(**flags)
    except ConfigFileError as exc:
        say("invalid_settings", str(exc))
        raise typer.Exit(2) from None
    except ValidationError as exc:
        for problem in exc.errors():
            say("invalid_settings", _describe(problem, data_dir, {k for k, v in flags.items() if v is not None}))
        raise typer.Exit(2) from None
    except SettingsError as exc:  # a source that could not be read at all; the cause says why
        say("invalid_settings", f"{exc}: {exc.__cause__}" if exc.__cause__ else str(exc))
        raise typer.Exit(2) from None
    if existing and settings.database_url is None and not (settings.data_dir / DB_FILE).exists():
        say("no_data", f"{settings.data_dir} holds no wakeful database: check --data-dir or WAKEFUL_DATA_DIR, "
                       f"or start `wakeful serve --data-dir {settings.data_dir}` there first")
        raise typer.Exit(2)
    _private_data_dir(settings)
    return settings


def _describe(problem: Any, data_dir: Path | None, flags: set[str]) -> str:
    """`field (where): what is wrong`, where is the flag, the environment variable or the file and line."""
    loc = tuple(problem["loc"])
    field = ".".join(str(part) for part in loc) or "settings"
    origin = _origin(loc, data_dir, flags)
    error = problem.get("ctx", {}).get("error") if problem["type"] == "value_error" else None
    said = str(error) if error is not None else problem["msg"]  # our own words, without pydantic's "Value error, "
    hint = _JSON_HINTS.get(problem["type"], "") if origin.startswith("environment") else ""
    return f"{field} ({origin}): {said}{hint}"


_JSON_HINTS = {
    "list_type": ' (in the environment a list is JSON: ["…", "…"])',
    "dict_type": ' (in the environment a table is JSON: {"key": …})',
    "model_type": ' (in the environment a table is JSON: {"key": …})',
}
"""What a value in the environment that should have been JSON, and was not, is told (`settings._Environment`)."""


def _origin(loc: tuple[str | int, ...], data_dir: Path | None, flags: set[str]) -> str:
    if not loc:
        return "the settings together"
    if loc[0] in flags:
        return f"--{str(loc[0]).replace('_', '-')}"
    variable = "WAKEFUL_" + "__".join(str(part) for part in loc).upper()
    for name in os.environ:
        if name.upper() == variable or variable.startswith(name.upper() + "__"):
            return f"environment {name}"
    path = config_file(data_dir)
    with contextlib.suppress(OSError):
        line = TomlLines(path.read_text()).line_of(loc)
        if line is not None:
            return f"{path} line {line}"
    return "the settings"


def _private_data_dir(settings: Settings) -> None:
    """The data directory is created owner-only (0700), and the SQLite file in it 0600 before SQLite creates it
    (SQLite gives its -wal and -shm files the database file's mode). An existing directory is left as it is."""
    with contextlib.suppress(FileExistsError):
        settings.data_dir.mkdir(parents=True, mode=0o700)
        os.chmod(settings.data_dir, 0o700)  # mkdir's mode is filtered by the umask
    if settings.database_url is None:
        path = settings.data_dir / DB_FILE
        with contextlib.suppress(FileExistsError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.fchmod(fd, 0o600)
            os.close(fd)


def open_engine(settings: Settings, revision: str = "head") -> Engine:
    """The database, migrated to the newest revision (or to `revision`); exit 2 if it cannot be (a newer version
    migrated it, a downgrade is refused, or it does not answer: `database_unreachable`)."""
    engine = make_engine(settings.db_url)
    try:
        migrate(engine, revision)
    except WakefulError as exc:
        fail(exc)
    except OperationalError as exc:
        engine.dispose()
        reason = " ".join(str(exc.orig if exc.orig is not None else exc).split())
        say("database_unreachable", f"{settings.db_shown}: {reason} (check database_url, and that the database "
                                    "server is running and lets this user in)")
        raise typer.Exit(2) from None
    return engine
