"""`computer_hosts` and `computer_shared_dir`: the host registry in wakeful.toml, refused when it cannot work, and
the hypervisor the server builds from it (one libvirt connection, or a fleet over several)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from wakeful.server.computers.pool import hypervisor_for
from wakeful.server.settings import Settings, load_settings
from wakeful.vm.hosts import HostFleet
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.placement import HostMark, HostSpec

TOML = """\
computer_shared_dir = "{shared}"

[[computer_hosts]]
name = "kvm1"
uri = "qemu:///system"
memory_mib = 16384

[[computer_hosts]]
name = "kvm2"
uri = "qemu+ssh://root@kvm2/system"
memory_mib = 8192
max_restores = 1
mark = "full"
"""


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("WAKEFUL_"):
            monkeypatch.delenv(name)


def test_the_host_registry_in_wakeful_toml_becomes_a_fleet_on_the_shared_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    (tmp_path / "wakeful.toml").write_text(TOML.format(shared=shared))
    settings = load_settings(data_dir=tmp_path)
    fleet = hypervisor_for(settings, LibvirtHypervisor)
    assert isinstance(fleet, HostFleet)
    assert fleet.hosts() == [
        HostSpec(name="kvm1", uri="qemu:///system", memory_mib=16384, max_restores=2, mark=HostMark.UP),
        HostSpec(name="kvm2", uri="qemu+ssh://root@kvm2/system", memory_mib=8192, max_restores=1,
                 mark=HostMark.FULL)]
    assert (shared / "saved").is_dir()


def test_without_a_registry_tool_computers_run_on_libvirt_uri_alone(tmp_path: Path) -> None:
    hv = hypervisor_for(Settings(data_dir=tmp_path, libvirt_uri="test:///default"), LibvirtHypervisor)
    assert isinstance(hv, LibvirtHypervisor) and hv.uri == "test:///default"


def test_hosts_need_a_shared_directory_for_their_saved_state(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="computer_hosts needs computer_shared_dir"):
        Settings(data_dir=tmp_path, computer_hosts=[{"name": "a", "uri": "qemu:///system", "memory_mib": 4096}])


def test_two_hosts_with_one_name_are_refused(tmp_path: Path) -> None:
    host = {"name": "a", "uri": "qemu:///system", "memory_mib": 4096}
    with pytest.raises(ValidationError, match="computer_hosts names a twice"):
        Settings(data_dir=tmp_path, computer_shared_dir=tmp_path, computer_hosts=[host, host])


@pytest.mark.parametrize(("field", "value"), [("name", "Bad Name!"), ("memory_mib", 10), ("max_restores", 0),
                                              ("mark", "sleeping"), ("uri", "")])
def test_a_host_with_an_impossible_field_is_refused_naming_the_field(tmp_path: Path, field: str,
                                                                      value: object) -> None:
    host = {"name": "a", "uri": "qemu:///system", "memory_mib": 4096, field: value}
    with pytest.raises(ValidationError, match=f"computer_hosts.0.{field}"):
        Settings(data_dir=tmp_path, computer_shared_dir=tmp_path, computer_hosts=[host])


def test_the_example_in_the_infra_notes_is_a_registry_the_settings_accept(tmp_path: Path) -> None:
    notes = (Path(__file__).resolve().parents[2] / "infra" / "README.md").read_text()
    example = notes.split("## Several hosts", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "wakeful.toml").write_text(example)
    settings = load_settings(data_dir=tmp_path)
    assert [(h.name, h.mark) for h in settings.computer_hosts] == [("kvm1", "up"), ("kvm2", "full")]
    assert settings.computer_shared_dir == Path("/srv/wakeful-shared")
