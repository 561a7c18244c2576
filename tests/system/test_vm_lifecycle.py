"""Real libvirt + QEMU (TCG here, KVM where it boots) with the tiny guest: the tool-computer lifecycle end to end.

The module boots one guest, once, and saves it (the product's managed save); each test restores it instead of
booting its own, and saves it again after. The only boots are the ones a test is about: that first boot, and the
one after a snapshot is reverted. Timings are printed (run with `-n 0 -s` to see them), never asserted.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from vm_lab import Lab, Recorder, Serial

from tests.support.polling import wait_until
from wakeful.vm.errors import IllegalTransition
from wakeful.vm.hypervisor import ProxyCredential
from wakeful.vm.lifecycle import VmInfo
from wakeful.vm.lifecycle_rules import VmState

pytestmark = pytest.mark.vm

USER = "alice"
CREDENTIAL = ProxyCredential(user_id="usr_alice", token="tok-alice-123")

SAVE_DIR = Path("/var/lib/libvirt/qemu/save")
PID_DIR = Path("/run/libvirt/qemu")


class Timer:
    def __init__(self) -> None:
        self.figures: dict[str, float] = {}

    def __call__(self, label: str) -> _Lap:
        return _Lap(self, label)

    def report(self, title: str) -> None:
        print(f"\n{title}: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.figures.items()))


class _Lap:
    def __init__(self, timer: Timer, label: str) -> None:
        self.timer, self.label = timer, label

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timer.figures[self.label] = time.perf_counter() - self.start


def _listeners(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def _qemu_pid(name: str) -> int | None:
    pidfile = PID_DIR / f"{name}.pid"
    if not pidfile.exists():
        return None
    pid = int(pidfile.read_text().strip())
    return pid if Path(f"/proc/{pid}").exists() else None


def _disk_mark(path: Path) -> str:
    """The counter the guest last wrote to its disk, read from the host through the qcow2 chain."""
    raw = path.with_suffix(".raw-peek")
    subprocess.run(["qemu-img", "convert", "-U", "-f", "qcow2", "-O", "raw", str(path), str(raw)], check=True)
    try:
        return raw.read_bytes()[:10].decode(errors="replace")
    finally:
        raw.unlink()


def _http_get(port: int) -> str:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


@dataclass(frozen=True)
class Booted:
    """The module's guest and what its one cold boot did."""

    vm: VmInfo
    serial: Serial
    proxy_heads: list[tuple[bytes, list[tuple[str, str]]]]
    """Each connection the guest's boot-time probes made to the proxy: request line and headers, as they came."""
    outside_paths: list[str]


@pytest.fixture(scope="module")
def booted(lab: Lab, proxy: Recorder, outside: Recorder) -> Booted:
    """Provision the guest (with a proxy identity), boot it cold to the end of its boot-time probes and the counter's
    third line, then save it: the tests restore this saved guest."""
    t = Timer()
    with t("provision"):
        vm = lab.manager.provision(USER, proxy_credential=CREDENTIAL)
    assert vm.state is VmState.PROVISIONED
    with t("start"):
        lab.manager.ensure_running(USER)
    serial = Serial(vm.serial_log)
    with t("boot to marker"):
        serial.wait_for(r"WK-MARKER up", timeout=90)
    serial.wait_for(r"WK-NET-DONE", timeout=60)
    serial.wait_for(r"WK-COUNTER n=3 ", timeout=60)
    with t("managed save"):
        lab.manager.suspend(USER)
    t.report(f"boot once, then save ({vm.name})")
    return Booted(vm=vm, serial=serial, proxy_heads=list(proxy.heads), outside_paths=list(outside.paths))


@pytest.fixture
def guest(lab: Lab, booted: Booted) -> Iterator[Booted]:
    """The saved guest, restored for this test (a running one is left as it is), and saved again after it."""
    lab.manager.ensure_running(USER)
    yield booted
    if any(vm.user == USER for vm in lab.manager.vms()) and lab.manager.get(USER).state is VmState.RUNNING:
        lab.manager.suspend(USER)


def test_a_booted_guest_has_its_seed_reaches_only_the_proxy_and_listens_only_on_loopback(
        lab: Lab, guest: Booted) -> None:
    vm, serial = guest.vm, guest.serial
    seed = serial.wait_for(r"WK-SEED hostname=(\S+) files=([^\n]*)")
    assert seed[1] == vm.name
    assert set(seed[2].split()) >= {"ssh_host_ed25519_key", "ssh_host_ed25519_key.pub", "authorized_keys",
                                    "hostname"}
    assert lab.events[0].cold_boot, "the guest came up the first time by booting"
    # The pinned model (Westmere) offers what Debian's chromium needs (SSE3 = "pni", SSSE3, SSE4.x, POPCNT)
    # and nothing TCG or an older host lacks (no AVX).
    flags = set(serial.wait_for(r"WK-CPU ([^\n]*)")[1].split())
    assert flags == {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "aes"}

    text = serial.text()
    # Two separate connections through the guest forward both reach the proxy (a per-connection forward).
    assert "WK-PROXY 1 HTTP/1.0 200 OK" in text and "hello-from-proxy" in text.split("WK-PROXY 2")[1]
    assert [line.split()[1] for line, _ in guest.proxy_heads] == [b"/probe1", b"/probe2"]
    # restrict=on: the host's own services are not reachable from the guest.
    assert "WK-EGRESS nc: can't connect" in text
    assert guest.outside_paths == []

    # Host forwards reach the guest, and listen on 127.0.0.1 only.
    assert _http_get(vm.forwards.ssh).strip() == "WK-GUEST-HTTP"
    assert vm.forwards.keeper is not None and vm.forwards.vnc is None and vm.forwards.cdp is None
    assert _http_get(vm.forwards.keeper).strip() == "WK-GUEST-HTTP"  # the clock keeper's side door
    for port in vm.forwards.host_ports():
        assert _listeners(port) == {"0100007F"}, f"port {port} listens beyond 127.0.0.1"
    print(f"\nRAM running: {lab.manager.memory_bytes(USER) / 2**20:.0f} MiB (256 MiB guest)")


def test_each_guest_connection_to_the_proxy_carries_the_vms_identity_once_right_after_the_request_line(
        booted: Booted) -> None:
    assert "hello-from-proxy" in booted.serial.text().split("WK-PROXY 2")[1], "the response came back through the relay"
    basic = f"Basic {CREDENTIAL.basic()}"
    # The guest sent `GET /probeN HTTP/1.0\r\n\r\n`: the request line arrives byte for byte (CR kept), and the
    # one header there is is the host's, inserted after it. Two connections, each with its own.
    assert booted.proxy_heads == [(b"GET /probe1 HTTP/1.0\r\n", [("Proxy-Authorization", basic)]),
                                  (b"GET /probe2 HTTP/1.0\r\n", [("Proxy-Authorization", basic)])]
    assert CREDENTIAL.token not in booted.serial.text()


def test_suspend_frees_ram_and_restore_continues_the_same_process(lab: Lab, guest: Booted) -> None:
    t = Timer()
    vm, serial = guest.vm, guest.serial
    serial.next_count()
    running_ram = lab.manager.memory_bytes(USER)
    assert running_ram > 0 and _qemu_pid(vm.name) is not None

    with t("managed save"):
        lab.manager.suspend(USER)
    before = serial.last_count()
    assert lab.manager.get(USER).state is VmState.SUSPENDED
    assert lab.manager.memory_bytes(USER) == 0
    assert _qemu_pid(vm.name) is None, "a saved VM has no QEMU process"
    save_file = SAVE_DIR / f"{vm.name}.save"
    assert save_file.is_file()
    save_size = save_file.stat().st_size

    ups = len(lab.events)
    with t("restore"):
        lab.manager.ensure_running(USER)
    after = serial.next_count()
    assert (after.pid, after.boot) == (before.pid, before.boot), "restored in place, not rebooted"
    assert before.n < after.n <= before.n + 3
    assert [e.cold_boot for e in lab.events[ups:]] == [False]
    assert not save_file.exists()

    # The reaper: an activity in flight keeps the VM up however long it lasts; once it ended and idle_after
    # passed, the VM is suspended. Driven by the fake clock, not by sleeping.
    with lab.manager.activity(USER, "observe"):
        lab.clock.advance(timedelta(hours=1))
        assert lab.manager.reap() == []
    lab.clock.advance(timedelta(minutes=4))
    assert lab.manager.reap() == []
    lab.clock.advance(timedelta(minutes=2))
    with t("reaper suspend"):
        assert lab.manager.reap() == [USER]
    assert lab.manager.get(USER).state is VmState.SUSPENDED and lab.manager.memory_bytes(USER) == 0
    with t("restore by activity"), lab.manager.activity(USER, "act") as up:
        assert up.state is VmState.RUNNING
    assert serial.next_count().pid == before.pid
    t.report("suspend/restore")
    print(f"\nRAM running {running_ram / 2**20:.0f} MiB, saved 0 MiB; save file {save_size / 2**20:.1f} MiB")


def test_a_reverted_snapshot_brings_the_disk_back_and_boots_from_it(lab: Lab, guest: Booted) -> None:
    t = Timer()
    vm, serial = guest.vm, guest.serial
    serial.next_count()

    with t("snapshot"):
        snap = lab.manager.snapshot(USER, "before-pay")
    assert snap.frozen == vm.disk and snap.overlay.is_file()
    frozen_mark = _disk_mark(snap.frozen)
    assert frozen_mark.startswith("WK")
    serial.wait_for(rf"WK-COUNTER n={int(frozen_mark[2:]) + 3} ", timeout=30)
    # the write follows the line
    wait_until(lambda: _disk_mark(snap.overlay) > frozen_mark, 10, "the guest to write into the snapshot's overlay",
               interval=0.1)

    with t("revert"):
        lab.manager.revert(USER, "before-pay")
    assert lab.manager.get(USER).state is VmState.PROVISIONED
    assert lab.manager.memory_bytes(USER) == 0
    assert _disk_mark(snap.overlay) == frozen_mark
    mark = len(serial.text())
    lab.manager.ensure_running(USER)
    booted = serial.wait_for(r"WK-DISK-AT-BOOT (\S*)", after=mark, timeout=90)
    assert booted[1] == frozen_mark
    assert lab.events[-1].cold_boot

    with pytest.raises(IllegalTransition):
        lab.manager.start(USER)
    with t("snapshot delete"):
        lab.manager.delete_snapshot(USER, "before-pay")
    assert lab.manager.snapshots(USER) == []
    t.report("snapshots")


def test_destroy_removes_the_domain_its_disk_and_its_saved_state(lab: Lab, guest: Booted) -> None:
    t = Timer()
    vm = guest.vm
    lab.manager.suspend(USER)
    assert (SAVE_DIR / f"{vm.name}.save").is_file()
    with t("destroy"):
        lab.manager.destroy(USER)
    assert vm.name not in lab.hypervisor.names()
    assert not vm.directory.exists()
    assert not (SAVE_DIR / f"{vm.name}.save").exists()
    assert lab.manager.vms() == []
    t.report("destroy (suspended VM)")
