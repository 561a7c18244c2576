"""`wakeful memory …`: the user's hand on memory from the command line, as `GET|POST /v1/memory…` gives it over
HTTP (both call `server.faces.memory_views`, so they say the same thing). Like the other control commands it acts on
the database directly, as the user named by `--user`, and needs no server running (docs/memory.md).

    list | show ID | add FORM TEXT --subject --relation --value | confirm ID | reject ID | edit ID
    correct ID --reason [--text] | forget ID --reason | reviewed ID
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from wakeful.server.errors import BadRequest, WakefulError
from wakeful.server.faces.cli_common import DataDir, DbUrl, Json, err, fail, open_engine, print_json, settings_or_exit

if TYPE_CHECKING:
    from sqlalchemy import Connection

__all__ = ["memory_app"]

memory_app = typer.Typer(help="What the agent learnt about you, and what you told it to remember: list, show, add, "
                              "confirm or reject candidates, edit, correct, forget (docs/memory.md).",
                         no_args_is_help=True, rich_markup_mode=None)

MemoryArg = Annotated[str, typer.Argument(help="The record's ID (mem_…), from `wakeful memory list`.")]
UserOpt = Annotated[str, typer.Option("--user", help="Whose memory (the CLI acts as that user).")]
Reason = Annotated[str, typer.Option(help="Why, in your words, for the record.")]
SCOPE_REF = "The run's or the task's ID, or the project's name."


def _act(user: str, data_dir: Path | None, database_url: str | None, *, writes: bool,
         do: Callable[[Connection, str], Any]) -> Any:
    """`do(conn, user_id)` in one transaction as `user`; a refusal is one line on stderr and exit code 2. A refusal
    `do` returns instead of raising (the committer's, which records it) is raised once its record is committed."""
    from wakeful.server.store import users
    from wakeful.server.store.db import read, write

    settings = settings_or_exit(data_dir, database_url, existing=True)
    try:
        engine = open_engine(settings)
        with (write if writes else read)(engine) as conn:
            answer = do(conn, users.user_id_by_name(conn, user))
        if isinstance(answer, WakefulError):
            raise answer
    except WakefulError as exc:
        fail(exc)
    return answer


def _line(record: dict[str, Any]) -> str:
    """One record in a line: ID, version, state, form, subject relation value, scope, speaker, text."""
    scope = record["scope"] + (f":{record['scope_ref']}" if record["scope_ref"] else "")
    flags = (" REVIEW" if record["review"] else "") + (f" ({record['retire_reason']})" if record["retire_reason"]
                                                       else "")
    return (f"{record['memory_id']} v{record['version']} {record['state']}{flags} {record['form']} "
            f"{record['subject']} {record['relation']} {record['value']!r} [{scope}] by {record['speaker']}:"
            f"{record['speaker_name']}: {record['text']}")


def _changed(answer: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print_json(answer)
        return
    line = f"{answer['memory_id']}: {answer['state']} {answer['form']} v{answer['version']}"
    for old in answer.get("retired", []):
        line += f"; retired {old} (contradicted)"
    reach = answer.get("reach")
    if reach is not None:
        line += (f"; invalidated {len(reach['invalidated'])} derived record(s)"
                 f"{': ' + ', '.join(reach['invalidated']) if reach['invalidated'] else ''}; "
                 f"recalled by {len(reach['runs'])} run(s)")
    typer.echo(line)


@memory_app.command("list")
def list_cmd(form: Annotated[str | None, typer.Option(help="Only this form (preference, hypothesis, …).")] = None,
             state: Annotated[str | None, typer.Option(help="pending, active or retired.")] = None,
             review: Annotated[bool, typer.Option("--review", help="Only retirements awaiting your review.")] = False,
             task: Annotated[str | None, typer.Option(help="Only records learnt in this task.")] = None,
             limit: Annotated[int, typer.Option(min=1, max=1000, help="At most this many.")] = 100,
             after: Annotated[str | None, typer.Option(help="The `next` of the previous page.")] = None,
             as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
             database_url: DbUrl = None) -> None:
    """Your records, the latest version of each, oldest first: what you wrote, what the agent learnt (pending ones
    wait for you), and what was retired, with why."""
    from wakeful.server.faces import memory_views as views
    from wakeful.server.store.tables import MemoryForm, MemoryState

    for value, allowed in ((form, MemoryForm), (state, MemoryState)):
        if value is not None and value not in {m.value for m in allowed}:
            fail(BadRequest("invalid_parameter", f"{value!r}: one of {', '.join(m.value for m in allowed)}"))
    page = _act(user, data_dir, database_url, writes=False, do=lambda conn, user_id: views.page(
        conn, user_id, form=form, state=state, review=True if review else None, task_id=task, after=after,
        limit=limit))
    if as_json:
        print_json(page)
        return
    for record in page["records"]:
        typer.echo(_line(record))
    if not page["records"]:
        err.print("no memory records" + (" match" if form or state or review or task or after else ""))
    if page["next"]:
        typer.echo(f"more: --after {page['next']}")


@memory_app.command()
def show(memory_id: MemoryArg, as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
         database_url: DbUrl = None) -> None:
    """One record: every version, the evidence it came from, what was derived from it, the runs that recalled it,
    and every change."""
    from wakeful.server.faces import memory_views as views

    shown = _act(user, data_dir, database_url, writes=False,
                 do=lambda conn, user_id: views.detail(conn, user_id, memory_id))
    if as_json:
        print_json(shown)
        return
    for version in shown["versions"]:
        typer.echo(_line(version))
    typer.echo("evidence: " + (", ".join(f"{e['type']} {e['id']}" for e in shown["evidence"]) or "none"))
    typer.echo("derived: " + (", ".join(shown["derived"]) or "none"))
    typer.echo("recalled by: " + (", ".join(shown["recalled_by"]) or "no run"))
    for change in shown["changes"]:
        typer.echo(f"{change['at']}  {change['change']} by {change['actor']}"
                   + (f" ({change['code']})" if change["code"] else ""))


@memory_app.command()
def add(form: Annotated[str, typer.Argument(help="instruction, preference or fact.")],
        text: Annotated[str, typer.Argument(help="In plain words, as the agent will read it.")],
        subject: Annotated[str, typer.Option(help="What it is about: a lowercase identifier (seat).")],
        relation: Annotated[str, typer.Option(help="How: a lowercase identifier (prefers).")],
        value: Annotated[str, typer.Option(help="The value (window).")],
        scope: Annotated[str | None, typer.Option(help="run, task, project or always (default).")] = None,
        scope_ref: Annotated[str | None, typer.Option(help=SCOPE_REF)] = None,
        valid_until: Annotated[str | None, typer.Option(help="When it stops holding: ISO 8601 with a zone.")] = None,
        topic: Annotated[list[str] | None, typer.Option(help="What else it is recalled for (repeatable).")] = None,
        as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
        database_url: DbUrl = None) -> None:
    """Write a standing instruction, a preference or a fact yourself: active at once, spoken by you."""
    from wakeful.proxy.clock import SystemClock
    from wakeful.server.faces import memory_views as views

    body = {"form": form, "text": text, "subject": subject, "relation": relation, "value": value, "scope": scope,
            "scope_ref": scope_ref, "valid_until": valid_until, "topics": topic or []}
    _changed(_act(user, data_dir, database_url, writes=True,
                  do=lambda conn, user_id: views.add(conn, user_id, body, now=SystemClock().now())), as_json)


def _hand(name: str, memory_id: str, user: str, data_dir: Path | None, database_url: str | None, as_json: bool,
          **more: Any) -> None:
    from wakeful.proxy.clock import SystemClock
    from wakeful.server.faces import memory_views as views

    operation = getattr(views, name)
    _changed(_act(user, data_dir, database_url, writes=True, do=lambda conn, user_id: operation(
        conn, user_id, memory_id, now=SystemClock().now(), **more)), as_json)


@memory_app.command()
def confirm(memory_id: MemoryArg, as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
            database_url: DbUrl = None) -> None:
    """Confirm a pending record: it becomes active (a hypothesis becomes a preference), confirmed by you."""
    _hand("confirm", memory_id, user, data_dir, database_url, as_json)


@memory_app.command()
def reject(memory_id: MemoryArg, as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
           database_url: DbUrl = None) -> None:
    """Reject a pending record: retired, never recalled."""
    _hand("reject", memory_id, user, data_dir, database_url, as_json)


@memory_app.command()
def edit(memory_id: MemoryArg,
         text: Annotated[str | None, typer.Option(help="New words.")] = None,
         value: Annotated[str | None, typer.Option(help="A new value.")] = None,
         scope: Annotated[str | None, typer.Option(help="run, task, project or always.")] = None,
         scope_ref: Annotated[str | None, typer.Option(help=SCOPE_REF)] = None,
         valid_until: Annotated[str | None, typer.Option(help="When it stops holding: ISO 8601 with a zone.")] = None,
         as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
         database_url: DbUrl = None) -> None:
    """Change a record: a new version written by you; the old one is kept, retired."""
    changes: dict[str, Any] = {k: v for k, v in (("text", text), ("value", value), ("scope", scope),
                                                 ("scope_ref", scope_ref)) if v is not None}
    if valid_until is not None:
        changes["valid_until"] = _instant(valid_until)
    _hand("edit", memory_id, user, data_dir, database_url, as_json, changes=changes)


def _instant(text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        fail(BadRequest("invalid_parameter", f"{text!r}: an ISO 8601 time with its zone, e.g. 2027-01-31T00:00:00Z"))
    return when


@memory_app.command()
def correct(memory_id: MemoryArg, reason: Reason,
            text: Annotated[str | None, typer.Option(help="What is true instead, kept as your statement.")] = None,
            as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
            database_url: DbUrl = None) -> None:
    """Correct what the agent inferred: the evidence it came from never supports a preference again, the record is
    retired, your words are kept, and everything derived from it is invalidated."""
    _hand("correct", memory_id, user, data_dir, database_url, as_json, reason=reason, text=text)


@memory_app.command()
def forget(memory_id: MemoryArg, reason: Reason, as_json: Json = False, user: UserOpt = "owner",
           data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Forget a record: retired (kept, never recalled), and everything derived from it invalidated."""
    _hand("forget", memory_id, user, data_dir, database_url, as_json, reason=reason)


@memory_app.command()
def reviewed(memory_id: MemoryArg, as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
             database_url: DbUrl = None) -> None:
    """Mark a retirement you did not make (a contradiction, an invalidation) as seen."""
    _hand("reviewed", memory_id, user, data_dir, database_url, as_json)
