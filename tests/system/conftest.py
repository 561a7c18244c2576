"""Fixtures for system tests on real libvirt + QEMU: the tiny guest, libvirtd, the accel mode, a VM manager.

Every domain these tests create is named `wkt-…` and destroyed by the fixture that created it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from tiny_guest import TinyGuest, build_tiny_guest
from vm_lab import Lab, Recorder, serve

from wakeful.proxy.clock import FakeClock
from wakeful.vm.accel import AccelChoice, choose_accel
from wakeful.vm.libvirt_adapter import LibvirtHypervisor
from wakeful.vm.lifecycle import AfterRestore, VmManager, VmSettings
from wakeful.vm.lifecycle_rules import VmSize

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "vm-tiny"
URI = "qemu:///system"


def _libvirt_answers() -> bool:
    try:
        return subprocess.run(["virsh", "-c", URI, "version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def libvirtd() -> None:
    if shutil.which("libvirtd") is None or shutil.which("qemu-system-x86_64") is None:
        pytest.skip("libvirt/QEMU are not installed: scripts/install --all")
    if not _libvirt_answers():
        if os.geteuid() != 0:
            pytest.skip("libvirtd is not running and starting it needs root: sudo scripts/libvirtd")
        subprocess.run([str(ROOT / "scripts" / "libvirtd")], check=True)


@pytest.fixture(scope="session")
def tiny_guest() -> TinyGuest:
    return build_tiny_guest(CACHE)


_CHOSEN: list[str] = []


@pytest.fixture(scope="session")
def accel(tiny_guest: TinyGuest) -> AccelChoice:
    choice = choose_accel(tiny_guest.kernel, data_dir=CACHE, timeout=10.0)
    print(f"\naccel mode: {choice.describe()}")
    _CHOSEN.append(choice.describe())
    return choice


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say in the run's own output which acceleration the guests ran under (KVM where it boots, else TCG)."""
    for described in dict.fromkeys(_CHOSEN):
        terminalreporter.write_line(f"system tests: guests ran under {described}")


@pytest.fixture(scope="module")
def proxy() -> Iterator[Recorder]:
    """Stands in for the egress proxy: the guest reaches it at 10.0.2.100:3128."""
    recorder = Recorder("proxy")
    server = serve(recorder)
    yield recorder
    server.shutdown()


@pytest.fixture(scope="module")
def outside() -> Iterator[Recorder]:
    """A host service the guest must NOT reach (through the slirp gateway 10.0.2.2)."""
    recorder = Recorder("outside")
    server = serve(recorder)
    yield recorder
    server.shutdown()


@pytest.fixture(scope="module")
def lab(libvirtd: None, tiny_guest: TinyGuest, accel: AccelChoice, proxy: Recorder, outside: Recorder,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """One VM manager (and fake clock) for a module: its guests outlive a test, so a module boots a guest once and
    its tests restore it (see test_vm_lifecycle.py)."""
    settings = VmSettings(
        data_dir=tmp_path_factory.mktemp("vms"), base_image=tiny_guest.base, kernel=tiny_guest.kernel,
        initrd=tiny_guest.initrd,
        cmdline=f"panic=-1 wkegress={outside.port}", accel=accel.accel,
        size=VmSize(memory_mib=256, vcpus=1, disk_gib=1), port_range=(24000, 24999), proxy_port=proxy.port,
        idle_after=timedelta(minutes=5), domain_prefix="wkt-")
    clock = FakeClock()
    hypervisor = LibvirtHypervisor(URI)
    manager = VmManager(settings, hypervisor, clock=clock)
    events: list[AfterRestore] = []
    manager.add_after_restore_hook(events.append)
    yield Lab(manager=manager, clock=clock, events=events, hypervisor=hypervisor)
    for vm in manager.vms():
        if vm.name.startswith("wkt-"):
            manager.destroy(vm.user)




# -- the real guest image (`wakeful image build`) -----------------------------------------------------------------
# Built once per test session, through the CLI as a subprocess, into `.cache/image-build/` at the repository root.
# The build cache there survives between sessions, so only the first session on a machine (or a CI run from a
# clean clone) pays for a cold build (about two minutes); later sessions reuse every stage in seconds.

IMAGE_BUILD = ROOT / ".cache" / "image-build"
WAKEFUL = Path(sys.executable).parent / "wakeful"
IMAGE_BUILD_TIMEOUT = 1800  # bounds a stuck mirror


@dataclass(frozen=True)
class ImageBuild:
    """One run of `wakeful image build`."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


def run_image_build(data_dir: Path, *args: str) -> ImageBuild:
    """`wakeful image build ARGS` with WAKEFUL_DATA_DIR=data_dir, as a user would run it."""
    env = {**os.environ, "WAKEFUL_DATA_DIR": str(data_dir), "COLUMNS": "200"}
    started = time.monotonic()
    proc = subprocess.run([str(WAKEFUL), "image", "build", *args], env=env, capture_output=True, text=True,
                          timeout=IMAGE_BUILD_TIMEOUT, check=False)
    return ImageBuild(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started)


def deployment_ca(data_dir: Path, out: Path) -> Path:
    """`wakeful proxy ca -o OUT` in `data_dir`: the deployment CA (created there on first use, its key sealed under
    `data_dir/vault.key`) that the image trusts and a proxy run with that key and CA directory intercepts with."""
    if not out.exists():
        env = {**os.environ, "WAKEFUL_DATA_DIR": str(data_dir)}
        subprocess.run([str(WAKEFUL), "proxy", "ca", "-o", str(out)], env=env, check=True, capture_output=True,
                       timeout=120)
    return out


@dataclass(frozen=True)
class GuestImageBuild:
    image_dir: Path
    data_dir: Path
    """The build's data directory; also the deployment whose CA (`proxy/`, key under `vault.key`) the image trusts."""
    ca_cert: Path
    first_build: ImageBuild


@pytest.fixture(scope="session")
def guest_image_build() -> GuestImageBuild:
    if os.geteuid() != 0:
        pytest.skip("building the guest image needs root")
    data_dir = IMAGE_BUILD / "data"
    ca = deployment_ca(data_dir, IMAGE_BUILD / "deployment-ca.pem")
    build = run_image_build(data_dir, "--ca-cert", str(ca))
    assert build.returncode == 0, f"wakeful image build failed:\n{build.stderr}\n{build.stdout}"
    return GuestImageBuild(image_dir=data_dir / "images" / "guest", data_dir=data_dir, ca_cert=ca, first_build=build)


@pytest.fixture(scope="session")
def guest_image(guest_image_build: GuestImageBuild) -> Path:
    """The built guest image directory: base.qcow2 (0444), vmlinuz, vmlinux, initrd.img, manifest.json.

    Boot the kernel (vmlinux: PVH, faster under TCG) with `kernel.cmdline` from manifest.json, base.qcow2 as vda
    behind a per-VM overlay, and a read-only ext4 seed disk labelled WKSEED holding ssh_host_ed25519_key(.pub),
    authorized_keys and hostname. Trusts the deployment CA of `.cache/image-build/data` (see `deployment_ca`)."""
    return guest_image_build.image_dir
