"""`wakeful agent add|list|revoke`: the user's agent credentials, one per MCP client (`server.store.agents`).

An agent credential reaches the agent's tools at `/mcp` and nothing else (`server.faces.auth`): give one to Claude
Code instead of the user's own token, which also approves, pauses and lifts a STOP.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from sqlalchemy import Connection

from wakeful.proxy.clock import SystemClock
from wakeful.server.errors import WakefulError
from wakeful.server.faces.cli_common import DataDir, DbUrl, Json, fail, open_engine, print_json, settings_or_exit
from wakeful.server.store import agents, users
from wakeful.server.store.db import read, write

__all__ = ["agent_app"]

agent_app = typer.Typer(help="Agent credentials: one per MCP client, reaching the agent's tools (/mcp) and nothing "
                             "else. Give one to Claude Code, never your own token.",
                        no_args_is_help=True, rich_markup_mode=None)

Name = Annotated[str, typer.Argument(help="What you call the client: claude-code, cursor, …")]
UserOpt = Annotated[str, typer.Option("--user", help="Whose agent.")]


def _user_id(conn: Connection, user: str, *, create: bool) -> str:
    """The user's ID; the default user `owner` is created on first use, as `wakeful token` does."""
    if create and user == "owner":
        return users.ensure_user(conn, name="owner", now=SystemClock().now())[0]
    return users.user_id_by_name(conn, user)


@agent_app.command("add")
def agent_add(name: Name, user: UserOpt = "owner", data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Add an agent credential named NAME and print it (shown once; only its digest is kept)."""
    engine = open_engine(settings_or_exit(data_dir, database_url))
    try:
        with write(engine) as conn:
            token = agents.add(conn, user_id=_user_id(conn, user, create=True), name=name, now=SystemClock().now())
    except WakefulError as exc:
        fail(exc)
    typer.echo(token)


@agent_app.command("list")
def agent_list(user: UserOpt = "owner", as_json: Json = False, data_dir: DataDir = None,
               database_url: DbUrl = None) -> None:
    """The agent credentials, live and revoked, oldest first (never a credential itself)."""
    engine = open_engine(settings_or_exit(data_dir, database_url, existing=True))
    try:
        with read(engine) as conn:
            found = agents.listing(conn, user_id=_user_id(conn, user, create=False))
    except WakefulError as exc:
        fail(exc)
    if as_json:
        print_json([{"name": c.name, "created_at": c.created_at.isoformat(),
                     "revoked_at": c.revoked_at.isoformat() if c.revoked_at else None} for c in found])
        return
    table = Table("name", "created", "revoked")
    for c in found:
        table.add_row(c.name, c.created_at.isoformat(timespec="seconds"),
                      c.revoked_at.isoformat(timespec="seconds") if c.revoked_at else "")
    Console().print(table)


@agent_app.command("revoke")
def agent_revoke(name: Name, user: UserOpt = "owner", data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Revoke the agent credential NAME: the client holding it is refused (401) from its next request."""
    engine = open_engine(settings_or_exit(data_dir, database_url, existing=True))
    try:
        with write(engine) as conn:
            agents.revoke(conn, user_id=_user_id(conn, user, create=False), name=name, now=SystemClock().now())
    except WakefulError as exc:
        fail(exc)
    typer.echo(f"{name} is revoked.")
