"""The per-user VM manager: provisioning, the lifecycle, activity tracking, the idle reaper, rollback snapshots.

    manager = VmManager(settings, LibvirtHypervisor(), clock=clock)
    manager.add_after_restore_hook(lambda event: toolcomputer_for(event.vm).after_restore())
    manager.provision("alice")                     # overlay, keys, seed disk, ports, domain: provisioned
    with manager.activity("alice", "act") as vm:   # boots or restores on demand, then runs the hooks
        ...                                        # the VM is never suspended while this block runs
    manager.reap()                                 # suspends VMs idle for longer than settings.idle_after

Decisions (which transition is legal, what is idle, which ports) live in `vm.lifecycle_rules`; this module does
the I/O. Each VM has a lock; a transition is checked against the table and applied under it, so the reaper and an
activity never race. The methods block (libvirt, qemu-img); async callers wrap them in `asyncio.to_thread`.
Records persist as `<data_dir>/vms/<domain>/vm.json`; the state is re-derived from the hypervisor on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

from wakeful.proxy.clock import Clock, SystemClock
from wakeful.vm.disks import Disks, QemuImg
from wakeful.vm.domain_xml import GUEST_ADDRESS, GUEST_PROXY
from wakeful.vm.errors import IllegalTransition, ImageMissing, LimitExceeded, VmError, VmNotFound
from wakeful.vm.hypervisor import (
    Accel,
    BridgePlace,
    DomainSpec,
    DomainState,
    Forwards,
    Hypervisor,
    ProxyCredential,
    SnapshotInfo,
)
from wakeful.vm.keeper import KEEPER_GUEST_PORT, SideDoor
from wakeful.vm.keys import VmKeys, generate_keys, load_keys
from wakeful.vm.lifecycle_rules import (
    Activity,
    ActivityKind,
    Limits,
    Op,
    VmSize,
    VmState,
    check_limits,
    is_idle,
    next_state,
    pick_address,
    pick_ports,
    reap_candidates,
)
from wakeful.vm.seed import build_seed

__all__ = ["AfterRestore", "AfterRestoreHook", "BeforeSuspendHook", "VmInfo", "VmManager", "VmSettings"]

log = logging.getLogger("wakeful.vm")

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class VmSettings:
    data_dir: Path
    """VMs live in `<data_dir>/vms/<domain>/`: overlay, seed disk, keys, serial log, snapshots, vm.json."""
    base_image: Path
    """The shared read-only base qcow2 (from `wakeful image build`); never written."""
    kernel: Path
    initrd: Path | None
    cmdline: str = "root=/dev/vda rw console=ttyS0 net.ifnames=0"
    """The image's kernel command line; `init_on_free=1` is always added."""
    accel: Accel = Accel.TCG
    """Chosen by `vm.accel.choose_accel` at startup."""
    size: VmSize = field(default_factory=lambda: VmSize(memory_mib=1024, vcpus=2, disk_gib=8))
    """The size a VM gets when `provision` is not given one."""
    limits: Limits = field(default_factory=Limits)
    """Per-user ceilings on RAM, vCPUs and overlay virtual size."""
    port_range: tuple[int, int] = (20000, 29999)
    """Host ports (on 127.0.0.1) handed out for the SSH and side-door forwards."""
    proxy_port: int | None = None
    """The egress proxy's port on 127.0.0.1; the guest reaches it at 10.0.2.100:3128."""
    side_door: bool = True
    """A host port forwarded to the clock keeper's side door (`vm.keeper`): after a restore the first observation
    and the clock resync need no new SSH connection. (It took the place of a forward to guest port 9222, which led
    nowhere: Chromium's DevTools listen on the guest's loopback only.)"""
    idle_after: timedelta = timedelta(minutes=10)
    """A running VM with nothing in flight for longer than this is suspended by `reap`."""
    domain_prefix: str = "wk-"
    """Every domain this manager creates is named with this prefix (and only those are touched)."""
    cpu_model: str = "Westmere"
    tb_cache_mib: int = 512
    """Host memory (MiB) QEMU may hold per running VM for code it translated, under TCG only. Chromium does not fit
    in less: at 64 MiB QEMU threw the whole cache away every 1-2 s and a page took 107-164 s to load instead of
    14-29 s (`bench/tcg_cache.py`). QEMU's own default is 1 GiB."""
    proxy_command: tuple[str, ...] = ("/bin/busybox", "nc")
    network: str | None = None
    """An isolated libvirt network (see `Hypervisor.network`) VMs join instead of user-mode networking: each gets a
    reserved address there, the host reaches its SSH at that address, and no host port is forwarded."""
    network_proxy_port: int = 3128
    """On `network`: the port the egress proxy listens on at the network's host address."""
    address_book: Path | None = None
    """On `network`: where the manager keeps, for the egress proxy, which VM holds which address with its proxy
    credential (JSON, 0600, replaced atomically; `proxy.addressbook` reads it)."""


@dataclass(frozen=True, kw_only=True)
class VmInfo:
    user: str
    name: str
    """The libvirt domain name."""
    state: VmState
    directory: Path
    disk: Path
    """The VM's own overlay (the bottom of its writable chain; snapshots stack more layers on it)."""
    seed: Path
    serial_log: Path
    forwards: Forwards
    keys: VmKeys
    """`keys.host_public` is what the SSH layer pins; `keys.client_key` is what it logs in with."""
    size: VmSize
    proxy_credential: ProxyCredential | None = None
    """The identity the host inserts into the guest's connections to the egress proxy (never inside the guest);
    on an isolated network, the one the proxy gives connections from the VM's address."""
    bridge: BridgePlace | None = None
    """The VM's place on the isolated network, when it is on one."""

    @property
    def ssh_endpoint(self) -> tuple[str, int]:
        """Where the host reaches the guest's sshd: its address on the isolated network, else the 127.0.0.1 forward."""
        if self.bridge is not None:
            return self.bridge.address, 22
        assert self.forwards.ssh is not None, "a VM on user-mode networking always has its SSH forward"
        return "127.0.0.1", self.forwards.ssh

    @property
    def side_door(self) -> SideDoor | None:
        """Where the guest channel reaches the clock keeper without SSH: on user-mode networking, its forward to the
        guest's address; None on an isolated network, or for a VM provisioned before the side door."""
        if self.bridge is not None or self.forwards.keeper is None:
            return None
        return SideDoor(listen=(GUEST_ADDRESS, KEEPER_GUEST_PORT), host=("127.0.0.1", self.forwards.keeper))


@dataclass(frozen=True, kw_only=True)
class AfterRestore:
    """Passed to each hook whenever a VM has just come up: reconnect SSH/CDP, resync the clock, bump the epoch."""

    vm: VmInfo
    cold_boot: bool
    """True after a boot (nothing survived), False after a restore in place (processes and pages survived)."""


AfterRestoreHook = Callable[[AfterRestore], None]
BeforeSuspendHook = Callable[[VmInfo], None]
"""Runs on a running VM just before it is suspended: what the guest can shed so that less is saved and restored."""


@dataclass(eq=False)
class _Record:
    info: VmInfo
    activity: Activity = field(default_factory=Activity)
    lock: threading.RLock = field(default_factory=threading.RLock)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def domain_name(prefix: str, user: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", user.lower()).strip("-")[:32] or "user"
    return f"{prefix}{slug}-{hashlib.sha256(user.encode()).hexdigest()[:8]}"


def _new_mac(taken: set[str]) -> str:
    """A random MAC in QEMU's locally administered 52:54:00 block that no VM of this manager has."""
    while True:
        mac = "52:54:00:" + ":".join(f"{b:02x}" for b in secrets.token_bytes(3))
        if mac not in taken:
            return mac


_LABEL = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


class VmManager:
    def __init__(self, settings: VmSettings, hypervisor: Hypervisor, *, clock: Clock | None = None,
                 disks: Disks | None = None, port_free: Callable[[int], bool] = _port_free) -> None:
        # libvirt resolves paths from its own working directory: everything it is given is absolute.
        self.settings = settings = replace(
            settings, data_dir=settings.data_dir.resolve(), base_image=settings.base_image.resolve(),
            kernel=settings.kernel.resolve(), initrd=settings.initrd.resolve() if settings.initrd else None)
        self._hv = hypervisor
        self._clock: Clock = clock or SystemClock()
        self._disks = disks or QemuImg()
        self._port_free = port_free
        self._hooks: list[AfterRestoreHook] = []
        self._suspend_hooks: list[BeforeSuspendHook] = []
        self._records: dict[str, _Record] = {}
        self._lock = threading.Lock()
        self._book_lock = threading.Lock()
        self._load()

    # ------------------------------------------------------------------------------------------ records

    @property
    def _vms_dir(self) -> Path:
        return self.settings.data_dir / "vms"

    def _load(self) -> None:
        if not self._vms_dir.is_dir():
            return
        for meta in sorted(self._vms_dir.glob("*/vm.json")):
            data = json.loads(meta.read_text())
            directory = meta.parent
            info = VmInfo(
                user=data["user"], name=data["name"], state=VmState.PROVISIONED, directory=directory,
                disk=directory / "disk.qcow2", seed=directory / "seed.img", serial_log=directory / "serial.log",
                forwards=Forwards(**data["forwards"]), keys=load_keys(directory / "keys"),
                size=VmSize(**data["size"]),
                proxy_credential=ProxyCredential(**data["proxy_credential"]) if data.get("proxy_credential") else None,
                bridge=BridgePlace(**data["bridge"]) if data.get("bridge") else None)
            record = _Record(info=info)
            self._sync(record)
            self._records[info.user] = record
        self._write_address_book()

    def _write_address_book(self) -> None:
        """Which address on the isolated network speaks for which user, for the egress proxy: replaced whole and
        atomically (the proxy re-reads it when it changes). Holds the VMs' proxy credentials: 0600."""
        path = self.settings.address_book
        if path is None:
            return
        with self._book_lock:  # one writer at a time: a later snapshot is never overwritten by an earlier one
            with self._lock:
                book = {r.info.bridge.address: {"user_id": r.info.proxy_credential.user_id,
                                                "token": r.info.proxy_credential.token}
                        for r in self._records.values() if r.info.bridge and r.info.proxy_credential}
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            staging = path.with_name(f".{path.name}.{os.getpid()}")
            fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"version": 1, "addresses": book}, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            staging.replace(path)

    def _sync(self, record: _Record) -> None:
        """Take the state from the hypervisor: it is the truth about processes and saved states."""
        name = record.info.name
        try:
            state = self._hv.state(name)
            saved = self._hv.has_saved_state(name)
        except VmNotFound:
            state, saved = DomainState.SHUT_OFF, False
        if state in (DomainState.RUNNING, DomainState.PAUSED):
            vm_state = VmState.RUNNING
        else:
            vm_state = VmState.SUSPENDED if saved else VmState.PROVISIONED
        if vm_state is not record.info.state:
            record.info = replace(record.info, state=vm_state)

    def _record(self, user: str) -> _Record:
        with self._lock:
            record = self._records.get(user)
        if record is None:
            raise VmNotFound(f"{user} has no tool computer; provision one first")
        return record

    def _set(self, record: _Record, op: Op) -> None:
        record.info = replace(record.info, state=next_state(record.info.state, op, vm=record.info.name))

    def get(self, user: str) -> VmInfo:
        return self._record(user).info

    def vms(self) -> list[VmInfo]:
        with self._lock:
            return [r.info for r in self._records.values()]

    def add_after_restore_hook(self, hook: AfterRestoreHook) -> None:
        """`hook` runs, in registration order, each time a VM comes up (boot or restore), before the caller
        that asked for it continues. An exception propagates to that caller; the VM stays running."""
        self._hooks.append(hook)

    def add_before_suspend_hook(self, hook: BeforeSuspendHook) -> None:
        """`hook` runs, in registration order, on a running VM just before it is suspended. A hook that fails is
        logged and the suspend goes on: it only makes the saved state smaller."""
        self._suspend_hooks.append(hook)

    # ------------------------------------------------------------------------------------------ provisioning

    def _spec(self, info: VmInfo) -> DomainSpec:
        s = self.settings
        return DomainSpec(name=info.name, accel=s.accel, memory_mib=info.size.memory_mib, vcpus=info.size.vcpus,
                          kernel=s.kernel, initrd=s.initrd, cmdline=s.cmdline, disk=info.disk, seed=info.seed,
                          serial_log=info.serial_log, forwards=info.forwards, cpu_model=s.cpu_model,
                          tb_cache_mib=s.tb_cache_mib, proxy_command=s.proxy_command,
                          proxy_credential=info.proxy_credential, bridge=info.bridge)

    def provision(self, user: str, size: VmSize | None = None, *,
                  proxy_credential: ProxyCredential | None = None) -> VmInfo:
        """Create the user's VM: overlay on the base, keys, seed disk, ports, domain. It is left provisioned.
        `proxy_credential` (from `server.egress.issue_client_token`) is what the host presents to the egress proxy
        for this VM's connections; without it the guest's connections reach the proxy anonymous."""
        s = self.settings
        size = size or s.size
        name = domain_name(s.domain_prefix, user)
        check_limits(size, s.limits, vm=name)
        for what, path in (("base image", s.base_image), ("kernel", s.kernel), ("initrd", s.initrd)):
            if path is not None and not path.is_file():
                raise ImageMissing(f"the {what} {path} does not exist: build the image with `wakeful image build`",
                                   vm=name)
        base_size = self._disks.virtual_size(s.base_image)
        if base_size > size.disk_gib * GIB:
            raise LimitExceeded(f"the base image is {base_size / GIB:.1f} GiB, more than the {size.disk_gib} GiB "
                                "disk asked for", vm=name)
        network = self._hv.network(s.network) if s.network is not None else None
        with self._lock:
            if user in self._records:
                raise IllegalTransition(f"{user} already has a tool computer ({self._records[user].info.name})",
                                        vm=name)
            bridge: BridgePlace | None = None
            if network is None:
                used = {p for r in self._records.values() for p in r.info.forwards.host_ports()}
                ports = iter(pick_ports(1 + s.side_door, used=used, port_range=s.port_range,
                                        is_free=self._port_free))
                forwards = Forwards(ssh=next(ports), keeper=next(ports) if s.side_door else None, proxy=s.proxy_port)
                guest_proxy = "http://{}:{}".format(*GUEST_PROXY)
            else:
                places = [r.info.bridge for r in self._records.values() if r.info.bridge is not None]
                bridge = BridgePlace(network=network.name, mac=_new_mac({p.mac for p in places}), address=pick_address(
                    network.host, taken=network.reserved | network.leased | {p.address for p in places}))
                forwards = Forwards(ssh=None)
                guest_proxy = f"http://{network.host.ip}:{s.network_proxy_port}"
            directory = self._vms_dir / name
            info = VmInfo(user=user, name=name, state=VmState.PROVISIONED, directory=directory,
                          disk=directory / "disk.qcow2", seed=directory / "seed.img",
                          serial_log=directory / "serial.log", forwards=forwards,
                          keys=VmKeys(host_key=Path(), host_public="", client_key=Path(), client_public=""), size=size,
                          proxy_credential=proxy_credential, bridge=bridge)
            record = _Record(info=info)
            self._records[user] = record  # holds the ports (or the address) while we build
        reserved = False
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=False)
            keys = generate_keys(directory / "keys", name=name)
            build_seed(info.seed, keys=keys, hostname=name, proxy=guest_proxy)
            self._disks.create_overlay(info.disk, backing=s.base_image, size_bytes=size.disk_gib * GIB)
            (directory / "snapshots").mkdir(mode=0o700)
            record.info = info = replace(info, keys=keys)
            if bridge is not None:
                self._hv.reserve_address(bridge, host_name=name)
                reserved = True
            self._hv.define(self._spec(info))
            meta = {"user": user, "name": name, "size": vars(size), "forwards": vars(forwards),
                    "proxy_credential": vars(proxy_credential) if proxy_credential else None,
                    "bridge": vars(bridge) if bridge else None}
            fd = os.open(directory / "vm.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it may hold a token
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(meta, indent=2) + "\n")
        except BaseException:
            with self._lock:
                self._records.pop(user, None)
            try:
                if name in self._hv.names():
                    self._hv.undefine(name)
                if reserved and bridge is not None:
                    self._hv.release_address(bridge)
            except VmError:
                pass  # the original error is the one worth reporting
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self._write_address_book()
        return info

    # ------------------------------------------------------------------------------------------ lifecycle

    def _up(self, record: _Record, *, cold_boot: bool) -> VmInfo:
        record.activity = Activity(in_flight=record.activity.in_flight, last_ended=self._clock.now())
        event = AfterRestore(vm=record.info, cold_boot=cold_boot)
        for hook in self._hooks:
            hook(event)
        return record.info

    def _ensure_running_locked(self, record: _Record) -> VmInfo:
        self._sync(record)
        name = record.info.name
        if record.info.state is VmState.RUNNING:
            return record.info
        if record.info.state is VmState.SUSPENDED:
            self._set(record, Op.RESTORE)
            try:
                self._hv.restore(name)
            except VmError:
                self._sync(record)
                raise
            return self._up(record, cold_boot=False)
        if name not in self._hv.names():  # e.g. a fresh libvirtd: define again from the record
            self._hv.define(self._spec(record.info))
        self._set(record, Op.START)
        try:
            self._hv.start(name)
        except VmError:
            self._sync(record)
            raise
        return self._up(record, cold_boot=True)

    def ensure_running(self, user: str) -> VmInfo:
        """Boot a provisioned VM or restore a suspended one in place, then run the after-restore hooks."""
        record = self._record(user)
        with record.lock:
            return self._ensure_running_locked(record)

    def start(self, user: str) -> VmInfo:
        """Cold boot (only from provisioned)."""
        record = self._record(user)
        with record.lock:
            self._sync(record)
            next_state(record.info.state, Op.START, vm=record.info.name)
            return self._ensure_running_locked(record)

    def suspend(self, user: str) -> VmInfo:
        """Managed save: memory to disk, QEMU exits, RAM freed."""
        record = self._record(user)
        with record.lock:
            self._sync(record)
            next_state(record.info.state, Op.SUSPEND, vm=record.info.name)
            self._before_suspend(record)
            self._set(record, Op.SUSPEND)
            try:
                self._hv.suspend_to_disk(record.info.name)
            except VmError:
                self._sync(record)
                raise
            return record.info

    def _before_suspend(self, record: _Record) -> None:
        for hook in self._suspend_hooks:
            try:
                hook(record.info)
            except Exception:  # the suspend does not depend on it
                log.warning("a before-suspend hook failed for %s; suspending anyway", record.info.name, exc_info=True)

    def stop(self, user: str) -> VmInfo:
        """Hard stop; a saved state is discarded too. The next start is a cold boot."""
        record = self._record(user)
        with record.lock:
            self._sync(record)
            self._set(record, Op.STOP)
            self._hv.destroy(record.info.name)
            self._hv.discard_saved_state(record.info.name)
            return record.info

    def destroy(self, user: str) -> None:
        """Remove the domain, its saved state, snapshots, disk, seed, keys and logs."""
        record = self._record(user)
        with record.lock:
            self._sync(record)
            self._set(record, Op.DESTROY)
            try:
                self._hv.undefine(record.info.name)
            except VmNotFound:
                pass
            if record.info.bridge is not None:
                try:
                    self._hv.release_address(record.info.bridge)
                except VmError as exc:  # the VM is gone either way; a stale reservation only holds an address
                    log.warning("could not release %s on %s: %s", record.info.bridge.address,
                                record.info.bridge.network, exc.message)
            shutil.rmtree(record.info.directory, ignore_errors=True)
            with self._lock:
                self._records.pop(user, None)
        self._write_address_book()

    def memory_bytes(self, user: str) -> int:
        return self._hv.memory_bytes(self._record(user).info.name)

    # ------------------------------------------------------------------------------------------ activity

    @contextmanager
    def activity(self, user: str, kind: ActivityKind | str) -> Iterator[VmInfo]:
        """Mark an observe / act / handoff / live view in flight; the VM is running for the whole block."""
        ActivityKind(kind)  # refuse unknown kinds before doing anything
        record = self._record(user)
        with record.lock:
            info = self._ensure_running_locked(record)
            record.activity = record.activity.begin()
        try:
            yield info
        finally:
            with record.lock:
                record.activity = record.activity.end(self._clock.now())

    def reap(self) -> list[str]:
        """Suspend every running VM that is idle now; returns the users whose VMs were suspended.
        One VM failing to suspend does not spare the others: all are tried, then the first error is raised."""
        now = self._clock.now()
        with self._lock:
            records = list(self._records.values())
        candidates = set(reap_candidates({r.info.user: (r.info.state, r.activity) for r in records},
                                         now, self.settings.idle_after))
        suspended: list[str] = []
        errors: list[VmError] = []
        for record in records:
            if record.info.user not in candidates or not record.lock.acquire(blocking=False):
                continue  # an activity holds the lock: it is not idle
            try:
                if record.info.state is VmState.RUNNING and is_idle(record.activity, now, self.settings.idle_after):
                    self._before_suspend(record)
                    self._set(record, Op.SUSPEND)
                    self._hv.suspend_to_disk(record.info.name)
                    suspended.append(record.info.user)
            except VmError as exc:
                self._sync(record)
                errors.append(exc)
            finally:
                record.lock.release()
        if errors:
            raise errors[0]
        return suspended

    # ------------------------------------------------------------------------------------------ snapshots

    def snapshot(self, user: str, label: str) -> SnapshotInfo:
        """A disk snapshot for rollback (crash-consistent when running). Not while suspended."""
        if not _LABEL.fullmatch(label):
            raise VmError(f"a snapshot label is lowercase letters, digits, '-' and '_', not {label!r}")
        record = self._record(user)
        with record.lock:
            self._sync(record)
            if record.info.state is VmState.SUSPENDED:
                raise IllegalTransition("the VM is suspended: restore it (or stop it) before taking a snapshot",
                                        vm=record.info.name)
            overlay = record.info.directory / "snapshots" / f"{label}.qcow2"
            return self._hv.snapshot_create(record.info.name, label, overlay)

    def snapshots(self, user: str) -> list[SnapshotInfo]:
        return self._hv.snapshots(self._record(user).info.name)

    def revert(self, user: str, label: str) -> VmInfo:
        """Roll the disk back to the snapshot. The VM stops (its memory no longer matches); the next
        `ensure_running` boots it cold."""
        record = self._record(user)
        with record.lock:
            self._sync(record)
            self._hv.snapshot_revert(record.info.name, label)
            if record.info.state is not VmState.PROVISIONED:
                self._set(record, Op.STOP)
            return record.info

    def delete_snapshot(self, user: str, label: str) -> None:
        record = self._record(user)
        with record.lock:
            self._hv.snapshot_delete(record.info.name, label)
