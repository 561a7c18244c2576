"""Domain XML: parsed back, the security- and cost-relevant parts are as promised."""

from __future__ import annotations

import base64
import shlex
import xml.etree.ElementTree as ET
from dataclasses import replace
from pathlib import Path

import pytest

from wakeful.vm.domain_xml import QEMU_NS, RELAY, SANDBOX, FilterBinding, domain_xml, filter_binding_of, tap_name
from wakeful.vm.hypervisor import Accel, BridgePlace, DomainSpec, Forwards, ProxyCredential


def _spec(accel: Accel = Accel.TCG, **forwards: int | None) -> DomainSpec:
    fw = {"ssh": 20000, "keeper": 20001, "vnc": 20002, "proxy": 3129} | forwards
    return DomainSpec(name="wk-alice", accel=accel, memory_mib=1024, vcpus=2, kernel=Path("/img/vmlinux"),
                      initrd=Path("/img/initrd.img"), cmdline="root=/dev/vda rw", disk=Path("/vms/a/disk.qcow2"),
                      seed=Path("/vms/a/seed.img"), serial_log=Path("/vms/a/serial.log"), forwards=Forwards(**fw))


def _qemu_args(root: ET.Element) -> list[str]:
    return [a.attrib["value"] for a in root.findall(f"{{{QEMU_NS}}}commandline/{{{QEMU_NS}}}arg")]


def _netdev(root: ET.Element) -> list[str]:
    args = _qemu_args(root)
    return args[args.index("-netdev") + 1].split(",")


def test_tcg_domain_is_type_qemu_with_a_translation_cache_of_the_specs_size() -> None:
    root = ET.fromstring(domain_xml(_spec()))
    assert root.get("type") == "qemu"
    cache = root.find("features/tcg/tb-cache")
    assert cache is not None and cache.text == "512" and cache.get("unit") == "MiB", "the default holds Chromium"
    cache = ET.fromstring(domain_xml(replace(_spec(), tb_cache_mib=384))).find("features/tcg/tb-cache")
    assert cache is not None and cache.text == "384"


def test_kvm_domain_is_type_kvm_without_tcg_settings() -> None:
    root = ET.fromstring(domain_xml(_spec(Accel.KVM)))
    assert root.get("type") == "kvm"
    assert root.find("features/tcg") is None


def test_cpu_model_is_pinned_and_never_falls_back() -> None:
    cpu = ET.fromstring(domain_xml(_spec())).find("cpu")
    assert cpu is not None and cpu.get("mode") == "custom"
    model = cpu.find("model")
    assert model is not None and model.text == "Westmere" and model.get("fallback") == "forbid"


def test_direct_kernel_boot_with_init_on_free_and_serial_console() -> None:
    root = ET.fromstring(domain_xml(_spec()))
    assert root.findtext("os/kernel") == "/img/vmlinux" and root.findtext("os/initrd") == "/img/initrd.img"
    assert root.find("os/type").get("machine") == "q35"  # type: ignore[union-attr]
    assert set(root.findtext("os/cmdline", "").split()) >= {"root=/dev/vda", "init_on_free=1", "console=ttyS0"}
    serial = root.find("devices/serial/source")
    assert serial is not None and serial.get("path") == "/vms/a/serial.log"


def test_limits_and_balloon_with_free_page_reporting() -> None:
    root = ET.fromstring(domain_xml(_spec()))
    assert root.findtext("memory") == "1024" and root.find("memory").get("unit") == "MiB"  # type: ignore[union-attr]
    assert root.findtext("vcpu") == "2"
    balloon = root.find("devices/memballoon")
    assert balloon is not None and balloon.get("model") == "virtio" and balloon.get("freePageReporting") == "on"


def test_overlay_is_vda_and_the_seed_is_a_read_only_vdb() -> None:
    disks = {d.find("target").get("dev"): d for d in ET.fromstring(domain_xml(_spec())).findall("devices/disk")}  # type: ignore[union-attr]
    assert disks["vda"].find("driver").get("type") == "qcow2"  # type: ignore[union-attr]
    assert disks["vda"].find("source").get("file") == "/vms/a/disk.qcow2"  # type: ignore[union-attr]
    assert disks["vda"].find("readonly") is None
    assert disks["vdb"].find("readonly") is not None
    assert disks["vdb"].find("source").get("file") == "/vms/a/seed.img"  # type: ignore[union-attr]


def test_network_is_restricted_user_mode_with_loopback_only_host_forwards() -> None:
    root = ET.fromstring(domain_xml(_spec()))
    assert root.find("devices/interface") is None, "no libvirt network (never the NAT bridge)"
    netdev = _netdev(root)
    assert netdev[:3] == ["user", "id=n0", "restrict=on"]
    hostfwds = sorted(p for p in netdev if p.startswith("hostfwd="))
    assert hostfwds == ["hostfwd=tcp:127.0.0.1:20000-:22", "hostfwd=tcp:127.0.0.1:20001-10.0.2.15:9444",
                        "hostfwd=tcp:127.0.0.1:20002-:5900"]
    guestfwds = [p for p in netdev if p.startswith("guestfwd=")]
    assert guestfwds == ["guestfwd=tcp:10.0.2.100:3128-cmd:/bin/busybox nc 127.0.0.1 3129"]


def test_absent_forwards_are_not_opened() -> None:
    netdev = _netdev(ET.fromstring(domain_xml(_spec(keeper=None, vnc=None, proxy=None))))
    assert [p for p in netdev if "fwd=" in p] == ["hostfwd=tcp:127.0.0.1:20000-:22"]


def test_the_clock_keepers_side_door_is_forwarded_from_the_hosts_loopback_to_the_guests_slirp_address_only() -> None:
    netdev = _netdev(ET.fromstring(domain_xml(_spec())))
    assert "hostfwd=tcp:127.0.0.1:20001-10.0.2.15:9444" in netdev
    # A VM provisioned before the side door keeps its forward to guest port 9222 (its saved domain binds it).
    old = _netdev(ET.fromstring(domain_xml(_spec(keeper=None, cdp=20005))))
    assert "hostfwd=tcp:127.0.0.1:20005-:9222" in old and not any("9444" in p for p in old)


def test_qemu_keeps_a_seccomp_sandbox() -> None:
    args = _qemu_args(ET.fromstring(domain_xml(_spec())))
    assert args[args.index("-sandbox") + 1] == SANDBOX
    assert "obsolete=deny" in SANDBOX and "resourcecontrol=deny" in SANDBOX


def _guestfwd_argv(root: ET.Element) -> list[str]:
    """The per-connection command as slirp will run it: QEMU's ',,' unescaped, then split like a shell."""
    (fwd,) = [p for p in ",".join(_netdev(root)).replace(",,", "\0").split(",") if p.startswith("guestfwd=")]
    prefix = "guestfwd=tcp:10.0.2.100:3128-cmd:"
    assert fwd.startswith(prefix)
    return shlex.split(fwd.removeprefix(prefix).replace("\0", ","))


def test_with_a_proxy_credential_the_guest_forward_runs_the_identity_relay_with_the_basic_credential() -> None:
    spec = replace(_spec(), proxy_credential=ProxyCredential(user_id="usr_1", token="t0k,en'x"))
    argv = _guestfwd_argv(ET.fromstring(domain_xml(spec)))
    assert argv[:3] == ["/bin/busybox", "sh", "-c"]
    assert argv[3] == RELAY.replace("BRIDGE", "/bin/busybox nc 127.0.0.1 3129")
    assert argv[4] == "wk-proxy-relay"
    assert base64.b64decode(argv[5], validate=True) == b"usr_1:t0k,en'x"
    assert len(argv) == 6


def test_the_credential_is_only_in_the_host_side_command_never_in_the_guest_kernel_command_line() -> None:
    spec = replace(_spec(), proxy_credential=ProxyCredential(user_id="usr_1", token="secret-token"))
    xml = domain_xml(spec)
    basic = spec.proxy_credential.basic()  # type: ignore[union-attr]
    assert xml.count(basic) == 1 and "secret-token" not in xml
    root = ET.fromstring(xml)
    assert basic not in (root.findtext("os/cmdline") or "")


def test_without_a_credential_the_guest_forward_is_the_plain_bridge() -> None:
    assert _guestfwd_argv(ET.fromstring(domain_xml(_spec()))) == ["/bin/busybox", "nc", "127.0.0.1", "3129"]


@pytest.mark.parametrize(("user_id", "token"), [("", "t"), ("a:b", "t"), ("u", ""), ("u", "t\n")])
def test_a_malformed_proxy_credential_is_refused(user_id: str, token: str) -> None:
    with pytest.raises(ValueError):
        ProxyCredential(user_id=user_id, token=token)


def test_on_an_isolated_network_the_vm_has_one_interface_on_its_fixed_tap_and_no_user_mode_networking() -> None:
    place = BridgePlace(network="wakeful", mac="52:54:00:ab:cd:ef", address="10.77.0.5")
    spec = replace(_spec(ssh=None, cdp=None, vnc=None, proxy=None), bridge=place)
    root = ET.fromstring(domain_xml(spec))
    (nic,) = root.findall("devices/interface")
    assert nic.get("type") == "network"
    assert [(e.tag, e.attrib) for e in nic] == [
        ("source", {"network": "wakeful"}), ("mac", {"address": "52:54:00:ab:cd:ef"}),
        ("target", {"dev": tap_name(spec.name)}), ("model", {"type": "virtio"})], (
        "no <filterref>: libvirt would tear it down and build it again at every stop and start")
    args = _qemu_args(root)
    assert "-netdev" not in args and not any("hostfwd" in a or "guestfwd" in a for a in args)
    assert args == ["-sandbox", SANDBOX], "the seccomp sandbox stays; nothing else is added"


def test_on_an_isolated_network_the_domain_names_its_anti_spoofing_binding_on_that_tap() -> None:
    place = BridgePlace(network="wakeful", mac="52:54:00:ab:cd:ef", address="10.77.0.5")
    spec = replace(_spec(ssh=None, cdp=None, vnc=None, proxy=None), bridge=place)
    assert filter_binding_of(domain_xml(spec)) == FilterBinding(
        portdev=tap_name(spec.name), mac="52:54:00:ab:cd:ef", address="10.77.0.5", filter="clean-traffic")
    assert filter_binding_of(domain_xml(_spec())) is None, "user-mode networking: nothing to bind"


def test_the_binding_libvirt_is_given_is_clean_traffic_on_the_tap_with_the_mac_and_the_only_address() -> None:
    binding = FilterBinding(portdev="wk0123456789ab", mac="52:54:00:ab:cd:ef", address="10.77.0.5")
    root = ET.fromstring(binding.xml(owner="wk-alice", uuid="6f1c0f5e-0000-4000-8000-000000000001"))
    assert root.tag == "filterbinding"
    assert (root.findtext("owner/name"), root.findtext("owner/uuid")) == (
        "wk-alice", "6f1c0f5e-0000-4000-8000-000000000001")
    assert root.find("portdev").attrib == {"name": "wk0123456789ab"}  # type: ignore[union-attr]
    assert root.find("mac").attrib == {"address": "52:54:00:ab:cd:ef"}  # type: ignore[union-attr]
    assert root.find("filterref").attrib == {"filter": "clean-traffic"}  # type: ignore[union-attr]
    assert [p.attrib for p in root.findall("filterref/parameter")] == [{"name": "IP", "value": "10.77.0.5"}]
    assert FilterBinding.parse(ET.tostring(root, encoding="unicode")) == binding
    assert FilterBinding.parse(binding.xml(owner="x", uuid="u").replace("10.77.0.5", "10.77.0.6")) != binding, (
        "a binding that names another address is not the one wanted: it is replaced")


def test_tap_names_are_fixed_per_domain_short_enough_and_never_one_libvirt_would_rename() -> None:
    names = {tap_name(f"wk-user{i}") for i in range(200)}
    assert len(names) == 200 and tap_name("wk-user1") == tap_name("wk-user1")
    assert all(len(n) <= 15 and n.startswith("wk") and not n.startswith(("vnet", "macvtap", "vif")) for n in names)


def test_on_user_mode_networking_there_is_no_libvirt_interface() -> None:
    root = ET.fromstring(domain_xml(_spec()))
    assert root.findall("devices/interface") == []
