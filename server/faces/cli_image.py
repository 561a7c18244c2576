"""`wakeful image …`: build the tool computers' guest image (the build itself is `vm.image`)."""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from wakeful.server.faces.cli_common import DataDir, settings_or_exit
from wakeful.vm.image import DEFAULT_RECIPE, BuildOptions, ImageError, PrerequisitesMissing, Stage, build_image

__all__ = ["image_app"]

image_app = typer.Typer(rich_markup_mode=None, help="Guest images for tool computers.", no_args_is_help=True,
                        pretty_exceptions_enable=False)
err = Console(stderr=True, highlight=False)  # progress and stage lines; the result goes to stdout


class _RichReporter:
    """Stage lines that stay (one per stage: ran / reused, seconds, what it did) under a live progress bar."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task = progress.add_task("", total=len(Stage), stage="")

    def stage_started(self, stage: Stage, index: int, total: int, action: str) -> None:
        self.progress.update(self.task, stage=f"{stage.value} ({action})", description="")

    def stage_line(self, line: str) -> None:
        self.progress.update(self.task, description=escape(line.strip()[:60]))

    def stage_finished(self, stage: Stage, status: str, seconds: float, detail: str) -> None:
        mark = {"ran": "[green]ran[/green]   ", "reused": "[cyan]reused[/cyan]", "ok": "[green]ok[/green]    "}
        self.progress.console.print(f"  {stage.value:<13} {mark.get(status, status)} {seconds:6.1f}s  "
                                    f"{escape(detail)}", soft_wrap=True)
        self.progress.advance(self.task)

    def note(self, message: str) -> None:
        self.progress.console.print(f"  [yellow]note:[/yellow] {escape(message)}", soft_wrap=True)


@image_app.command()
def build(
    name: Annotated[str, typer.Option(help="Image name: the output goes to <data_dir>/images/<name>/.")] = "guest",
    ca_cert: Annotated[Path | None, typer.Option(
        "--ca-cert", help="PEM CA certificate to trust in the guest's system store and chromium's NSS db. "
                          "Default: this deployment's egress proxy CA (created if missing).")] = None,
    no_ca: Annotated[bool, typer.Option("--no-ca", help="Trust no deployment CA (HTTPS through the egress proxy "
                                                        "will then fail in the guest).")] = False,
    mirror: Annotated[str | None, typer.Option(
        help="Debian mirror URL. Default: the first URIs line of /etc/apt/sources.list.d/debian.sources.")] = None,
    recipe: Annotated[Path, typer.Option(help="Recipe folder.")] = DEFAULT_RECIPE,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Run every stage again (refreshes the cache).")] = False,
    data_dir: DataDir = None,
) -> None:
    """Build the guest image from Debian packages (needs root): debootstrap bookworm, install chromium, Xvfb,
    openbox, x11vnc, xdotool, openssh-server and the kernel, configure the units, add the CA, make the ext4
    filesystem and base.qcow2, and write <data_dir>/images/<name>/ (base.qcow2, vmlinuz, vmlinux, initrd.img,
    manifest.json). Each stage's output is cached under <data_dir>/images/.cache/ by a hash of its inputs, so a
    rebuild runs only the stages whose inputs changed. Prints the image checksum at the end."""
    settings = settings_or_exit(data_dir, None)
    if ca_cert is None and not no_ca:
        from wakeful.proxy.tls import CA_CERT_FILE, load_or_create_ca
        from wakeful.server.egress.proxyctl import vault_keys

        load_or_create_ca(settings.proxy_dir, vault_keys(settings))
        ca_cert = settings.proxy_dir / CA_CERT_FILE
    options = BuildOptions(data_dir=settings.data_dir, name=name, recipe_dir=recipe, mirror=mirror, ca_cert=ca_cert,
                           use_cache=not no_cache)
    progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.fields[stage]}"), BarColumn(bar_width=20),
                        MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("[dim]{task.description}"),
                        console=err, transient=True)
    err.print(f"Building image [bold]{escape(name)}[/bold] from {escape(str(recipe))}")
    # SIGTERM stops a build like Ctrl-C does: children stopped, temporary trees removed, output untouched.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with progress:
            result = build_image(options, _RichReporter(progress))
    except PrerequisitesMissing as exc:
        for problem in exc.problems:
            err.print(f"[red]wakeful: {problem.code}:[/red] {escape(problem.message)}", soft_wrap=True)
        raise typer.Exit(2) from None
    except ImageError as exc:
        err.print(f"[red]wakeful: {exc.code}:[/red] {escape(exc.message)}", soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print("[red]wakeful: interrupted:[/red] the build stopped; no output was changed")
        raise typer.Exit(130) from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if result.ran:
        err.print(f"Ran {len(result.ran)} stages ({', '.join(s.value for s in result.ran)}); "
                  f"reused {len(result.reused)} from the cache.")
    else:
        err.print(f"Nothing changed: reused all {len(result.reused)} stages from the cache.")
    typer.echo(f"image: {result.image_dir}")
    typer.echo(f"checksum: {result.checksum}")



def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt
