"""Run every benchmark in one invocation, print all tables and write them to bench/results/latest.txt.

    .venv/bin/python bench/run_all.py           # the full run (several minutes)
    .venv/bin/python bench/run_all.py --quick   # a smoke run, under a minute; noisier figures

Benchmarks run one after another, never side by side, so they do not load each other. A benchmark that fails is
reported in its place and the others still run.
"""

from __future__ import annotations

import os
import platform
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime

import idle
import ingest
import mcp_roundtrip
import timers
import wake
from _common import Row, Table, bench_args, print_and_save, render

# (script, run, part of --quick): the MCP round trip alone takes longer than the quick run's whole budget leaves.
BENCHMARKS: list[tuple[str, Callable[[bool], list[Table]], bool]] = [
    ("ingest.py", ingest.run, True),
    ("wake.py", wake.run, True),
    ("timers.py", timers.run, True),
    ("idle.py", idle.run, True),
    ("mcp_roundtrip.py", mcp_roundtrip.run, False),
]


def machine_line() -> str:
    """Other processes on a shared machine move every figure: say how busy it was."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{platform.node()}, {os.cpu_count()} CPUs, load average {load}"


def failed(script: str, quick: bool) -> Table:
    last = traceback.format_exc().strip().splitlines()[-1]
    return Table(title=f"{script}: FAILED", rows=[Row("error", last, "-")],
                 reproduce=f".venv/bin/python bench/{script}{' --quick' if quick else ''}",
                 notes=["see the traceback above"])


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    started = time.monotonic()
    header = [f"wakeful benchmarks, {'quick' if args.quick else 'full'} run, "
              f"{datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC", f"machine at start: {machine_line()}"]
    print("\n".join(header) + "\n", flush=True)
    tables: list[Table] = []
    for script, run, in_quick in BENCHMARKS:
        if args.quick and not in_quick:
            header.append(f"skipped in --quick: {script} (run it alone: .venv/bin/python bench/{script} --quick)")
            print(header[-1] + "\n", flush=True)
            continue
        t0 = time.monotonic()
        try:
            produced = run(args.quick)
        except Exception:
            traceback.print_exc()
            produced = [failed(script, args.quick)]
        produced[-1].notes.append(f"{script} took {time.monotonic() - t0:.0f} s")
        for table in produced:
            print(render(table) + "\n", flush=True)
        tables += produced
    header += [f"machine at end: {machine_line()}", f"total {time.monotonic() - started:.0f} s",
               f"reproduce all: .venv/bin/python bench/run_all.py{' --quick' if args.quick else ''}"]
    print_and_save(tables, "latest.txt", header="\n".join(header), echo=False)
    print("\n".join(header[-2:]) + "\nwritten to bench/results/latest.txt")


if __name__ == "__main__":
    main()
