"""What every `wakeful` command shares: the data-dir and database options, settings that stop on a typo, the
migrated engine, and the one way a refusal is printed."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console
from sqlalchemy import Engine

from wakeful.server.errors import WakefulError
from wakeful.server.settings import Settings, load_settings
from wakeful.server.store.db import make_engine, migrate

__all__ = ["DataDir", "DbUrl", "err", "fail", "open_engine", "settings_or_exit"]

err = Console(stderr=True)

DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Data directory [env WAKEFUL_DATA_DIR].")]
DbUrl = Annotated[str | None, typer.Option("--database-url", help="Database URL [env WAKEFUL_DATABASE_URL].")]


def settings_or_exit(data_dir: Path | None, database_url: str | None, **more: object) -> Settings:
    try:
        return load_settings(data_dir=data_dir, database_url=database_url, **more)
    except Exception as exc:  # pydantic names the field and the problem; say it plainly and stop
        err.print(f"[red]wakeful: invalid settings:[/red] {exc}")
        raise typer.Exit(2) from None


def open_engine(settings: Settings) -> Engine:
    engine = make_engine(settings.db_url)
    migrate(engine)
    return engine


def fail(exc: WakefulError) -> NoReturn:
    err.print(f"[red]wakeful: {exc.code}:[/red] {exc.message}")
    raise typer.Exit(2)
