"""`wakeful hosts …`: the tool-computer hosts of `computer_hosts`, and the operator's marks on them (infra/README.md,
"Several hosts"). A mark goes to `marks.json` in `computer_shared_dir`, which the running server reads again before
its next placement: a host is drained or brought back without a restart.

    list | mark NAME up|full|gone
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from wakeful.server.errors import NotFound, WakefulError
from wakeful.server.faces.cli_common import DataDir, DbUrl, Json, fail, print_json, settings_or_exit
from wakeful.server.settings import Settings
from wakeful.vm.hosts import MARKS_FILE, read_marks, write_mark
from wakeful.vm.placement import HostMark

__all__ = ["hosts_app"]

hosts_app = typer.Typer(help="The tool-computer hosts (computer_hosts) and their marks: list them, or mark one up, "
                             "full (takes no new computer) or gone (treated as unreachable) while the server runs.",
                        no_args_is_help=True, rich_markup_mode=None)


def _fleet_settings(data_dir: Path | None, database_url: str | None) -> tuple[Settings, Path]:
    settings = settings_or_exit(data_dir, database_url)
    if not settings.computer_hosts or settings.computer_shared_dir is None:
        fail(WakefulError("no_hosts", "computer_hosts is not set: tool computers run on libvirt_uri alone, and a "
                                      "host is marked only in a registry (docs/configuration.md)"))
    return settings, settings.computer_shared_dir


@hosts_app.command("list")
def list_cmd(data_dir: DataDir = None, database_url: DbUrl = None, as_json: Json = False) -> None:
    """Each host: its mark in effect (`marked` when `wakeful hosts mark` set it, else as the settings say), the
    memory tool computers may take there, its cap of restores in flight, and its libvirt URI."""
    settings = settings_or_exit(data_dir, database_url)
    if not settings.computer_hosts:  # nothing wrong: one host, which takes no marks
        if as_json:
            print_json({"hosts": [], "libvirt_uri": settings.libvirt_uri})
        else:
            typer.echo(f"no host registry (computer_hosts): tool computers run on {settings.libvirt_uri} alone")
        return
    settings, shared = _fleet_settings(data_dir, database_url)
    marked = _marks(shared)
    hosts = [{"name": h.name, "mark": str(marked.get(h.name, HostMark(h.mark))),
              "marked_by": "operator" if h.name in marked else "settings", "memory_mib": h.memory_mib,
              "max_restores": h.max_restores, "uri": h.uri} for h in settings.computer_hosts]
    if as_json:
        print_json({"hosts": hosts})
        return
    for h in hosts:
        typer.echo(f"{h['name']}: {h['mark']} ({'marked' if h['marked_by'] == 'operator' else 'as set'}), "
                   f"{h['memory_mib']} MiB, {h['max_restores']} restores at once, {h['uri']}")


@hosts_app.command("mark")
def mark_cmd(host: Annotated[str, typer.Argument(help="The host's name in computer_hosts.")],
             mark: Annotated[HostMark, typer.Argument(help="up: takes computers; full: takes no new one (its "
                                                           "running ones stay); gone: treated as unreachable.")],
             data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Mark a host; the server places computers by it from its next start or restore, and keeps it until the host
    is marked again (a restart too)."""
    settings, shared = _fleet_settings(data_dir, database_url)
    names = [h.name for h in settings.computer_hosts]
    if host not in names:
        fail(NotFound("unknown_host", f"no host named {host!r} in computer_hosts (there are: {', '.join(names)})"))
    _marks(shared)  # readable: the other hosts' marks are kept
    try:
        write_mark(shared, host, mark)
    except OSError as exc:
        fail(WakefulError("shared_dir_unusable", f"cannot write the marks in {shared}: {exc.strerror}"))
    typer.echo(f"{host}: {mark} (from the server's next placement)")


def _marks(shared: Path) -> dict[str, HostMark]:
    try:
        return read_marks(shared)
    except (OSError, ValueError, KeyError) as exc:
        fail(WakefulError("marks_unreadable", f"{shared / MARKS_FILE} cannot be read ({exc}): remove it, and mark "
                                              "the hosts again"))
