"""`wakeful proxy`, `wakeful secret …` and `wakeful egress …`: the egress proxy, its credential vault and its audit."""

from __future__ import annotations

import getpass
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from sqlalchemy import Engine

from wakeful.proxy.clock import SystemClock
from wakeful.proxy.vault import KEY_ENV, CredentialNotFound, VaultError
from wakeful.server.egress import grants as egress
from wakeful.server.egress.proxyctl import open_vault, rotate_vault_key, vault_keys
from wakeful.server.errors import NotFound, WakefulError
from wakeful.server.faces.cli_common import (
    DataDir,
    DbUrl,
    Json,
    err,
    fail,
    open_engine,
    print_json,
    say,
    settings_or_exit,
)
from wakeful.server.store import users
from wakeful.server.store.db import read, write

__all__ = ["egress_app", "proxy_app", "secret_app"]

proxy_app = typer.Typer(help="The egress proxy: credentials added only to requests the policy allowed. Without a "
                             "subcommand, `wakeful proxy` starts the proxy on 127.0.0.1:<proxy_port> and runs it until "
                             "stopped, asking a running `wakeful api` for every decision (`wakeful serve` already "
                             "starts both as its children).",
                        invoke_without_command=True, no_args_is_help=False, subcommand_metavar="[COMMAND [ARGS]...]",
                        rich_markup_mode=None)
secret_app = typer.Typer(help="Credentials in the vault (encrypted at rest; values only ever read from stdin).",
                         no_args_is_help=True, rich_markup_mode=None)
egress_app = typer.Typer(help="What the egress proxy let through or refused, and tool computers' proxy access.",
                         no_args_is_help=True, rich_markup_mode=None)


def _vault_failed(exc: VaultError) -> typer.Exit:
    err.print(f"[red]wakeful: vault_error:[/red] {exc}")
    return typer.Exit(2)


# -- the proxy ---------------------------------------------------------------------------------------------------


@proxy_app.callback()
def proxy(ctx: typer.Context, data_dir: DataDir = None,
          await_api: Annotated[float, typer.Option(
              "--await-api", min=0, metavar="SECONDS",
              help="Wait up to this long for `wakeful api` to start (its systemd unit starts beside this one) "
                   "instead of failing at once.")] = 0.0) -> None:
    """Without a subcommand: start the egress proxy on 127.0.0.1:<proxy_port> and run it until SIGTERM or Ctrl-C,
    asking a running `wakeful api` for every decision (`wakeful serve` starts both for you)."""
    if ctx.invoked_subcommand is not None:
        return
    import logging

    from wakeful.server.egress.proxyctl import run_proxy
    from wakeful.server.observe.logs import configure_logging

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_or_exit(data_dir, None)
    configure_logging(settings)  # `log_format`, secrets redacted: the same lines as the server's
    try:
        run_proxy(settings, await_api=await_api)
    except WakefulError as exc:
        fail(exc)
    except VaultError as exc:
        raise _vault_failed(exc) from None


@proxy_app.command("ca")
def proxy_ca(output: Annotated[Path | None, typer.Option("-o", "--output", help="Write to this file.")] = None,
             data_dir: DataDir = None) -> None:
    """Print the deployment CA certificate (PEM) that tool computers and clients trust; created if missing."""
    from wakeful.proxy.tls import load_or_create_ca

    settings = settings_or_exit(data_dir, None)
    try:
        pem = load_or_create_ca(settings.proxy_dir, vault_keys(settings)).ca_pem()
    except VaultError as exc:
        raise _vault_failed(exc) from None
    if output is None:
        sys.stdout.write(pem.decode("ascii"))
    else:
        output.write_bytes(pem)
        err.print(f"wrote the deployment CA certificate to {output}")


# -- the vault ---------------------------------------------------------------------------------------------------


def _read_secret(name: str) -> bytes:
    if sys.stdin.isatty():
        value = getpass.getpass(f"value for {name} (not echoed): ")
    else:
        value = sys.stdin.read()
        if value.endswith("\n"):  # one line ending, as `echo` or a here-string adds; anything else is the value
            value = value[:-1].removesuffix("\r")
    if not value:
        err.print("[red]wakeful: empty_secret:[/red] no value on stdin (pipe it in: `printf %s \"$V\" | wakeful "
                  "secret set …`)")
        raise typer.Exit(2)
    return value.encode("utf-8")


@secret_app.command("set")
def secret_set(
    name: Annotated[str, typer.Argument(help="The binding's name, as connectors and egress rules refer to it.")],
    host: Annotated[str, typer.Option(help="The only host this credential is ever sent to (HTTPS only).")],
    header: Annotated[str, typer.Option(help="The header it goes in.")] = "Authorization",
    template: Annotated[str, typer.Option(help="The header's value, {secret} where the secret goes.")]
    = "Bearer {secret}",
    data_dir: DataDir = None,
) -> None:
    """Store or replace a credential. The value is read from stdin (never from the command line)."""
    settings = settings_or_exit(data_dir, None)
    secret = _read_secret(name)
    try:
        info = open_vault(settings).set(name, secret, host, header, template)
    except ValueError as exc:  # VaultError is not one; a bad name, host, header or template is
        err.print(f"[red]wakeful: invalid_credential:[/red] {exc}")
        raise typer.Exit(2) from None
    except VaultError as exc:
        raise _vault_failed(exc) from None
    typer.echo(f"stored {info.name}: sent only to https://{info.host} in {info.header}")


@secret_app.command("list")
def secret_list(as_json: Json = False, data_dir: DataDir = None) -> None:
    """The stored credentials: name, host, header, template, key. Never a value."""
    settings = settings_or_exit(data_dir, None)
    try:
        infos = open_vault(settings).list()
    except VaultError as exc:
        raise _vault_failed(exc) from None
    if as_json:
        print_json([{"name": i.name, "host": i.host, "header": i.header, "template": i.template, "key_id": i.key_id,
                     "created_at": i.created_at.isoformat()} for i in infos])
        return
    table = Table("name", "host", "header", "template", "key", "created")
    for i in infos:
        table.add_row(i.name, i.host, i.header, i.template, i.key_id, i.created_at.isoformat(timespec="seconds"))
    Console().print(table)


@secret_app.command("rm")
def secret_rm(name: str, data_dir: DataDir = None) -> None:
    """Remove a credential; requests that needed it are refused (`credential_unavailable`) from now on."""
    settings = settings_or_exit(data_dir, None)
    try:
        open_vault(settings).remove(name)
    except CredentialNotFound:
        err.print(f"[red]wakeful: unknown_credential:[/red] no credential named {name}")
        raise typer.Exit(2) from None
    except VaultError as exc:
        raise _vault_failed(exc) from None
    typer.echo(f"removed {name}")


@secret_app.command("rotate-key")
def secret_rotate_key(data_dir: DataDir = None) -> None:
    """Re-encrypt every credential and the deployment CA's key under a new key in the key file (safe to run again if
    interrupted)."""
    import os

    settings = settings_or_exit(data_dir, None)
    if os.environ.get(KEY_ENV, "").strip():
        err.print(f"[red]wakeful: key_in_environment:[/red] the keys come from {KEY_ENV}; rotate them there")
        raise typer.Exit(2)
    try:
        key = rotate_vault_key(settings)
    except VaultError as exc:
        raise _vault_failed(exc) from None
    typer.echo(f"every credential and the deployment CA's key are now encrypted under key {key.key_id}")


# -- audit and tool-computer access --------------------------------------------------------------------------------


@egress_app.command("log")
def egress_log(
    user: Annotated[str | None, typer.Option(help="Only this user's requests.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="How many, newest first.")] = 50,
    verdict: Annotated[str | None, typer.Option(help="allow or refuse.")] = None,
    as_json: Json = False,
    data_dir: DataDir = None, database_url: DbUrl = None,
) -> None:
    """The egress audit: every request the proxy saw, allowed or refused, with the rule or the reason."""
    if verdict not in (None, "allow", "refuse"):
        say("bad_verdict", "--verdict is allow or refuse")
        raise typer.Exit(2)
    engine = open_engine(settings_or_exit(data_dir, database_url))
    try:
        with read(engine) as conn:
            user_id = users.user_id_by_name(conn, user) if user else None
            rows = egress.audit_rows(conn, user_id=user_id, limit=limit, verdict=verdict)
    except WakefulError as exc:
        fail(exc)
    if as_json:
        print_json(list(rows))
        return
    table = Table("at", "verdict", "code", "method", "url", "status", "ms", "credential", "rule / reason")
    for r in rows:
        port = "" if (r["scheme"], r["port"]) in (("https", 443), ("http", 80)) else f":{r['port']}"
        url = f"{r['scheme']}://{r['host']}{port}{r['path']}" if r["host"] else "(no destination read)"
        cells = (r["at"][:19], r["verdict"], r["code"] or "", r["method"], url, str(r["upstream_status"] or ""),
                 f"{r['latency_ms']:.1f}", r["credential"] or "", r["rule"])
        table.add_row(*(Text(cell) for cell in cells))  # as recorded: a path or a reason is never read as markup
    Console(width=200).print(table)


@egress_app.command("client")
def egress_client(
    label: Annotated[str | None, typer.Argument(help="What this is for, e.g. the tool computer's name.")] = None,
    revoke: Annotated[str | None, typer.Option(
        "--revoke", metavar="LABEL", help="Revoke the credential issued for LABEL instead of issuing one: the proxy "
                                          "refuses it (not_admitted) from its next request on.")] = None,
    user: Annotated[str, typer.Option(help="Whose tool computer.")] = "owner",
    data_dir: DataDir = None, database_url: DbUrl = None,
) -> None:
    """Issue a proxy credential for a tool computer (Proxy-Authorization: Basic user_id:token). Shown once.
    Issuing again for the same LABEL revokes the earlier credential at once; `--revoke LABEL` revokes it without
    issuing another."""
    if label is not None and revoke is not None or label is None and revoke is None:
        say("bad_arguments", "give a LABEL to issue a credential for, or --revoke LABEL; one of the two")
        raise typer.Exit(2)
    engine = open_engine(settings_or_exit(data_dir, database_url))
    try:
        if revoke is not None:
            _revoke_client(engine, user, revoke)
        elif label is not None:
            _issue_client(engine, user, label)
    except WakefulError as exc:
        fail(exc)


def _issue_client(engine: Engine, user: str, label: str) -> None:
    with write(engine) as conn:
        user_id = users.user_id_by_name(conn, user)
        client_id, token = egress.issue_client_token(conn, user_id=user_id, label=label, now=SystemClock().now())
    err.print(f"egress client {client_id} for {user} ({label}); any earlier credential for {label} no longer works; "
              "the proxy credential, shown once:", soft_wrap=True, markup=False, highlight=False)
    typer.echo(f"{user_id}:{token}")


def _revoke_client(engine: Engine, user: str, label: str) -> None:
    with write(engine) as conn:
        user_id = users.user_id_by_name(conn, user)
        if egress.revoke_label(conn, user_id=user_id, label=label, now=SystemClock().now()) == 0:
            raise NotFound("unknown_client", f"{user} has no live egress client labelled {label}")
    typer.echo(f"revoked the proxy credential of {user}'s tool computer {label}: the proxy refuses it from its next "
               "request on")
