"""`wakeful ledger verify | export FILE | key`: the verifiable ledger (`server.audit`) from the command line.

Imported by `wakeful ledger` when one of these runs, not with the command line. `verify` exits 0 when the ledger
holds, 1 naming the first bad row (and listing the rest) when it does not, 2 on a refusal (`wakeful: code: …`).
"""

from __future__ import annotations

from pathlib import Path

import typer
from sqlalchemy import Engine

from wakeful.proxy.clock import SystemClock
from wakeful.server.audit.chain import Verdict
from wakeful.server.audit.export import read_export, write_export
from wakeful.server.audit.seal import seal
from wakeful.server.audit.signing import LedgerKey, PublicKey, load_or_create_key, parse_public_key
from wakeful.server.audit.verify import snapshot, verify_database
from wakeful.server.errors import BadRequest, WakefulError
from wakeful.server.faces.cli_common import err, open_engine, print_json, settings_or_exit

__all__ = ["export_ledger", "print_key", "verify_ledger"]


def _open(data_dir: Path | None, database_url: str | None) -> tuple[Engine, LedgerKey]:
    settings = settings_or_exit(data_dir, database_url, existing=True)
    return open_engine(settings), load_or_create_key(settings.ledger_key_path)


def _given_key(text: str) -> PublicKey:
    """`--key`: the key as `wakeful ledger key` prints it, or a file holding it."""
    path = Path(text)
    if not text.startswith("ed25519:") and path.is_file():
        try:
            text = path.read_text()
        except OSError as exc:
            raise BadRequest("cannot_read", f"cannot read {path}: {exc.strerror}") from None
    return parse_public_key(text)


def verify_ledger(*, export: Path | None, key: str | None, as_json: bool, data_dir: Path | None,
                  database_url: str | None) -> None:
    if export is not None:
        if key is None:
            raise BadRequest("missing_key", "checking an export needs the ledger's public key: --key ed25519:… "
                                            "(`wakeful ledger key` on the server prints it)")
        public = _given_key(key)
        try:
            with export.open(encoding="utf-8") as lines:
                verdict = read_export(lines, public)
        except (OSError, UnicodeDecodeError) as exc:
            raise BadRequest("cannot_read", f"cannot read {export}: {exc}") from None
        _report(verdict, str(export), as_json)
        return
    engine, own = _open(data_dir, database_url)
    seal(engine, own, now=SystemClock().now())
    verdict = verify_database(engine, own.public if key is None else _given_key(key))
    _report(verdict, "the ledger", as_json)


def export_ledger(file: Path, *, data_dir: Path | None, database_url: str | None) -> None:
    engine, own = _open(data_dir, database_url)
    seal(engine, own, now=SystemClock().now())
    seen = snapshot(engine)
    try:
        with file.open("w", encoding="utf-8") as out:
            write_export(seen, out, key=own.public)
    except OSError as exc:
        raise WakefulError("cannot_write", f"cannot write {file}: {exc.strerror}") from None
    err.print(f"wrote {len(seen.entries)} ledger entries and {len(seen.checkpoints)} signed checkpoints to {file}; "
              f"check it with `wakeful ledger verify --export {file} --key {own.public.text()}`")


def print_key(*, data_dir: Path | None, database_url: str | None) -> None:
    settings = settings_or_exit(data_dir, database_url)
    typer.echo(load_or_create_key(settings.ledger_key_path).public.text())


def _report(verdict: Verdict, what: str, as_json: bool) -> None:
    if as_json:
        print_json({"ok": verdict.ok, "entries": verdict.entries, "checkpoints": verdict.checkpoints,
                    "head_pos": verdict.head_pos, "head_hash": verdict.head_hash, "pending": verdict.pending,
                    "problems": [{"kind": p.kind.value, "pos": p.pos, "table": p.table, "key": p.key, "part": p.part,
                                  "detail": p.detail} for p in verdict.problems]})
    elif verdict.ok:
        typer.echo(f"{what} verifies: {verdict.entries} rows chained, {verdict.checkpoints} signed checkpoints, "
                   f"head {verdict.head_pos} {verdict.head_hash}")
    else:
        typer.echo(f"{what} does NOT verify: first bad row: {verdict.problems[0].describe()}")
        for problem in verdict.problems[1:]:
            typer.echo(f"  also: {problem.describe()}")
    if not verdict.ok:
        raise typer.Exit(1)
