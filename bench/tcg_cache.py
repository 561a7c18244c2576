"""Tool computer under TCG: QEMU's translation cache at the default `computer_tcg_cache` beside 64 MiB (the old one).

One VM from the real guest image per size, each booted cold, then driven through the real egress proxy to a shop on
the host's loopback: a first HTTP page, a second page of the same site, and a first HTTPS page (a new site, so a new
renderer). QEMU's own `info jit` says how often it threw its whole cache away. Under KVM there is no translation
cache and nothing to measure. Needs root, libvirtd (scripts/libvirtd) and the built image, like bench/tool_computer.py.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
sys.path[1:1] = [str(_BENCH.parent), str(_BENCH.parent / "tests" / "system")]

from _common import Row, Table, bench_args, print_and_save, reproduce, verdict  # noqa: E402
from computer_lab import URI, ComputerLab, tool_computer  # noqa: E402
from shop_lab import ShopEgress, shop_egress  # noqa: E402
from tool_computer import IMAGE  # noqa: E402

from wakeful.vm.accel import AccelChoice, choose_accel  # noqa: E402
from wakeful.vm.hypervisor import Accel  # noqa: E402
from wakeful.vm.lifecycle import VmSettings  # noqa: E402
from wakeful.vm.observe import Navigate  # noqa: E402
from wakeful.vm.toolcomputer import ActResult  # noqa: E402

BASELINE_MIB = 64
MIB = 2**20


@dataclass
class Step:
    seconds: float
    done: bool

    def __str__(self) -> str:
        return f"{self.seconds:.1f} s" if self.done else f"failed after {self.seconds:.1f} s"


@dataclass
class Figures:
    boot_ssh: float
    boot_cdp: float
    first_observation: float
    steps: dict[str, Step]
    """The pages, in order."""
    flushes: int
    qemu_rss: int


def _info_jit(name: str) -> str:
    return subprocess.run(["virsh", "-c", URI, "qemu-monitor-command", "--hmp", name, "info jit"], check=True,
                          capture_output=True, text=True, timeout=60).stdout


def flush_count(name: str) -> int:
    """How many times QEMU has emptied this guest's whole translation cache since it started."""
    found = re.search(r"TB flush count\s+(\d+)", _info_jit(name))
    if found is None:
        raise RuntimeError(f"QEMU's `info jit` for {name} names no TB flush count")
    return int(found[1])


def _navigate(lab: ComputerLab, url: str) -> Step:
    start = time.perf_counter()
    went = lab.computer.act(Navigate(url=url, observation=lab.computer.observe().observation.number))
    return Step(time.perf_counter() - start, isinstance(went, ActResult) and went.outcome == "done")


def measure(accel: AccelChoice, cache_mib: int, quick: bool) -> Figures:
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-tcg-") as tmp, \
            shop_egress(Path(tmp) / "egress", user="bench", deployment=IMAGE.parent.parent) as shop, \
            tool_computer(IMAGE, Path(tmp) / "vms", user="bench", accel=accel, proxy_port=shop.settings.proxy_port,
                          credential=shop.credential, prefix="wkb-", port_range=(25500, 25999),
                          tb_cache_mib=cache_mib) as lab:
        lab.boot()
        start = time.perf_counter()
        lab.computer.observe()
        observed = time.perf_counter() - start
        steps = _pages(lab, shop, quick)
        figures = Figures(boot_ssh=lab.boot_steps["ssh"], boot_cdp=lab.boot_steps["cdp"], first_observation=observed,
                          steps=steps, flushes=flush_count(lab.vm.name), qemu_rss=lab.manager.memory_bytes("bench"))
    print(f"{cache_mib} MiB: SSH {figures.boot_ssh:.1f} s, CDP {figures.boot_cdp:.1f} s, first observation "
          f"{observed:.1f} s, "
          + ", ".join(f"{k} {v}" for k, v in steps.items())
          + f"; {figures.flushes} cache flushes; QEMU RSS {figures.qemu_rss / MIB:,.0f} MiB", flush=True)
    return figures


def _pages(lab: ComputerLab, shop: ShopEgress, quick: bool) -> dict[str, Step]:
    steps = {"first HTTP page": _navigate(lab, shop.shop.url)}
    if not quick:
        steps["second page, same site"] = _navigate(lab, shop.shop.url + "login")
        steps["first HTTPS page (new renderer)"] = _navigate(lab, shop.shop.tls_url)
    return steps


def run(quick: bool = False) -> list[Table]:
    title, script = "tool computer under TCG: translation cache size", reproduce("tcg_cache.py", quick)
    accel = choose_accel(IMAGE / "vmlinux", data_dir=IMAGE.parent.parent, timeout=10.0)
    if accel.accel is not Accel.TCG:
        return [Table(title=title, rows=[Row("translation cache", "not used", "-")], reproduce=script,
                      notes=[f"guests run under {accel.describe()}: there is no translation cache to measure"])]
    default = VmSettings.tb_cache_mib
    ours, base = measure(accel, default, quick), measure(accel, BASELINE_MIB, quick)
    rows = [Row("cold boot → SSH answers", f"{ours.boot_ssh:.1f} s", f"{base.boot_ssh:.1f} s"),
            Row("cold boot → CDP attached", f"{ours.boot_cdp:.1f} s", f"{base.boot_cdp:.1f} s"),
            Row("first observation", f"{ours.first_observation:.1f} s", f"{base.first_observation:.1f} s")]
    rows += [Row(name, str(step), str(base.steps[name]), "done", verdict(step.done))
             for name, step in ours.steps.items()]
    rows += [Row("whole-cache flushes (QEMU `info jit`)", str(ours.flushes), str(base.flushes)),
             Row("QEMU resident memory at the end", f"{ours.qemu_rss / MIB:,.0f} MiB",
                 f"{base.qemu_rss / MIB:,.0f} MiB")]
    notes = [f"wakeful: the default computer_tcg_cache, {default} MiB; baseline: {BASELINE_MIB} MiB (the default "
             "before it), the same image and steps, run after it on the same host",
             "1 GiB, 2 vCPU guest from the real image under TCG; pages through the real egress proxy; a page is "
             "timed from the observation before it to `domcontentloaded` (the act's navigation bound is 180 s)",
             f"{platform.node()}, {os.cpu_count()} CPUs, load average "
             + ", ".join(f"{x:.2f}" for x in os.getloadavg()) + " at the end (the host is shared)"]
    return [Table(title=title, rows=rows, reproduce=script, notes=notes)]


if __name__ == "__main__":
    args = bench_args(__doc__.splitlines()[0])
    print_and_save(run(args.quick), "tcg_cache.txt")
