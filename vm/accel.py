"""KVM or TCG: decided by booting a real kernel, not by the presence of /dev/kvm.

On PVM hosts (like the ones this project was measured on) /dev/kvm opens fine, libvirt reports kvm as available,
and a stock kernel never reaches userspace under it. So the probe boots the given kernel under `-accel kvm` with
no root device: a working KVM panics with "VFS: Cannot open root device" within seconds; otherwise we use TCG.
The answer is cached per (kernel, host) in the data directory; `force` skips the probe.

    python -m wakeful.vm.accel --kernel /path/to/vmlinux [--data-dir DIR] [--force kvm|tcg]
    python -m wakeful.vm.accel --cached-only            # print a cached answer for this host, if there is one
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from wakeful.vm.hypervisor import Accel

__all__ = ["AccelChoice", "choose_accel", "host_id", "kvm_boots", "kvm_device_usable"]

_BOOTED = ("VFS: Cannot open root device", "Kernel panic", "Unable to mount root fs")


@dataclass(frozen=True, kw_only=True)
class AccelChoice:
    accel: Accel
    reason: str
    cached: bool = False

    def describe(self) -> str:
        return f"{self.accel} ({self.reason}{', cached' if self.cached else ''})"


def kvm_device_usable(device: Path = Path("/dev/kvm")) -> bool:
    try:
        fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def kvm_boots(kernel: Path, *, timeout: float = 10.0, qemu: str = "qemu-system-x86_64") -> bool:
    """Boot `kernel` under KVM with no root device; True when it reaches the root-mount panic in time."""
    exe = shutil.which(qemu)
    if exe is None:
        return False
    with tempfile.TemporaryDirectory(prefix="wk-accel-") as tmp:
        log = Path(tmp) / "serial.log"
        cmd = [exe, "-accel", "kvm", "-cpu", "host", "-m", "256", "-nographic", "-nodefaults", "-no-reboot",
               "-monitor", "none", "-serial", f"file:{log}", "-kernel", str(kernel),
               "-append", "console=ttyS0 panic=-1 root=/dev/nonexistent"]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                text = log.read_text(errors="replace") if log.exists() else ""
                if any(marker in text for marker in _BOOTED):
                    return True
                if proc.poll() is not None and not any(marker in text for marker in _BOOTED):
                    return False  # QEMU refused KVM, or died before the kernel said anything useful
                time.sleep(0.1)
            return False
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def host_id() -> str:
    """What the answer depends on besides the kernel: this host's kernel, CPU and KVM module."""
    cpu = ""
    try:
        cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "")
    except OSError:
        pass
    modules = sorted(m.name for m in Path("/sys/module").glob("kvm*")) if Path("/sys/module").is_dir() else []
    return hashlib.sha256(f"{platform.node()}|{platform.release()}|{cpu}|{modules}".encode()).hexdigest()[:16]


def _kernel_id(kernel: Path) -> str:
    digest = hashlib.sha256()
    with kernel.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def _cache_file(data_dir: Path) -> Path:
    return data_dir / "accel.json"


def _read_cache(data_dir: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(_cache_file(data_dir).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def choose_accel(kernel: Path, *, data_dir: Path, force: Accel | str | None = None, timeout: float = 10.0,
                 device: Path = Path("/dev/kvm")) -> AccelChoice:
    if force is not None:
        return AccelChoice(accel=Accel(force), reason="forced by setting")
    if not kvm_device_usable(device):
        return AccelChoice(accel=Accel.TCG, reason=f"{device} cannot be opened")
    key = f"{host_id()}:{_kernel_id(kernel)}"
    cache = _read_cache(data_dir)
    if key in cache:
        return AccelChoice(accel=Accel(cache[key]["accel"]), reason=cache[key]["reason"], cached=True)
    if kvm_boots(kernel, timeout=timeout):
        choice = AccelChoice(accel=Accel.KVM, reason="a stock kernel boots under KVM")
    else:
        choice = AccelChoice(accel=Accel.TCG,
                             reason=f"{device} opens but a stock kernel did not boot under it within {timeout:g} s")
    cache[key] = {"accel": choice.accel.value, "reason": choice.reason}
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = _cache_file(data_dir).with_suffix(".tmp")
    tmp.write_text(json.dumps(cache, indent=2) + "\n")
    tmp.replace(_cache_file(data_dir))
    return choice


def _default_data_dir() -> Path:
    if env := os.environ.get("WAKEFUL_DATA_DIR"):
        return Path(env)
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "wakeful"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wakeful.vm.accel",
                                     description="Probe KVM vs TCG for tool computers.")
    parser.add_argument("--kernel", type=Path)
    parser.add_argument("--data-dir", type=Path, default=_default_data_dir())
    parser.add_argument("--force", choices=[a.value for a in Accel])
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--cached-only", action="store_true")
    args = parser.parse_args(argv)
    if args.cached_only:
        prefix = f"{host_id()}:"
        answers = [v for k, v in _read_cache(args.data_dir).items() if k.startswith(prefix)]
        if answers:
            print(f"{answers[-1]['accel']} ({answers[-1]['reason']}, cached)")
        return 0
    if args.kernel is None:
        parser.error("--kernel is required unless --cached-only")
    print(choose_accel(args.kernel, data_dir=args.data_dir, force=args.force, timeout=args.timeout).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
