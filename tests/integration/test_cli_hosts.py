"""`wakeful hosts`, run as an operator runs it (the console script), on the host registry infra/README.md shows: the
commands the doc gives, in its order, and the fleet the server builds from the same settings placing by what they
marked. Refusals are one line with a stable code."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.integration.test_cli import run
from tests.support.docs import fenced, section
from tests.support.sshd import keygen
from wakeful.server.computers.pool import hypervisor_for
from wakeful.server.settings import load_settings
from wakeful.vm.hosts import HostFleet
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.placement import HostMark

NOTES = Path(__file__).resolve().parents[2] / "infra" / "README.md"


def several_hosts() -> str:
    """infra/README.md's "Several hosts" section."""
    return section(NOTES.read_text(), "## Several hosts")


def registry(data: Path) -> Path:
    """infra/README.md's registry in `data`'s wakeful.toml, its shared directory and the server's SSH key under
    `data` (the fleet reads the key as it is built)."""
    example = fenced(several_hosts(), "toml")
    shared, key = data / "shared", data / "hosts_ed25519"
    shared.mkdir(parents=True)
    keygen(key)
    (data / "wakeful.toml").write_text(example.replace('"/srv/wakeful-shared"', f'"{shared}"').replace(
        '"/etc/wakeful/hosts_ed25519"', f'"{key}"'))
    return shared


def doc_hosts_commands() -> list[list[str]]:
    lines = fenced(several_hosts(), "bash").splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.strip()]


def fleet_of(data: Path) -> HostFleet:
    fleet = hypervisor_for(load_settings(data_dir=data), LibvirtHypervisor)
    assert isinstance(fleet, HostFleet)
    return fleet


def test_the_docs_commands_list_the_hosts_and_mark_one_for_the_servers_fleet(tmp_path: Path) -> None:
    shared = registry(tmp_path)
    listed, marked = doc_hosts_commands()
    assert listed == ["hosts", "list"] and marked == ["hosts", "mark", "kvm2", "up"]
    assert [h.mark for h in fleet_of(tmp_path).hosts()] == [HostMark.UP, HostMark.FULL]  # as wakeful.toml says
    assert run(tmp_path, *listed).stdout.splitlines()[1].startswith("kvm2: full (as set), 30720 MiB")

    assert run(tmp_path, *marked).stdout.strip() == "kvm2: up (from the server's next placement)"

    assert [h.mark for h in fleet_of(tmp_path).hosts()] == [HostMark.UP, HostMark.UP]
    hosts = json.loads(run(tmp_path, "hosts", "list", "--json").stdout)["hosts"]
    assert [(h["name"], h["mark"], h["marked_by"]) for h in hosts] == [("kvm1", "up", "settings"),
                                                                        ("kvm2", "up", "operator")]
    assert json.loads((shared / "marks.json").read_text())["marks"] == {"kvm2": "up"}


@pytest.mark.parametrize(("args", "code"), [
    (["hosts", "mark", "kvm9", "full"], "wakeful: unknown_host: no host named 'kvm9' in computer_hosts"),
    (["hosts", "mark", "kvm2", "sideways"], "Invalid value for 'mark': Value error, 'sideways' is not one of"),
])
def test_a_mark_for_no_such_host_or_no_such_mark_is_refused_and_writes_nothing(
        tmp_path: Path, args: list[str], code: str) -> None:
    shared = registry(tmp_path)
    refused = run(tmp_path, *args, check=False)
    assert refused.returncode == 2 and code in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not (shared / "marks.json").exists()


def test_without_a_registry_there_is_no_host_to_mark_and_the_list_names_the_one_host(tmp_path: Path) -> None:
    refused = run(tmp_path, "hosts", "mark", "kvm1", "full", check=False)
    assert refused.returncode == 2 and "wakeful: no_hosts: computer_hosts is not set" in refused.stderr
    listed = run(tmp_path, "hosts", "list")
    assert listed.stdout == "no host registry (computer_hosts): tool computers run on qemu:///system alone\n"
    assert json.loads(run(tmp_path, "hosts", "list", "--json").stdout) == {"hosts": [],
                                                                          "libvirt_uri": "qemu:///system"}
