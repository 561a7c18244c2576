"""Domain XML for one tool computer, built with ElementTree from a `DomainSpec` (no string templates).

Security-relevant choices, all checked by unit tests that parse the XML back:

* networking is QEMU user-mode (slirp) through `<qemu:commandline>` with `restrict=on`: the guest reaches nothing
  but the egress proxy's guest forward; host forwards bind 127.0.0.1 only. Never libvirt's NAT bridge. On
  production hosts a VM may instead join an isolated libvirt network (`DomainSpec.bridge`): a virtio interface
  with a fixed MAC on a tap of a fixed name (`tap_name`), and libvirt's `clean-traffic` filter pinning its reserved
  address. The filter is not a `<filterref>` on the interface: libvirt would tear it down at every stop and build it
  again at every start, 127 ebtables/iptables runs, ~1.4 s of each restore (measured). It is a libvirt filter
  binding on the tap's name instead, made from `<metadata>` (`FilterBinding`) while the VM is still paused and kept
  from one start to the next (see `vm.libvirt_adapter`): the same rules, built once per VM.
* the proxy guest forward uses the per-connection `cmd:` form. The `tcp:` chardev form is a single stream opened
  when QEMU starts: the first request goes through and every later connection hangs (measured on QEMU 7.2).
  With a proxy credential the command is a small relay that inserts `Proxy-Authorization` after the first request
  line (see `proxy_connector`): Chromium cannot send it unprompted, and the guest never holds the credential.
* a named CPU model with `fallback='forbid'`, so a saved state restores on any host offering that model.
* QEMU's seccomp sandbox is kept, with spawn and setsid allowed for that connector (see `SANDBOX`).
* a free-page-reporting balloon and `init_on_free=1` keep RAM and save files small; under TCG, `<tcg><tb-cache>`
  bounds the translated code QEMU holds (large enough for Chromium, see `VmSettings.tb_cache_mib`).
"""

from __future__ import annotations

import hashlib
import shlex
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass

from wakeful.vm.hypervisor import Accel, DomainSpec, ProxyCredential
from wakeful.vm.keeper import KEEPER_GUEST_PORT

__all__ = ["ANTI_SPOOFING", "GUEST_ADDRESS", "GUEST_PORTS", "GUEST_PROXY", "QEMU_NS", "RELAY", "WAKEFUL_NS",
           "FilterBinding", "domain_xml",
           "filter_binding_of", "netdev_arg", "proxy_connector", "tap_name"]

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
WAKEFUL_NS = "https://wakeful.invalid/vm/1"
"""The namespace of wakeful's own element in a domain's `<metadata>`."""
GUEST_PROXY = ("10.0.2.100", 3128)
"""Where the guest finds the egress proxy."""
SANDBOX = "on,obsolete=deny,elevateprivileges=allow,spawn=allow,resourcecontrol=deny"
"""QEMU's seccomp filter as libvirt would set it, except `spawn` and `elevateprivileges`: slirp forks the proxy
connector per connection and calls setsid() in the child (measured: SIGSYS on syscall 112 otherwise).
libvirt's own sandbox must be off (`seccomp_sandbox = 0` in qemu.conf, see scripts/libvirtd): filters stack."""
GUEST_PORTS = {"ssh": 22, "cdp": 9222, "vnc": 5900, "keeper": KEEPER_GUEST_PORT}
GUEST_ADDRESS = "10.0.2.15"
"""The guest's own address under user-mode networking (slirp's default): where the clock keeper's side door listens,
which nothing but the domain's host forwards reaches (`restrict=on`)."""
ANTI_SPOOFING = "clean-traffic"
"""libvirt's stock filter on a VM's interface on an isolated network: no MAC, IP or ARP spoofing, so the address
the egress proxy knows the VM by is really the VM's."""

ET.register_namespace("qemu", QEMU_NS)
ET.register_namespace("wakeful", WAKEFUL_NS)


def tap_name(domain: str) -> str:
    """The fixed name of a domain's tap on an isolated network: `wk` and 12 hex digits of a hash of its name (an
    interface name has at most 15 characters; libvirt renames only `vnet…`/`macvtap…` ones). The anti-spoofing
    binding is keyed on it, so it must be the same at every start."""
    return "wk" + hashlib.sha256(domain.encode()).hexdigest()[:12]


@dataclass(frozen=True, kw_only=True)
class FilterBinding:
    """libvirt's anti-spoofing filter on one VM's tap, as a libvirt filter binding (`virsh nwfilter-binding-list`):
    what `<filterref>` would instantiate at each start, instantiated once and kept while the VM is defined."""

    portdev: str
    """The tap (`tap_name`)."""
    mac: str
    address: str
    """The only IPv4 address the VM may send from (the filter's `IP` parameter)."""
    filter: str = ANTI_SPOOFING

    def xml(self, *, owner: str, uuid: str) -> str:
        """The `<filterbinding>` libvirt's `nwfilterBindingCreateXML` takes."""
        root = ET.Element("filterbinding")
        who = _sub(root, "owner")
        _sub(who, "name", owner)
        _sub(who, "uuid", uuid)
        _sub(root, "portdev", name=self.portdev)
        _sub(root, "mac", address=self.mac)
        ref = _sub(root, "filterref", filter=self.filter)
        _sub(ref, "parameter", name="IP", value=self.address)
        return ET.tostring(root, encoding="unicode")

    @classmethod
    def parse(cls, xml: str) -> FilterBinding:
        """A binding as libvirt describes it (`nwfilterBinding.XMLDesc`)."""
        root = ET.fromstring(xml)
        ref = root.find("filterref")
        params = {p.get("name"): p.get("value", "") for p in root.iterfind("filterref/parameter")}
        return cls(portdev=_attr(root, "portdev", "name"),
                   mac=_attr(root, "mac", "address"), address=params.get("IP", ""),
                   filter="" if ref is None else ref.get("filter", ""))


def _attr(root: ET.Element, path: str, name: str) -> str:
    el = root.find(path)
    return "" if el is None else el.get(name, "")


def filter_binding_of(xml: str) -> FilterBinding | None:
    """The anti-spoofing binding a domain (its XML, as defined or as saved) must have before it runs, or None when
    it is not on an isolated network."""
    el = ET.fromstring(xml).find(f"metadata/{{{WAKEFUL_NS}}}antispoofing")
    if el is None:
        return None
    return FilterBinding(portdev=el.get("portdev", ""), mac=el.get("mac", ""), address=el.get("address", ""),
                         filter=el.get("filter", ""))


RELAY = (
    'exec 2>/dev/null; '
    '{ IFS= read -r line && printf "%s\\n" "$line" && printf "Proxy-Authorization: Basic %s\\r\\n" "$1" '
    '&& exec /bin/busybox dd bs=65536; } | { BRIDGE; kill 0; }'
)
"""The busybox sh relay, run on the host per guest connection with the Basic credential as `$1`. slirp gives it
the guest's socket as stdin/stdout/stderr, in a session of its own (libslirp calls setsid() in the child).

* `read -r` takes the request line byte by byte, so nothing after it is consumed; it keeps the line's `\r`, and
  `printf "%s\n"` puts back the `\n` that `read` removed: the line goes on byte for byte.
* then one header line, then the rest of the connection unchanged. `dd bs=65536`, not `cat`: busybox cat
  `sendfile`s from the socket into the pipe, and on this kernel the splice holds the pipe's lock while it waits
  for the guest, so the bridge can never read the two lines already in the pipe (measured: a deadlock).
* the response direction is the bridge writing straight to the guest's socket: not touched.
* `kill 0` when the bridge ends (the proxy closed, or could not be reached) ends the relay's whole process group,
  so no process keeps the guest's socket open and the guest sees the close at once.
* stderr goes to /dev/null: slirp wires it to the guest's socket."""


def proxy_connector(port: int, command: Sequence[str], credential: ProxyCredential | None = None) -> str:
    """The command slirp runs per guest connection to the proxy: `command` followed by 127.0.0.1 and the port,
    behind the identity relay (`RELAY`) when there is a credential. slirp splits it like a shell (GLib's
    `g_shell_parse_argv`) and runs it without one, so the relay is an explicit `busybox sh -c`."""
    bridge = shlex.join([*command, "127.0.0.1", str(port)])
    if credential is None:
        return bridge
    return shlex.join(["/bin/busybox", "sh", "-c", RELAY.replace("BRIDGE", bridge), "wk-proxy-relay",
                       credential.basic()])


def netdev_arg(spec: DomainSpec) -> str:
    """The `-netdev user,...` value. Every host forward binds 127.0.0.1; the keeper's leads to the guest's address
    only (its side door listens there, not on the guest's loopback)."""
    parts = ["user", "id=n0", "restrict=on"]
    fw = spec.forwards
    for key, host_port in (("ssh", fw.ssh), ("cdp", fw.cdp), ("vnc", fw.vnc), ("keeper", fw.keeper)):
        if host_port is not None:
            guest = GUEST_ADDRESS if key == "keeper" else ""
            parts.append(f"hostfwd=tcp:127.0.0.1:{host_port}-{guest}:{GUEST_PORTS[key]}")
    if fw.proxy is not None:
        addr, port = GUEST_PROXY
        connector = proxy_connector(fw.proxy, spec.proxy_command, spec.proxy_credential)
        parts.append(f"guestfwd=tcp:{addr}:{port}-cmd:{connector.replace(',', ',,')}")  # QEMU escapes ',' as ',,'
    return ",".join(parts)


def _cmdline(spec: DomainSpec) -> str:
    words = spec.cmdline.split()
    for required in ("console=ttyS0", "init_on_free=1"):
        if required not in words:
            words.append(required)
    return " ".join(words)


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrib: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrib)
    if text is not None:
        el.text = text
    return el


def domain_xml(spec: DomainSpec) -> str:
    dom = ET.Element("domain", {"type": "kvm" if spec.accel is Accel.KVM else "qemu"})
    _sub(dom, "name", spec.name)
    if spec.bridge is not None:
        binding = FilterBinding(portdev=tap_name(spec.name), mac=spec.bridge.mac, address=spec.bridge.address)
        _sub(_sub(dom, "metadata"), f"{{{WAKEFUL_NS}}}antispoofing", portdev=binding.portdev, mac=binding.mac,
             address=binding.address, filter=binding.filter)
    _sub(dom, "memory", str(spec.memory_mib), unit="MiB")
    _sub(dom, "currentMemory", str(spec.memory_mib), unit="MiB")
    _sub(dom, "vcpu", str(spec.vcpus), placement="static")

    os_el = _sub(dom, "os")
    _sub(os_el, "type", "hvm", arch="x86_64", machine=spec.machine)
    _sub(os_el, "kernel", str(spec.kernel))
    if spec.initrd is not None:
        _sub(os_el, "initrd", str(spec.initrd))
    _sub(os_el, "cmdline", _cmdline(spec))

    features = _sub(dom, "features")
    _sub(features, "acpi")
    if spec.accel is Accel.TCG:
        tcg = _sub(features, "tcg")
        _sub(tcg, "tb-cache", str(spec.tb_cache_mib), unit="MiB")

    cpu = _sub(dom, "cpu", mode="custom", match="exact", check="partial")
    _sub(cpu, "model", spec.cpu_model, fallback="forbid")
    _sub(dom, "clock", offset="utc")
    _sub(dom, "on_poweroff", "destroy")
    _sub(dom, "on_reboot", "restart")
    _sub(dom, "on_crash", "destroy")

    devices = _sub(dom, "devices")
    disk = _sub(devices, "disk", type="file", device="disk")
    _sub(disk, "driver", name="qemu", type="qcow2", discard="unmap")
    _sub(disk, "source", file=str(spec.disk))
    _sub(disk, "target", dev="vda", bus="virtio")
    if spec.seed is not None:
        seed = _sub(devices, "disk", type="file", device="disk")
        _sub(seed, "driver", name="qemu", type="raw")
        _sub(seed, "source", file=str(spec.seed))
        _sub(seed, "target", dev="vdb", bus="virtio")
        _sub(seed, "readonly")
    _sub(devices, "controller", type="usb", model="none")
    serial = _sub(devices, "serial", type="file")
    _sub(serial, "source", path=str(spec.serial_log), append="on")
    _sub(serial, "target", port="0")
    if spec.bridge is not None:
        nic = _sub(devices, "interface", type="network")
        _sub(nic, "source", network=spec.bridge.network)
        _sub(nic, "mac", address=spec.bridge.mac)
        _sub(nic, "target", dev=tap_name(spec.name))
        _sub(nic, "model", type="virtio")
    _sub(devices, "memballoon", model="virtio", freePageReporting="on")
    rng = _sub(devices, "rng", model="virtio")
    _sub(rng, "backend", "/dev/urandom", model="random")

    cmd = ET.SubElement(dom, f"{{{QEMU_NS}}}commandline")
    user_net = () if spec.bridge is not None else (
        "-netdev", netdev_arg(spec), "-device", "virtio-net-pci,netdev=n0,bus=pcie.0,addr=0x10")
    for value in (*user_net, "-sandbox", SANDBOX):
        ET.SubElement(cmd, f"{{{QEMU_NS}}}arg", {"value": value})
    ET.indent(dom)
    return ET.tostring(dom, encoding="unicode")
