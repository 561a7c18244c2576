"""The libvirt adapter: the only module that imports `libvirt`.

What libvirt 9.0 does and does not do here (measured):

* managed save, start from it, pause/resume, destroy, undefine with managed-save and snapshot-metadata flags: native.
* external disk-only snapshots: `snapshotCreateXML(DISK_ONLY)` works on running and on shut-off domains, and
  deleting one merges its overlay down (block commit). It also "works" on a domain with a managed-save state and
  then restores memory against the wrong disk, so we refuse that.
* reverting to an external snapshot is "not supported yet" (it arrived in libvirt 9.9): we do it ourselves on the
  stopped domain — drop the layers above the frozen one, stack a fresh overlay with `qemu-img`, point the disk at it.
  That needs the files on this host, so revert works on local connections only.
* a `<filterref>` on an interface is torn down at every stop and built again at every start: for `clean-traffic`
  127 ebtables/iptables runs, ~1.4 s of every restore. A domain on an isolated network instead names
  its binding in `<metadata>` (`domain_xml.FilterBinding`): every start and restore here runs it paused, makes sure
  the binding exists on its tap as described (creates or replaces it: the tap exists now, so libvirt instantiates
  it), and only then resumes it. The rules match the tap by name, so a binding made once keeps filtering the tap
  libvirt creates again at each restore; `undefine` deletes it. After a host reboot there is none, and the next
  start makes it before the guest runs.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import threading
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import libvirt  # noqa: TID251 - the one module that talks to libvirt

from wakeful.vm.disks import Disks, QemuImg
from wakeful.vm.domain_xml import FilterBinding, domain_xml, filter_binding_of
from wakeful.vm.errors import (
    HypervisorUnavailable,
    IllegalTransition,
    ImageMissing,
    NetworkUnusable,
    SnapshotNotFound,
    VmDead,
    VmNotFound,
)
from wakeful.vm.hypervisor import BridgePlace, DomainSpec, DomainState, NetworkInfo, SnapshotInfo

__all__ = ["SYSTEM_SAVE_DIR", "LibvirtHypervisor"]

_STATES = {
    libvirt.VIR_DOMAIN_RUNNING: DomainState.RUNNING,
    libvirt.VIR_DOMAIN_BLOCKED: DomainState.RUNNING,
    libvirt.VIR_DOMAIN_PAUSED: DomainState.PAUSED,
    libvirt.VIR_DOMAIN_PMSUSPENDED: DomainState.PAUSED,
    libvirt.VIR_DOMAIN_SHUTDOWN: DomainState.RUNNING,  # shutting down: still has a process
    libvirt.VIR_DOMAIN_SHUTOFF: DomainState.SHUT_OFF,
    libvirt.VIR_DOMAIN_CRASHED: DomainState.CRASHED,
}


SYSTEM_SAVE_DIR = Path("/var/lib/libvirt/qemu/save")
"""Where libvirt's system QEMU driver keeps managed-save files."""


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()


def _ignore_libvirt_errors(_ctx: object, _err: object) -> None:
    """libvirt prints every error to stderr by default; ours are raised as exceptions instead."""


libvirt.registerErrorHandler(_ignore_libvirt_errors, None)


class LibvirtHypervisor:
    """`Hypervisor` on a libvirt connection (`qemu:///system`; `test:///default` in unit tests)."""

    def __init__(self, uri: str = "qemu:///system", *, disks: Disks | None = None,
                 save_dir: Path | None = None) -> None:
        """`save_dir`: where libvirt keeps managed-save files on this host (`<name>.save`); by default its own
        directory for `qemu:///system`, and none (nothing is done with the files) for any other connection."""
        self.uri = uri
        self._save_dir = save_dir if save_dir is not None else (SYSTEM_SAVE_DIR if uri == "qemu:///system" else None)
        self._disks = disks or QemuImg()
        self._conn: libvirt.virConnect | None = None
        self._lock = threading.Lock()
        self._test_driver = uri.startswith("test:")

    # ------------------------------------------------------------------------------------------ plumbing

    def _connection(self) -> libvirt.virConnect:
        with self._lock:
            if self._conn is None or not self._conn.isAlive():
                try:
                    self._conn = libvirt.open(self.uri)
                except libvirt.libvirtError as exc:
                    raise HypervisorUnavailable(
                        f"libvirt does not answer on {self.uri} ({exc.get_error_message()}); "
                        "start it with scripts/libvirtd") from None
            return self._conn

    @contextmanager
    def _calling(self, name: str, doing: str) -> Iterator[None]:
        try:
            yield
        except libvirt.libvirtError as exc:
            code, message = exc.get_error_code(), exc.get_error_message()
            if code == libvirt.VIR_ERR_NO_DOMAIN:
                raise VmNotFound(f"there is no VM named {name}", vm=name) from None
            if code == libvirt.VIR_ERR_NO_DOMAIN_SNAPSHOT:
                raise SnapshotNotFound(f"{name} has no such snapshot ({message})", vm=name) from None
            if exc.get_error_domain() == libvirt.VIR_FROM_NETWORK:  # its network is missing or down on this host
                raise NetworkUnusable(f"cannot {doing} {name}: {message}", vm=name) from None
            if code == libvirt.VIR_ERR_OPERATION_INVALID:
                raise IllegalTransition(f"cannot {doing} {name} now: {message}", vm=name) from None
            if code in (libvirt.VIR_ERR_SYSTEM_ERROR, libvirt.VIR_ERR_RPC, libvirt.VIR_ERR_NO_CONNECT):
                raise HypervisorUnavailable(f"libvirt failed to {doing} {name}: {message}", vm=name) from None
            raise VmDead(f"could not {doing} {name}: {message}", vm=name) from None

    def _dom(self, name: str) -> libvirt.virDomain:
        conn = self._connection()
        with self._calling(name, "find"):
            return conn.lookupByName(name)

    def _xml(self, name: str, dom: libvirt.virDomain, *, saved: bool = False) -> str:
        """The domain's definition, or with `saved` the one in its managed-save image (the test driver keeps none)."""
        with self._calling(name, "read the definition of"):
            if saved and not self._test_driver:
                return str(dom.managedSaveGetXMLDesc(0))
            return str(dom.XMLDesc(0))

    # ------------------------------------------------------------------------------------------ lifecycle

    def define(self, spec: DomainSpec) -> None:
        for what, path in (("kernel", spec.kernel), ("initrd", spec.initrd), ("disk", spec.disk),
                           ("seed disk", spec.seed)):
            if path is not None and not path.exists():
                raise ImageMissing(f"the {what} {path} does not exist", vm=spec.name)
        conn = self._connection()
        if spec.name in self.names() and self.state(spec.name) is not DomainState.SHUT_OFF:
            raise IllegalTransition(f"{spec.name} is running; stop it before redefining it", vm=spec.name)
        xml = domain_xml(spec)
        if self._test_driver:
            xml = xml.replace("<domain type=\"qemu\"", "<domain type=\"test\"", 1).replace(
                "<domain type=\"kvm\"", "<domain type=\"test\"", 1)
        with self._calling(spec.name, "define"):
            conn.defineXML(xml)

    def names(self) -> list[str]:
        conn = self._connection()
        with self._calling("*", "list"):
            return sorted(d.name() for d in conn.listAllDomains(0))

    def start(self, name: str) -> None:
        dom = self._dom(name)
        if self.has_saved_state(name):
            raise IllegalTransition(f"{name} has a saved state: restore it, or discard the state to boot cold", vm=name)
        self._filtered(name, self._xml(name, dom), "start", dom.createWithFlags, libvirt.VIR_DOMAIN_START_PAUSED,
                       give_up=dom.destroy)

    def restore(self, name: str) -> None:
        dom = self._dom(name)
        if not self.has_saved_state(name):
            raise IllegalTransition(f"{name} has no saved state to restore", vm=name)
        spare = self._second_name(name)
        try:
            # libvirt starts from the managed-save image when there is one, with the definition saved in it (the
            # binding is read from there); given up, the state is saved again
            self._filtered(name, self._xml(name, dom, saved=True), "restore", dom.createWithFlags,
                           libvirt.VIR_DOMAIN_START_PAUSED, give_up=lambda: dom.managedSave(0))
        finally:
            if spare is not None:
                threading.Thread(target=_unlink, args=(spare,), name=f"unlink-{name}", daemon=True).start()

    def _second_name(self, name: str) -> Path | None:
        """A second name (a hard link) for the managed-save file about to be restored, or None when it is not on
        this host. libvirt unlinks the file before its start call returns, and dropping the last name of a file of
        hundreds of MiB frees its cached pages and its blocks then and there: a few tenths of a second on the path
        to the first observation. With a second name its unlink only drops a name; the file goes when the second
        name is dropped, after the restore returned (a second name left by a crash goes at the next restore)."""
        if self._save_dir is None:
            return None
        spare = self._save_dir / f".{name}.save.restored"
        _unlink(spare)
        try:
            os.link(self._save_dir / f"{name}.save", spare)
        except OSError:
            return None
        return spare

    def suspend_to_disk(self, name: str) -> None:
        dom = self._dom(name)
        with self._calling(name, "suspend"):
            dom.managedSave(0)

    def discard_saved_state(self, name: str) -> None:
        dom = self._dom(name)
        with self._calling(name, "discard the saved state of"):
            if dom.hasManagedSaveImage(0):
                dom.managedSaveRemove(0)

    # ------------------------------------------------------------------------------------------ several hosts

    def save_to(self, name: str, path: Path) -> None:
        """Save memory to `path` (a file every host sees) and end the QEMU process; no managed-save state is left
        here, so any host's `restore_from` can take it."""
        dom = self._dom(name)
        with self._calling(name, "save"):
            dom.save(str(path))

    def restore_from(self, path: Path) -> str:
        """Start the domain saved in `path` on this host and return its name. The definition comes from the saved
        image itself (its UUID, disks, forwards and proxy credential), replacing a stopped local one of that name."""
        conn = self._connection()
        with self._calling(path.name, "read the saved state"):
            xml = conn.saveImageGetXMLDesc(str(path), 0)
        root = ET.fromstring(xml)
        name, uuid = root.findtext("name", ""), root.findtext("uuid", "")
        if name in self.names():
            dom = self._dom(name)
            with self._calling(name, "replace the definition of"):
                if dom.UUIDString() != uuid:
                    if dom.isActive():
                        raise IllegalTransition(f"{name} is running on {self.uri}: it cannot be restored there too",
                                                vm=name)
                    dom.undefineFlags(libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE
                                      | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA)
        with self._calling(name, "restore"):
            conn.defineXML(xml)
        self._filtered(name, xml, "restore", lambda flags: conn.restoreFlags(str(path), None, flags),
                       libvirt.VIR_DOMAIN_SAVE_PAUSED, give_up=lambda: self._dom(name).destroy())
        return name

    # ------------------------------------------------------------------------------------------ anti-spoofing

    def _filtered(self, name: str, xml: str, doing: str, start: Callable[[int], object], paused: int, *,
                  give_up: Callable[[], object]) -> None:
        """Start the domain with `start(flags)`. One on an isolated network starts paused (`paused` is the flag
        that says so), gets its anti-spoofing binding, and only then runs; when the binding cannot be made the
        guest never runs a single instruction: `give_up` stops it, and the error is raised."""
        binding = None if self._test_driver else filter_binding_of(xml)  # the test driver has no nwfilter
        with self._calling(name, doing):
            start(0 if binding is None else paused)
        if binding is None:
            return
        try:
            self._bind(name, binding)
        except BaseException:
            with contextlib.suppress(libvirt.libvirtError):
                give_up()
            raise
        with self._calling(name, doing):
            self._dom(name).resume()

    def _bind(self, name: str, want: FilterBinding) -> None:
        """Make sure libvirt holds `want` on its tap (which exists: the domain is paused), replacing a binding
        on that tap that says anything else."""
        conn = self._connection()
        with self._calling(name, "filter the network traffic of"):
            try:
                have = conn.nwfilterBindingLookupByPortDev(want.portdev)
            except libvirt.libvirtError as exc:
                if exc.get_error_code() != libvirt.VIR_ERR_NO_NWFILTER_BINDING:
                    raise
                have = None
            if have is not None:
                if FilterBinding.parse(have.XMLDesc(0)) == want:
                    return
                have.delete()
            conn.nwfilterBindingCreateXML(want.xml(owner=name, uuid=self._dom(name).UUIDString()), 0)

    def _unbind(self, name: str, xml: str) -> None:
        binding = None if self._test_driver else filter_binding_of(xml)
        if binding is None:
            return
        conn = self._connection()
        with self._calling(name, "remove the network filter of"):
            try:
                conn.nwfilterBindingLookupByPortDev(binding.portdev).delete()
            except libvirt.libvirtError as exc:
                if exc.get_error_code() != libvirt.VIR_ERR_NO_NWFILTER_BINDING:
                    raise

    def allocated_mib(self) -> int:
        """Memory of every domain running on this connection (ours and anyone else's), in MiB."""
        conn = self._connection()
        with self._calling("*", "list"):
            kib = sum(int(d.maxMemory()) for d in conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE))
        return kib // 1024

    def free_mib(self) -> int | None:
        """Free memory the host reports, in MiB."""
        conn = self._connection()
        with self._calling("*", "read the free memory of"):
            return int(conn.getFreeMemory()) // (1024 * 1024)

    def pause(self, name: str) -> None:
        dom = self._dom(name)
        with self._calling(name, "pause"):
            dom.suspend()

    def resume(self, name: str) -> None:
        dom = self._dom(name)
        with self._calling(name, "resume"):
            dom.resume()

    def destroy(self, name: str) -> None:
        dom = self._dom(name)
        with self._calling(name, "stop"):
            if dom.isActive():
                dom.destroy()

    def undefine(self, name: str) -> None:
        dom = self._dom(name)
        flags = libvirt.VIR_DOMAIN_UNDEFINE_MANAGED_SAVE | libvirt.VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA
        with self._calling(name, "remove"):
            xml = dom.XMLDesc(0)
            if dom.isActive():
                dom.destroy()
            dom.undefineFlags(flags)
        self._unbind(name, xml)

    def state(self, name: str) -> DomainState:
        dom = self._dom(name)
        with self._calling(name, "read the state of"):
            code = dom.state(0)[0]
        return _STATES.get(code, DomainState.OTHER)

    def has_saved_state(self, name: str) -> bool:
        dom = self._dom(name)
        with self._calling(name, "read the saved state of"):
            return bool(dom.hasManagedSaveImage(0))

    def memory_bytes(self, name: str) -> int:
        dom = self._dom(name)
        with self._calling(name, "read the memory of"):
            if not dom.isActive():
                return 0
            try:
                rss_kib = dom.memoryStats().get("rss")
            except libvirt.libvirtError:
                rss_kib = None
            if rss_kib is None:  # drivers without a process to measure (test:///) report the allocation
                rss_kib = dom.info()[2]
        return int(rss_kib) * 1024

    # ------------------------------------------------------------------------------------------ snapshots

    def _disk_source(self, dom: libvirt.virDomain, flags: int = 0) -> Path:
        root = ET.fromstring(dom.XMLDesc(flags))
        source = root.find("./devices/disk/target[@dev='vda']/../source")
        if source is None or "file" not in source.attrib:
            raise VmDead(f"{dom.name()} has no file-backed vda disk")
        return Path(source.attrib["file"])

    def _info(self, snap: libvirt.virDomainSnapshot) -> tuple[int, SnapshotInfo]:
        root = ET.fromstring(snap.getXMLDesc(0))
        created = int(root.findtext("creationTime", "0"))
        overlay = root.find("./disks/disk[@name='vda']/source")
        frozen = root.find("./domain/devices/disk/target[@dev='vda']/../source")
        if overlay is None or frozen is None:
            raise VmDead(f"snapshot {snap.getName()} is not an external disk snapshot of vda")
        return created, SnapshotInfo(name=snap.getName(), frozen=Path(frozen.attrib["file"]),
                                     overlay=Path(overlay.attrib["file"]))

    def snapshots(self, name: str) -> list[SnapshotInfo]:
        dom = self._dom(name)
        with self._calling(name, "list the snapshots of"):
            infos = [self._info(s) for s in dom.listAllSnapshots(0)]
        return [info for _, info in sorted(infos, key=lambda pair: (pair[0], pair[1].name))]

    def snapshot_create(self, name: str, snapshot: str, overlay: Path) -> SnapshotInfo:
        dom = self._dom(name)
        if self.has_saved_state(name):
            raise IllegalTransition(f"{name} is suspended: restore it before taking a snapshot", vm=name)
        if overlay.exists():
            raise IllegalTransition(f"{overlay} already exists", vm=name)
        if any(s.name == snapshot for s in self.snapshots(name)):
            raise IllegalTransition(f"{name} already has a snapshot named {snapshot}", vm=name)
        root = ET.Element("domainsnapshot")
        ET.SubElement(root, "name").text = snapshot
        ET.SubElement(root, "memory", snapshot="no")
        disks = ET.SubElement(root, "disks")
        vda = ET.SubElement(disks, "disk", name="vda", snapshot="external", type="file")
        ET.SubElement(vda, "driver", type="qcow2")
        ET.SubElement(vda, "source", file=str(overlay))
        for other in ET.fromstring(dom.XMLDesc(0)).findall("./devices/disk/target"):
            if other.get("dev") != "vda":
                ET.SubElement(disks, "disk", name=other.attrib["dev"], snapshot="no")
        flags = libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_DISK_ONLY  # the test:/// driver has only internal snapshots
        if dom.isActive():
            flags |= libvirt.VIR_DOMAIN_SNAPSHOT_CREATE_ATOMIC
        with self._calling(name, "snapshot"):
            snap = dom.snapshotCreateXML(ET.tostring(root, encoding="unicode"), flags)
            return self._info(snap)[1]

    def snapshot_revert(self, name: str, snapshot: str) -> None:
        dom = self._dom(name)
        chain = self.snapshots(name)
        index = next((i for i, s in enumerate(chain) if s.name == snapshot), None)
        if index is None:
            raise SnapshotNotFound(f"{name} has no snapshot named {snapshot}", vm=name)
        target = chain[index]
        with self._calling(name, "revert"):
            if dom.isActive():
                dom.destroy()
            if dom.hasManagedSaveImage(0):
                dom.managedSaveRemove(0)  # its memory belongs to a disk state that is about to vanish
            top = self._disk_source(dom, libvirt.VIR_DOMAIN_XML_INACTIVE)
            layers = self._disks.backing_chain(top)
            if target.frozen not in layers:
                raise VmDead(f"{target.frozen} is no longer in the disk chain of {name}", vm=name)
            for layer in layers[: layers.index(target.frozen)]:
                layer.unlink(missing_ok=True)
            for later in chain[index + 1:]:
                dom.snapshotLookupByName(later.name, 0).delete(libvirt.VIR_DOMAIN_SNAPSHOT_DELETE_METADATA_ONLY)
            self._disks.create_overlay(target.overlay, backing=target.frozen)
            root = ET.fromstring(dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
            source = root.find("./devices/disk/target[@dev='vda']/../source")
            if source is None:
                raise VmDead(f"{name} has no vda disk")
            source.set("file", str(target.overlay))
            vda = root.find("./devices/disk/target[@dev='vda']/..")
            if vda is not None:
                for stale in vda.findall("backingStore"):
                    vda.remove(stale)  # libvirt re-reads the chain from the new overlay
            self._connection().defineXML(ET.tostring(root, encoding="unicode"))

    def snapshot_delete(self, name: str, snapshot: str) -> None:
        dom = self._dom(name)
        if self.has_saved_state(name):
            raise IllegalTransition(f"{name} is suspended: restore it before deleting a snapshot", vm=name)
        with self._calling(name, "delete the snapshot of"):
            dom.snapshotLookupByName(snapshot, 0).delete(0)

    # ------------------------------------------------------------------------------------------ isolated network

    def _network(self, name: str) -> libvirt.virNetwork:
        conn = self._connection()
        try:
            return conn.networkLookupByName(name)
        except libvirt.libvirtError as exc:
            raise NetworkUnusable(f"libvirt has no network named {name} ({exc.get_error_message()}); define it as "
                                  "infra/README.md shows") from None

    def network(self, name: str) -> NetworkInfo:
        net = self._network(name)
        try:
            active, root = net.isActive(), ET.fromstring(net.XMLDesc(0))
        except libvirt.libvirtError as exc:
            raise NetworkUnusable(f"cannot read the network {name}: {exc.get_error_message()}") from None
        if not active:
            raise NetworkUnusable(f"the network {name} is not active: virsh net-start {name}")
        forward = root.find("forward")
        if forward is not None:
            raise NetworkUnusable(f"the network {name} forwards traffic (<forward mode='{forward.get('mode', 'nat')}'>)"
                                  ": tool computers need an isolated network, one without <forward>")
        for ip in root.findall("ip"):
            if ip.get("family", "ipv4") != "ipv4" or ip.get("address") is None:
                continue
            mask = ip.get("prefix") or ip.get("netmask") or "24"
            host = ipaddress.IPv4Interface(f"{ip.get('address')}/{mask}")
            reserved = frozenset(h.get("ip", "") for h in ip.findall("dhcp/host") if h.get("ip"))
            mac = root.find("mac")
            bridge_mac = mac.get("address", "").lower() or None if mac is not None else None
            return NetworkInfo(name=name, host=host, reserved=reserved, leased=self._leased(net),
                               bridge_mac=bridge_mac)
        raise NetworkUnusable(f"the network {name} has no IPv4 address for the host")

    @staticmethod
    def _leased(net: libvirt.virNetwork) -> frozenset[str]:
        """The IPv4 addresses the network's dnsmasq holds a lease on (none from a driver that cannot tell, like the
        test driver)."""
        try:
            leases = net.DHCPLeases()
        except libvirt.libvirtError as exc:
            if exc.get_error_code() == libvirt.VIR_ERR_NO_SUPPORT:
                return frozenset()
            raise NetworkUnusable(f"cannot read the DHCP leases of {net.name()}: {exc.get_error_message()}") from None
        return frozenset(str(lease["ipaddr"]) for lease in leases
                         if lease.get("type") == libvirt.VIR_IP_ADDR_TYPE_IPV4 and lease.get("ipaddr"))

    _UPDATE_FLAGS = libvirt.VIR_NETWORK_UPDATE_AFFECT_LIVE | libvirt.VIR_NETWORK_UPDATE_AFFECT_CONFIG

    def _update(self, place: BridgePlace, command: int, host_name: str | None, doing: str) -> None:
        entry = ET.Element("host", {"mac": place.mac, "ip": place.address})
        if host_name is not None:
            entry.set("name", host_name)
        try:
            self._network(place.network).update(command, libvirt.VIR_NETWORK_SECTION_IP_DHCP_HOST, -1,
                                                ET.tostring(entry, encoding="unicode"), self._UPDATE_FLAGS)
        except libvirt.libvirtError as exc:
            raise NetworkUnusable(f"could not {doing} {place.address} ({place.mac}) on {place.network}: "
                                  f"{exc.get_error_message()}") from None

    def reserve_address(self, place: BridgePlace, host_name: str) -> None:
        self._update(place, libvirt.VIR_NETWORK_UPDATE_COMMAND_ADD_LAST, host_name, "reserve")

    def release_address(self, place: BridgePlace) -> None:
        if place.address not in self.network(place.network).reserved:
            return
        self._update(place, libvirt.VIR_NETWORK_UPDATE_COMMAND_DELETE, None, "release")
