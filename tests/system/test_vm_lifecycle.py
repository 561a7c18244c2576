"""Real libvirt + QEMU (TCG here, KVM where it boots) with the tiny guest: the tool-computer lifecycle end to end.

Timings are printed (run with -s to see them), never asserted.
"""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
from vm_lab import Lab, Recorder, Serial

from wakeful.vm.errors import IllegalTransition
from wakeful.vm.hypervisor import ProxyCredential
from wakeful.vm.lifecycle_rules import VmState

pytestmark = pytest.mark.vm

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


def test_a_booted_guest_has_its_seed_reaches_only_the_proxy_and_listens_only_on_loopback(
        lab: Lab, proxy: Recorder, outside: Recorder) -> None:
    t = Timer()
    with t("provision"):
        vm = lab.manager.provision("alice")
    assert vm.state is VmState.PROVISIONED
    with t("start"):
        lab.manager.ensure_running("alice")
    serial = Serial(vm.serial_log)
    with t("boot to marker"):
        serial.wait_for(r"WK-MARKER up", timeout=90)
    t.report(f"boot ({vm.name})")

    seed = serial.wait_for(r"WK-SEED hostname=(\S+) files=([^\n]*)")
    assert seed[1] == vm.name
    assert set(seed[2].split()) >= {"ssh_host_ed25519_key", "ssh_host_ed25519_key.pub", "authorized_keys",
                                    "hostname"}
    assert [e.cold_boot for e in lab.events] == [True]
    # The pinned model (Westmere) offers what Debian's chromium needs (SSE3 = "pni", SSSE3, SSE4.x, POPCNT)
    # and nothing TCG or an older host lacks (no AVX).
    flags = set(serial.wait_for(r"WK-CPU ([^\n]*)")[1].split())
    assert flags == {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "cx16", "aes"}

    serial.wait_for(r"WK-NET-DONE", timeout=60)
    text = serial.text()
    # Two separate connections through the guest forward both reach the proxy (a per-connection forward).
    assert "WK-PROXY 1 HTTP/1.0 200 OK" in text and "hello-from-proxy" in text.split("WK-PROXY 2")[1]
    assert proxy.paths == ["/probe1", "/probe2"]
    # restrict=on: the host's own services are not reachable from the guest.
    assert "WK-EGRESS nc: can't connect" in text
    assert outside.paths == []

    # Host forwards reach the guest, and listen on 127.0.0.1 only.
    assert _http_get(vm.forwards.ssh).strip() == "WK-GUEST-HTTP"
    assert vm.forwards.cdp is not None and vm.forwards.vnc is not None
    assert _http_get(vm.forwards.cdp).strip() == "WK-GUEST-HTTP"
    for port in vm.forwards.host_ports():
        assert _listeners(port) == {"0100007F"}, f"port {port} listens beyond 127.0.0.1"
    print(f"\nRAM running: {lab.manager.memory_bytes('alice') / 2**20:.0f} MiB (256 MiB guest)")


def test_each_guest_connection_to_the_proxy_carries_the_vms_identity_once_right_after_the_request_line(
        lab: Lab, proxy: Recorder) -> None:
    credential = ProxyCredential(user_id="usr_erin", token="tok-erin-123")
    vm = lab.manager.provision("erin", proxy_credential=credential)
    lab.manager.ensure_running("erin")
    serial = Serial(vm.serial_log)
    serial.wait_for(r"WK-NET-DONE", timeout=90)
    assert "hello-from-proxy" in serial.text().split("WK-PROXY 2")[1], "the response came back through the relay"
    basic = f"Basic {credential.basic()}"
    # The guest sent `GET /probeN HTTP/1.0\r\n\r\n`: the request line arrives byte for byte (CR kept), and the
    # one header there is is the host's, inserted after it. Two connections, each with its own.
    assert proxy.heads == [(b"GET /probe1 HTTP/1.0\r\n", [("Proxy-Authorization", basic)]),
                           (b"GET /probe2 HTTP/1.0\r\n", [("Proxy-Authorization", basic)])]
    assert credential.token not in serial.text()


def test_suspend_frees_ram_and_restore_continues_the_same_process(lab: Lab) -> None:
    t = Timer()
    vm = lab.manager.provision("bob")
    lab.manager.ensure_running("bob")
    serial = Serial(vm.serial_log)
    serial.wait_for(r"WK-COUNTER n=3 ", timeout=90)
    running_ram = lab.manager.memory_bytes("bob")
    assert running_ram > 0 and _qemu_pid(vm.name) is not None

    with t("managed save"):
        lab.manager.suspend("bob")
    before = serial.last_count()
    assert lab.manager.get("bob").state is VmState.SUSPENDED
    assert lab.manager.memory_bytes("bob") == 0
    assert _qemu_pid(vm.name) is None, "a saved VM has no QEMU process"
    save_file = SAVE_DIR / f"{vm.name}.save"
    assert save_file.is_file()
    save_size = save_file.stat().st_size

    with t("restore"):
        lab.manager.ensure_running("bob")
    after = serial.next_count()
    assert (after.pid, after.boot) == (before.pid, before.boot), "restored in place, not rebooted"
    assert before.n < after.n <= before.n + 3
    assert [e.cold_boot for e in lab.events] == [True, False]
    assert not save_file.exists()

    # The reaper: an activity in flight keeps the VM up however long it lasts; once it ended and idle_after
    # passed, the VM is suspended. Driven by the fake clock, not by sleeping.
    with lab.manager.activity("bob", "observe"):
        lab.clock.advance(timedelta(hours=1))
        assert lab.manager.reap() == []
    lab.clock.advance(timedelta(minutes=4))
    assert lab.manager.reap() == []
    lab.clock.advance(timedelta(minutes=2))
    with t("reaper suspend"):
        assert lab.manager.reap() == ["bob"]
    assert lab.manager.get("bob").state is VmState.SUSPENDED and lab.manager.memory_bytes("bob") == 0
    with t("restore by activity"), lab.manager.activity("bob", "act") as up:
        assert up.state is VmState.RUNNING
    assert serial.next_count().pid == before.pid
    t.report("suspend/restore")
    print(f"\nRAM running {running_ram / 2**20:.0f} MiB, saved 0 MiB; save file {save_size / 2**20:.1f} MiB (lzop)")


def test_a_reverted_snapshot_brings_the_disk_back_and_boots_from_it(lab: Lab) -> None:
    t = Timer()
    vm = lab.manager.provision("carol")
    lab.manager.ensure_running("carol")
    serial = Serial(vm.serial_log)
    serial.wait_for(r"WK-COUNTER n=2 ", timeout=90)

    with t("snapshot"):
        snap = lab.manager.snapshot("carol", "before-pay")
    assert snap.frozen == vm.disk and snap.overlay.is_file()
    frozen_mark = _disk_mark(snap.frozen)
    assert frozen_mark.startswith("WK")
    serial.wait_for(rf"WK-COUNTER n={int(frozen_mark[2:]) + 3} ", timeout=30)
    deadline = time.monotonic() + 10  # the write follows the line; poll for it (bounded)
    while _disk_mark(snap.overlay) <= frozen_mark and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _disk_mark(snap.overlay) > frozen_mark, "the guest keeps writing into the snapshot's overlay"

    with t("revert"):
        lab.manager.revert("carol", "before-pay")
    assert lab.manager.get("carol").state is VmState.PROVISIONED
    assert lab.manager.memory_bytes("carol") == 0
    assert _disk_mark(snap.overlay) == frozen_mark
    mark = len(serial.text())
    lab.manager.ensure_running("carol")
    booted = serial.wait_for(r"WK-DISK-AT-BOOT (\S*)", after=mark, timeout=90)
    assert booted[1] == frozen_mark
    assert lab.events[-1].cold_boot

    with pytest.raises(IllegalTransition):
        lab.manager.start("carol")
    with t("snapshot delete"):
        lab.manager.delete_snapshot("carol", "before-pay")
    assert lab.manager.snapshots("carol") == []
    t.report("snapshots")


def test_destroy_removes_the_domain_its_disk_and_its_saved_state(lab: Lab) -> None:
    t = Timer()
    vm = lab.manager.provision("dave")
    lab.manager.ensure_running("dave")
    Serial(vm.serial_log).wait_for(r"WK-MARKER up", timeout=90)
    lab.manager.suspend("dave")
    assert (SAVE_DIR / f"{vm.name}.save").is_file()
    with t("destroy"):
        lab.manager.destroy("dave")
    assert vm.name not in lab.hypervisor.names()
    assert not vm.directory.exists()
    assert not (SAVE_DIR / f"{vm.name}.save").exists()
    assert lab.manager.vms() == []
    t.report("destroy (suspended VM)")
