"""One tool computer on the real guest image, for system tests and `bench/tool_computer.py`: a VM manager on
libvirt, the user's VM (1 GiB) with its proxy credential, and the `ToolComputer` wired to it with an after-restore
hook.

    with tool_computer(image_dir, data_dir, user="shopper", proxy_port=p, credential=c) as lab:
        lab.boot()                                   # cold boot, then SSH and CDP (bounded waits)
        lab.computer.observe()
        lab.manager.suspend(lab.vm.user); lab.manager.ensure_running(lab.vm.user)
        lab.restores[-1]                             # the RestoreReport the hook got, with per-step timings
        lab.observe_on_restore = False               # the hook as the server's: no observation; `observe()` next

Every domain is named with `prefix` and destroyed on the way out. With `network` (from `isolated_network`, which
starts a libvirt network of its own and removes it afterwards) the VM joins it instead of user-mode networking.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from tests.system.second_libvirtd import running_network
from wakeful.proxy.clock import FakeClock
from wakeful.vm.accel import AccelChoice
from wakeful.vm.cdp_browser import CdpBrowser
from wakeful.vm.errors import VmError
from wakeful.vm.hypervisor import ProxyCredential
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.lifecycle import AfterRestore, VmInfo, VmManager, VmSettings
from wakeful.vm.lifecycle_rules import VmSize
from wakeful.vm.ssh_channel import GuestChannel
from wakeful.vm.toolcomputer import RestoreReport, ToolComputer

__all__ = ["SAVE_DIR", "ComputerLab", "Network", "isolated_network", "qemu_pid", "tool_computer"]

URI = "qemu:///system"
SAVE_DIR = Path("/var/lib/libvirt/qemu/save")
PID_DIR = Path("/run/libvirt/qemu")
BOOT_TIMEOUT = 600.0
"""Cold boot to CDP: 125–140 s measured under TCG on a shared 2-core host (185 s at CI with the old 64 MiB translation
cache); bounded well above that."""


def qemu_pid(name: str) -> int | None:
    pidfile = PID_DIR / f"{name}.pid"
    if not pidfile.exists():
        return None
    pid = int(pidfile.read_text().strip())
    return pid if Path(f"/proc/{pid}").exists() else None


@dataclass
class ComputerLab:
    manager: VmManager
    vm: VmInfo
    channel: GuestChannel
    browser: CdpBrowser
    computer: ToolComputer
    clock: FakeClock
    restores: list[RestoreReport] = field(default_factory=list)
    boot_steps: dict[str, float] = field(default_factory=dict)
    """Seconds from `ensure_running` to: SSH answering, CDP attached (cold boot only)."""
    observe_on_restore: bool = True
    """The after-restore hook takes the first observation itself (`after_restore(observe=True)`); False: it does
    what the server's does, and the clock resync goes on beside the caller's next `observe()`."""

    def boot(self, *, timeout: float = BOOT_TIMEOUT) -> None:
        """Cold boot, then wait (bounded) for SSH and for Chromium's DevTools; nothing is observed yet. A boot that
        does not get there fails with the end of the guest's serial console: where the guest stopped (the lab's
        directory, the log with it, is gone by the time anyone looks)."""
        start = time.perf_counter()
        self.manager.ensure_running(self.vm.user)
        booted = time.perf_counter() - start
        try:
            connected = self.computer.connect(wait=timeout)
        except VmError as exc:
            log = self.vm.serial_log
            tail = log.read_bytes()[-4000:].decode(errors="replace") if log.exists() else "(no serial log)"
            raise AssertionError(f"{exc.code} after {time.perf_counter() - start:.0f} s: {exc.message}; the guest's "
                                 f"serial console ended with:\n{tail}") from exc
        self.boot_steps["ssh"] = booted + connected.ssh
        self.boot_steps["cdp"] = booted + (connected.cdp or 0.0)

    def save_file(self) -> Path:
        return SAVE_DIR / f"{self.vm.name}.save"


@dataclass(frozen=True)
class Network:
    name: str
    host: str
    """The host's address on it (the egress proxy listens there)."""


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.78.N.0/24 no interface of this host is on (the documented 10.77.0.0/24 is left to real deployments)."""
    taken = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    for n in range(1 + uuid.uuid4().int % 200, 256):
        net = ipaddress.IPv4Network(f"10.78.{n}.0/24")
        if f" 10.78.{n}." not in taken:
            return net
    raise RuntimeError("no free 10.78.N.0/24 on this host")


@contextmanager
def isolated_network(prefix: str) -> Iterator[Network]:
    """The isolated network of infra/README.md (no `<forward>`: nothing leaves the host), under a name, bridge and
    subnet of this run's own, defined and started for the block, then stopped and undefined."""
    tag = uuid.uuid4().hex[:6]
    net = _free_subnet()
    host = str(net.network_address + 1)
    name = f"{prefix}net-{tag}"
    xml = (f"<network><name>{name}</name><bridge name='{prefix.rstrip('-')[:5]}{tag}' stp='off'/>"
           f"<ip address='{host}' netmask='{net.netmask}'><dhcp/></ip></network>")
    with running_network(URI, name, xml):
        yield Network(name=name, host=host)


def image_settings(image_dir: Path, data_dir: Path, *, accel: AccelChoice, proxy_port: int | None,
                   prefix: str, port_range: tuple[int, int], network: Network | None = None,
                   address_book: Path | None = None) -> VmSettings:
    manifest = json.loads((image_dir / "manifest.json").read_text())
    return VmSettings(data_dir=data_dir, base_image=image_dir / "base.qcow2", kernel=image_dir / "vmlinux",
                      initrd=image_dir / "initrd.img", cmdline=manifest["kernel"]["cmdline"], accel=accel.accel,
                      size=VmSize(memory_mib=1024, vcpus=2, disk_gib=8), port_range=port_range,
                      proxy_port=proxy_port, domain_prefix=prefix,
                      network=network.name if network else None, address_book=address_book)


@contextmanager
def tool_computer(image_dir: Path, data_dir: Path, *, user: str, accel: AccelChoice, proxy_port: int | None,
                  credential: ProxyCredential | None, prefix: str = "wkt-",
                  port_range: tuple[int, int] = (24500, 24999), tb_cache_mib: int | None = None,
                  network: Network | None = None, address_book: Path | None = None) -> Iterator[ComputerLab]:
    settings = image_settings(image_dir, data_dir, accel=accel, proxy_port=proxy_port, prefix=prefix,
                              port_range=port_range, network=network, address_book=address_book)
    if tb_cache_mib is not None:
        settings = replace(settings, tb_cache_mib=tb_cache_mib)
    clock = FakeClock()
    manager = VmManager(settings, LibvirtHypervisor(URI), clock=clock)
    vm = manager.provision(user, proxy_credential=credential)
    try:
        host, port = vm.ssh_endpoint
        channel = GuestChannel(host=host, port=port, user="root", client_key_path=vm.keys.client_key,
                               pinned_host_key=vm.keys.host_public, side_door=vm.side_door)
        # Chromium under TCG on a shared host: a first cross-site navigation takes 30-80 s here (a new renderer).
        browser = CdpBrowser(timeout=240.0, navigation_timeout=180.0)
        computer = ToolComputer(vm_id=vm.name, channel=channel, clock=clock, browser=browser,
                                reconnect_timeout=120.0)
        lab = ComputerLab(manager=manager, vm=vm, channel=channel, browser=browser, computer=computer, clock=clock)

        def after_restore(event: AfterRestore) -> None:
            if not event.cold_boot:  # a cold boot has no SSH for a minute yet: `boot()` waits for it instead
                lab.restores.append(computer.after_restore(observe=lab.observe_on_restore))

        manager.add_after_restore_hook(after_restore)
        manager.add_before_suspend_hook(lambda _vm: computer.before_suspend())
        try:
            yield lab
        finally:
            computer.close()
    finally:
        manager.destroy(user)
