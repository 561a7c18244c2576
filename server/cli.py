"""The `wakeful` command line."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from sqlalchemy import func, select

from server import control, users
from server.clock import SystemClock
from server.db import make_engine, migrate, read, write
from server.errors import WakefulError
from server.settings import Settings, load_settings
from server.tables import EventStatus, OutboxState, RunOutcome, events, outbox, runs

app = typer.Typer(help="wakeful: a runtime for always-on personal agents.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
err = Console(stderr=True)

DataDir = Annotated[Path | None, typer.Option("--data-dir", help="Data directory [env WAKEFUL_DATA_DIR].")]
DbUrl = Annotated[str | None, typer.Option("--database-url", help="Database URL [env WAKEFUL_DATABASE_URL].")]


def _settings(data_dir: Path | None, database_url: str | None, **more: object) -> Settings:
    try:
        return load_settings(data_dir=data_dir, database_url=database_url, **more)
    except Exception as exc:  # pydantic names the field and the problem; say it plainly and stop
        err.print(f"[red]wakeful: invalid settings:[/red] {exc}")
        raise typer.Exit(2) from None


def _engine(settings: Settings):  # type: ignore[no-untyped-def]
    engine = make_engine(settings.db_url)
    migrate(engine)
    return engine


@app.command()
def serve(
    data_dir: DataDir = None,
    database_url: DbUrl = None,
    host: Annotated[str | None, typer.Option(help="Listen address [env WAKEFUL_HOST; default 127.0.0.1].")] = None,
    port: Annotated[int | None, typer.Option(help="Listen port [env WAKEFUL_PORT; default 8787].")] = None,
) -> None:
    """Run HTTP, workers, scheduler, dispatcher and sweeper in one process (the embedded default)."""
    import uvicorn

    from server.handlers import EchoHandler
    from server.http import create_app
    from server.runtime import Runtime

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = _settings(data_dir, database_url, host=host, port=port)
    runtime = Runtime(settings, handler=EchoHandler())
    try:
        token = runtime.prepare()
    except WakefulError as exc:
        err.print(f"[red]wakeful: {exc.code}:[/red] {exc.message}")
        raise typer.Exit(2) from None
    if token:
        err.print(f"Created user 'owner'. API token (shown once; `wakeful token` issues a new one):\n{token}")
    err.print(f"wakeful serving on http://{settings.host}:{settings.port} (database {settings.db_url})")
    uvicorn.run(create_app(runtime), host=settings.host, port=settings.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=10)


@app.command()
def stop(reason: Annotated[str, typer.Option(help="Why, for the record.")] = "",
         user: Annotated[str | None, typer.Option(help="Stop one user; default: the whole deployment.")] = None,
         data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """STOP: workers, scheduler and dispatcher halt before their next step until `wakeful start`."""
    _set_stop(True, reason, user, data_dir, database_url)


@app.command()
def start(reason: Annotated[str, typer.Option(help="Why, for the record.")] = "",
          user: Annotated[str | None, typer.Option(help="Lift one user's STOP; default: the deployment's.")] = None,
          data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Lift a STOP."""
    _set_stop(False, reason, user, data_dir, database_url)


def _set_stop(stopped: bool, reason: str, user: str | None, data_dir: Path | None, database_url: str | None) -> None:
    engine = _engine(_settings(data_dir, database_url))
    with write(engine) as conn:
        user_id = users.user_id_by_name(conn, user) if user else None
        control.set_stop(conn, stopped=stopped, user_id=user_id, actor="cli", reason=reason,
                         now=SystemClock().now())
    scope = f"user {user}" if user else "everything"
    typer.echo(f"{'STOP' if stopped else 'START'} recorded for {scope}.")


@app.command()
def token(user: Annotated[str, typer.Option(help="Whose token.")] = "owner",
          data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Issue a new API token for a user (the old one stops working). Prints only the token."""
    engine = _engine(_settings(data_dir, database_url))
    with write(engine) as conn:
        try:
            user_id, _ = users.ensure_user(conn, name="owner", now=SystemClock().now()) if user == "owner" else (
                users.user_id_by_name(conn, user), None)
        except WakefulError as exc:
            err.print(f"[red]wakeful: {exc.code}:[/red] {exc.message}")
            raise typer.Exit(2) from None
        typer.echo(users.issue_token(conn, user_id=user_id))


@app.command("user-add")
def user_add(name: str, data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Create a user and print its API token (shown once)."""
    engine = _engine(_settings(data_dir, database_url))
    with write(engine) as conn:
        _, new = users.ensure_user(conn, name=name, now=SystemClock().now())
    if new is None:
        err.print(f"[red]wakeful: user_exists:[/red] {name!r} exists; `wakeful token --user {name}` re-issues")
        raise typer.Exit(2)
    typer.echo(new)


@app.command()
def status(data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Counts of events, runs and outbox messages by state, and whether STOP is in force."""
    engine = _engine(_settings(data_dir, database_url))
    with read(engine) as conn:
        stop_state = control.stop_state(conn)
        for table, column, states in ((events, events.c.status, EventStatus), (runs, runs.c.outcome, RunOutcome),
                                      (outbox, outbox.c.state, OutboxState)):
            counts: dict[str, int] = dict(conn.execute(select(column, func.count()).group_by(column)).all())
            typer.echo(f"{table.name}: " + ", ".join(f"{s.value}={counts.get(s.value, 0)}" for s in states))
    typer.echo(f"stop: {'in force for everything' if stop_state.everything else 'not in force'}"
               + (f"; users stopped: {len(stop_state.users)}" if stop_state.users else ""))


@app.command("migrate")
def migrate_cmd(data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Create or upgrade the database schema."""
    _engine(_settings(data_dir, database_url))
    typer.echo("schema is up to date")
