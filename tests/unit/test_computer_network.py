"""`computer_network` and `proxy_bridge_listen`: settings that refuse what cannot work, and the check that the guests
will find the egress proxy where it listens (over the fake hypervisor; the libvirt side is in
tests/unit/vm/test_vm_hypervisors.py). Also `computer_tcg_cache`'s floor and
`computer_vcpus`'s range."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError

from wakeful.server.computers.pool import network_settings
from wakeful.server.errors import WakefulError
from wakeful.server.settings import Settings
from wakeful.vm.errors import NetworkUnusable
from wakeful.vm.fake import FakeHypervisor


@pytest.fixture
def hv() -> FakeHypervisor:
    fake = FakeHypervisor()
    fake.networks["wakeful"] = ipaddress.IPv4Interface("10.77.0.1/24")
    return fake


def test_a_network_without_a_proxy_listener_is_refused_with_an_example() -> None:
    with pytest.raises(ValidationError, match="computer_network needs proxy_bridge_listen.*10.77.0.1:3128"):
        Settings(computer_network="wakeful")


@pytest.mark.parametrize("value", ["10.77.0.1", "wakeful:3128", "10.77.0.1:0", "10.77.0.1:70000", "0.0.0.0:3128",
                                   "127.0.0.1:3128", "[fd00::1]:3128"])
def test_a_proxy_listener_must_be_one_specific_ipv4_address_and_port(value: str) -> None:
    with pytest.raises(ValidationError, match="proxy_bridge_listen"):
        Settings(proxy_bridge_listen=value)


def test_a_translation_cache_too_small_to_run_a_guest_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAKEFUL_COMPUTER_TCG_CACHE", "16")
    with pytest.raises(ValidationError, match="computer_tcg_cache"):
        Settings()
    monkeypatch.setenv("WAKEFUL_COMPUTER_TCG_CACHE", "1024")
    assert Settings().computer_tcg_cache == 1024


@pytest.mark.parametrize("value", ["0", "3", "two"])
def test_a_vcpu_count_outside_one_or_two_is_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("WAKEFUL_COMPUTER_VCPUS", value)
    with pytest.raises(ValidationError, match="computer_vcpus"):
        Settings()


def test_on_user_mode_networking_nothing_is_added(hv: FakeHypervisor) -> None:
    assert network_settings(Settings(), hv) == {}
    assert hv.calls == [], "libvirt is not even asked"


def test_the_vm_settings_name_the_network_the_proxy_port_and_the_address_book(hv: FakeHypervisor) -> None:
    settings = Settings(computer_network="wakeful", proxy_bridge_listen="10.77.0.1:3130")
    assert network_settings(settings, hv) == {"network": "wakeful", "network_proxy_port": 3130,
                                              "address_book": settings.data_dir / "proxy" / "address-book.json"}


def test_a_proxy_listening_elsewhere_than_the_networks_host_address_is_refused(hv: FakeHypervisor) -> None:
    settings = Settings(computer_network="wakeful", proxy_bridge_listen="10.78.0.1:3128")
    with pytest.raises(WakefulError, match="host's address on wakeful is 10.77.0.1") as err:
        network_settings(settings, hv)
    assert err.value.code == "network_unusable"


def test_a_network_without_the_proxy_is_refused(hv: FakeHypervisor) -> None:
    settings = Settings(computer_network="wakeful", proxy_bridge_listen="10.77.0.1:3128", proxy=False)
    with pytest.raises(WakefulError, match="needs the egress proxy"):
        network_settings(settings, hv)


def test_a_network_libvirt_does_not_have_is_named(hv: FakeHypervisor) -> None:
    settings = Settings(computer_network="elsewhere", proxy_bridge_listen="10.77.0.1:3128")
    with pytest.raises(NetworkUnusable, match="elsewhere"):
        network_settings(settings, hv)
