"""Run every benchmark in one invocation, print all tables and write them to bench/results/latest.txt.

    .venv/bin/python bench/run_all.py           # the full run (several minutes)
    .venv/bin/python bench/run_all.py --quick   # a smoke run, a few minutes on an otherwise idle machine

Benchmarks run one after another, never side by side, so they do not load each other. Each is imported only when
its turn comes, so a benchmark that fails to import or to run is reported in its place and the others still run.
"""

from __future__ import annotations

import importlib
import os
import platform
import time
import traceback
from datetime import UTC, datetime

from _common import Row, Table, bench_args, print_and_save, render

# (module in bench/, part of --quick): the MCP round trip alone takes longer than the quick run's budget leaves.
BENCHMARKS: list[tuple[str, bool]] = [
    ("ingest", True),
    ("workers", False),  # starts PostgreSQL and four configurations of processes: a minute or more
    ("wake", True),
    ("timers", True),
    ("idle", True),
    ("admission", True),
    ("reconcile", True),
    ("eval", True),
    ("context", True),
    ("memory_recall", True),
    ("mcp_roundtrip", False),
    ("egress_proxy", True),
    ("tool_computer", False),  # boots a 1 GiB guest: minutes under TCG, and it needs the built image
    ("tcg_cache", False),  # boots it twice, once thrashing: ten minutes or more
]


def machine_line() -> str:
    """Other processes on a shared machine move every figure: say how busy it was."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{platform.node()}, {os.cpu_count()} CPUs, load average {load}"


def run_one(module: str, quick: bool) -> list[Table]:
    try:
        return list(importlib.import_module(module).run(quick))
    except Exception:
        traceback.print_exc()
        last = traceback.format_exc().strip().splitlines()[-1]
        return [Table(title=f"{module}.py: FAILED", rows=[Row("error", last, "-")],
                      reproduce=f".venv/bin/python bench/{module}.py{' --quick' if quick else ''}",
                      notes=["see the traceback above"])]


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    started = time.monotonic()
    header = [f"wakeful benchmarks, {'quick' if args.quick else 'full'} run, "
              f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC", f"machine at start: {machine_line()}"]
    print("\n".join(header) + "\n", flush=True)
    tables: list[Table] = []
    for module, in_quick in BENCHMARKS:
        if args.quick and not in_quick:
            header.append(f"skipped in --quick: {module}.py (run it alone: .venv/bin/python bench/{module}.py --quick)")
            print(header[-1] + "\n", flush=True)
            continue
        t0 = time.monotonic()
        produced = run_one(module, args.quick)
        produced[-1].notes.append(f"{module}.py took {time.monotonic() - t0:.0f} s")
        for table in produced:
            print(render(table) + "\n", flush=True)
        tables += produced
    header += [f"machine at end: {machine_line()}", f"total {time.monotonic() - started:.0f} s",
               f"reproduce all: .venv/bin/python bench/run_all.py{' --quick' if args.quick else ''}"]
    print_and_save(tables, "latest.txt", header="\n".join(header), echo=False)
    print("\n".join(header[-3:]) + "\nwritten to bench/results/latest.txt")


if __name__ == "__main__":
    main()
