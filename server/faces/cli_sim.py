"""`wakeful sim`: the merchant, airline, hotel and mail simulators on 127.0.0.1 until interrupted.

Each prints its base URL and its `/_sim` control URLs on stdout. With `--webhook-url` (a `wakeful serve`'s
`/v1/hooks/<source>`, `{sim}` standing for the simulator's name), each sends its webhooks there, signed by the
generic scheme with the secret from `--webhook-secret-file` or `WAKEFUL_SIM_WEBHOOK_SECRET` (never a flag: argv is
visible to every user of the machine).
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from wakeful.server.faces.cli_common import say

if TYPE_CHECKING:
    from wakeful.server.sims.fleet import WebhookTarget

__all__ = ["SECRET_ENV", "sim"]

SECRET_ENV = "WAKEFUL_SIM_WEBHOOK_SECRET"
CONTROLS = ("records", "faults", "clock", "webhooks")


def _names(which: str) -> list[str]:
    # The simulators (and the web framework under them) are imported by the command, not with the command line.
    from wakeful.server.sims.fleet import SIMULATORS

    if which == "all":
        return list(SIMULATORS)
    if which not in SIMULATORS:
        say("unknown_simulator", f"{which!r}: choose one of {', '.join(SIMULATORS)} or all")
        raise typer.Exit(2)
    return [which]


def _secret(path: Path | None) -> str:
    try:
        secret = path.read_text().strip() if path else os.environ.get(SECRET_ENV, "").strip()
    except OSError as exc:
        say("unreadable_secret", f"{path}: {exc.strerror}")
        raise typer.Exit(2) from None
    if not secret:
        say("no_webhook_secret", f"--webhook-url needs a secret: --webhook-secret-file PATH or {SECRET_ENV}")
        raise typer.Exit(2)
    return secret


def _target(url: str | None, secret_file: Path | None, names: list[str]) -> WebhookTarget | None:
    if url is None:
        return None
    if not url.startswith(("http://", "https://")):
        say("bad_webhook_url", f"{url!r} is not an http(s) URL")
        raise typer.Exit(2)
    if len(names) > 1 and "{sim}" not in url:
        say("bad_webhook_url", "several simulators need one source each: put {sim} in the URL, "
                               "e.g. http://127.0.0.1:8787/v1/hooks/{sim}")
        raise typer.Exit(2)
    from wakeful.server.sims.fleet import WebhookTarget

    return WebhookTarget(url=url, secret=_secret(secret_file))


def _until_signalled() -> None:
    """Block until SIGINT or SIGTERM; either ends the simulators cleanly."""
    stop = threading.Event()

    def handle(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def sim(which: Annotated[str, typer.Argument(help="merchant, airline, hotel, mail or all.")] = "all",
        port: Annotated[list[int] | None, typer.Option(help="Port for each simulator, in order (default: free).")]
        = None,
        tls: Annotated[bool, typer.Option("--tls", help="Serve HTTPS with a throwaway self-signed certificate.")]
        = False,
        cert_out: Annotated[Path | None, typer.Option(help="With --tls: write the certificate (not its key) here, "
                                                           "for a server's egress_upstream_ca.")] = None,
        webhook_url: Annotated[str | None, typer.Option(help="Where signed webhooks go ({sim}: the name).")] = None,
        webhook_secret_file: Annotated[Path | None, typer.Option(help=f"The signing secret [env {SECRET_ENV}].")]
        = None,
        flush_every: Annotated[float, typer.Option(help="Send pending webhooks every N seconds (0: only on "
                                                        "POST /_sim/webhooks/flush).", min=0)] = 0.5) -> None:
    """Run simulated services on 127.0.0.1 until interrupted (Ctrl-C or SIGTERM)."""
    from wakeful.server.sims import SimClock
    from wakeful.server.sims.fleet import certificate_of, running, self_signed_pem

    names = _names(which)
    target = _target(webhook_url, webhook_secret_file, names)
    if cert_out is not None and not tls:
        say("invalid_parameter", "--cert-out writes the certificate --tls serves with: give --tls too")
        raise typer.Exit(2)
    with tempfile.TemporaryDirectory(prefix="wakeful-sim-") as tmp, ExitStack() as stack:
        pem = self_signed_pem(Path(tmp)) if tls else None
        if pem is not None and cert_out is not None:
            try:
                cert_out.write_bytes(certificate_of(pem))
            except OSError as exc:
                say("cannot_write", f"cannot write {cert_out}: {exc.strerror}")
                raise typer.Exit(2) from None
        try:
            fleet = stack.enter_context(running(names, clock=SimClock(), ports=port or [], tls=pem, webhooks=target,
                                                flush_every=flush_every or None))
        except RuntimeError as exc:  # uvicorn could not bind: the usual cause is a port already taken
            say("not_started", f"{exc} (is one of the ports {port} in use?)" if port else str(exc))
            raise typer.Exit(2) from None
        for name, started in fleet.items():
            typer.echo(f"{name} {started.url}")
            for control in CONTROLS:
                typer.echo(f"  {started.url}/_sim/{control}")
        if target is not None:
            typer.echo(f"webhooks -> {target.url}")
        if cert_out is not None:
            typer.echo(f"certificate {cert_out}", err=True)
        typer.echo("ready (Ctrl-C to stop)", err=True)
        _until_signalled()
    typer.echo("stopped", err=True)
