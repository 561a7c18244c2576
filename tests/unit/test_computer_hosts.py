"""`computer_hosts` and `computer_shared_dir`: the host registry in wakeful.toml, refused when it cannot work, and
the hypervisor the server builds from it (one libvirt connection, or a fleet over several)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.support.docs import fenced, section
from tests.support.sshd import keygen
from wakeful.server.computers.pool import default_link, guest_socket, host_tunnel, hypervisor_for
from wakeful.server.settings import ComputerHost, Settings, load_settings
from wakeful.vm.guest import BadKey
from wakeful.vm.host_tunnel import HostTunnel, NetworkForward
from wakeful.vm.hosts import Host, HostFleet
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
    example = fenced(section(notes, "## Several hosts"), "toml")
    (tmp_path / "wakeful.toml").write_text(example)
    settings = load_settings(data_dir=tmp_path)
    assert [(h.name, h.mark) for h in settings.computer_hosts] == [("kvm1", "up"), ("kvm2", "full")]
    assert settings.computer_shared_dir == Path("/srv/wakeful-shared")


HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGzv0lEQXm3B0d+xvXoMIP0u0V0kq4yq3ZK4v3m0LLxT root@kvm2"
REMOTE = {"name": "kvm2", "uri": "qemu+ssh://root@kvm2/system", "memory_mib": 8192, "ssh": "root@kvm2:2222",
          "ssh_host_key": HOST_KEY, "ssh_key": "/etc/wakeful/hosts_ed25519"}


def test_a_host_reached_over_ssh_keeps_its_target_pinned_key_and_client_key(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, computer_shared_dir=tmp_path, computer_hosts=[
        {"name": "kvm1", "uri": "qemu:///system", "memory_mib": 4096},
        {**REMOTE, "ssh_proxy_command": "ssh -W %h:%p jump"}])
    own, remote = settings.computer_hosts
    assert own.ssh is None and own.ssh_host_key is None
    assert (remote.ssh, remote.ssh_host_key, remote.ssh_key, remote.ssh_proxy_command) == (
        "root@kvm2:2222", HOST_KEY, Path("/etc/wakeful/hosts_ed25519"), "ssh -W %h:%p jump")


@pytest.mark.parametrize("missing", ["ssh_host_key", "ssh_key"])
def test_ssh_without_a_pinned_host_key_or_a_client_key_is_refused(tmp_path: Path, missing: str) -> None:
    host = {k: v for k, v in REMOTE.items() if k != missing}
    with pytest.raises(ValidationError, match="never trusted on first use"):
        Settings(data_dir=tmp_path, computer_shared_dir=tmp_path, computer_hosts=[host])


def test_ssh_keys_without_ssh_are_refused_rather_than_ignored(tmp_path: Path) -> None:
    host = {k: v for k, v in REMOTE.items() if k != "ssh"}
    with pytest.raises(ValidationError, match="ssh_host_key, ssh_key without ssh"):
        Settings(data_dir=tmp_path, computer_shared_dir=tmp_path, computer_hosts=[host])


@pytest.mark.parametrize(("field", "value"), [("ssh", "kvm2"), ("ssh", "root@kvm2:port"), ("ssh", "root@a b"),
                                              ("ssh_host_key", "AAAAC3Nza"), ("ssh_host_key", "ssh-dss AAAA"),
                                              ("ssh_host_key", "ssh-ed25519 not/base64!")])
def test_an_impossible_ssh_target_or_host_key_is_refused_naming_the_field(tmp_path: Path, field: str,
                                                                         value: str) -> None:
    with pytest.raises(ValidationError, match=f"computer_hosts.0.{field}"):
        Settings(data_dir=tmp_path, computer_shared_dir=tmp_path, computer_hosts=[{**REMOTE, field: value}])


def test_hosts_over_ssh_on_an_isolated_network_are_accepted_and_the_proxy_takes_them_on_its_relay_socket(
        tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, computer_shared_dir=tmp_path, computer_hosts=[REMOTE],
                        computer_network="wakeful", proxy_bridge_listen="10.77.0.1:3128")
    assert settings.proxy_relay_socket == tmp_path / "run" / "proxy-relay.sock"


def test_the_relay_socket_exists_only_for_hosts_over_ssh_on_an_isolated_network(tmp_path: Path) -> None:
    local = {"name": "kvm1", "uri": "qemu:///system", "memory_mib": 4096}
    assert Settings(data_dir=tmp_path, computer_shared_dir=tmp_path, computer_hosts=[local],
                    computer_network="wakeful", proxy_bridge_listen="10.77.0.1:3128").proxy_relay_socket is None
    assert Settings(data_dir=tmp_path, computer_shared_dir=tmp_path,
                    computer_hosts=[REMOTE]).proxy_relay_socket is None  # user-mode: the credential names the VM


def test_on_an_isolated_network_the_link_forwards_the_networks_address_to_the_relay_socket(tmp_path: Path) -> None:
    host_key = keygen(tmp_path / "host")
    keygen(tmp_path / "client")
    remote = {**REMOTE, "ssh_host_key": host_key, "ssh_key": str(tmp_path / "client")}
    settings = Settings(data_dir=tmp_path, computer_shared_dir=tmp_path / "shared", computer_hosts=[remote],
                        computer_network="wakeful", proxy_bridge_listen="10.77.0.1:3128")
    tunnel = default_link(settings)(settings.computer_hosts[0])
    assert isinstance(tunnel, HostTunnel) and not tunnel.connected()
    assert tunnel.network == NetworkForward(listen=("10.77.0.1", 3128), relay_socket=settings.proxy_relay_socket)
    assert tunnel.proxy is None, "no loopback forward: the guests there have no connector"


def test_only_hosts_with_ssh_get_a_link_and_it_carries_the_proxy_port(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, computer_shared_dir=tmp_path / "shared", proxy_port=8790, computer_hosts=[
        {"name": "kvm1", "uri": "qemu:///system", "memory_mib": 4096}, REMOTE])
    made: list[tuple[str, str | None]] = []

    class Link:
        def ensure(self) -> None: ...

        def open(self, address: tuple[str, int], *, timeout: float | None = None) -> object:
            return address

    def link(host: ComputerHost) -> Link:
        made.append((host.name, host.ssh))
        return Link()

    fleet = hypervisor_for(settings, LibvirtHypervisor, link)
    assert isinstance(fleet, HostFleet) and made == [("kvm2", "root@kvm2:2222")]


def test_the_default_link_is_an_unconnected_tunnel_to_the_target_with_the_pinned_key(tmp_path: Path) -> None:
    host_key = keygen(tmp_path / "host")
    host = ComputerHost.model_validate({**REMOTE, "ssh_host_key": host_key, "ssh_key": str(tmp_path / "client")})
    keygen(tmp_path / "client")
    tunnel = host_tunnel(host, proxy=("127.0.0.1", 8790))
    assert isinstance(tunnel, HostTunnel) and not tunnel.connected()
    assert tunnel.proxy == ("127.0.0.1", 8790) and tunnel.network is None
    assert (tunnel.name, tunnel.ssh.user, tunnel.ssh.host, tunnel.ssh.port, tunnel.ssh.host_key) == (
        "kvm2", "root", "kvm2", 2222, host_key)


def test_an_unreadable_client_key_is_refused_when_the_tunnel_is_made(tmp_path: Path) -> None:
    host = ComputerHost.model_validate({**REMOTE, "ssh_host_key": keygen(tmp_path / "host"),
                                        "ssh_key": str(tmp_path / "nothing-here")})
    with pytest.raises(BadKey, match="cannot read the client key"):
        host_tunnel(host, proxy=None)


class OpenedLink:
    """A host link whose 'channels' are the addresses asked for."""

    def ensure(self) -> None: ...

    def open(self, address: tuple[str, int], *, timeout: float | None = None) -> object:
        return address


def test_a_computer_on_a_linked_hosts_isolated_network_is_reached_at_its_address_there_through_the_link(
        tmp_path: Path) -> None:
    from tests.support.fleet import manager_on
    from wakeful.vm.fake import FakeHypervisor

    images = tmp_path / "images"
    images.mkdir()
    for name in ("vmlinux", "initrd.img"):
        (images / name).write_bytes(b"\x7fELF")
    (images / "base.qcow2").write_text("fake qcow2 size=1073741824\n")
    b = FakeHypervisor()
    b.networks["wakeful"] = ipaddress.IPv4Interface("10.77.0.1/24")
    fleet = HostFleet([Host(spec=HostSpec(name="b", uri="fake://b", memory_mib=4096), hypervisor=b,
                            link=OpenedLink())], tmp_path / "shared")
    manager = manager_on(fleet, tmp_path / "shared", images, network="wakeful",
                         address_book=tmp_path / "address-book.json")
    vm = manager.provision("ann")
    manager.ensure_running("ann")
    sock = guest_socket(fleet, vm)
    assert vm.bridge is not None and sock is not None
    assert sock() == (vm.bridge.address, 22)
    assert guest_socket(None, vm) is None, "one host: the channel connects to the address itself"
