"""Shared benchmark helpers: start/stop `wakeful serve`, signed webhooks, percentiles, tables and their output.

Every benchmark imports this module (the scripts run as `python bench/<name>.py`, so `bench/` is on `sys.path`).
Benchmarks never assert on time: they print a figure beside a baseline measured in the same run, and the target.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from wakeful.server.core.signatures import sign

__all__ = [
    "BENCH_DIR",
    "PYTHON",
    "RESULTS_DIR",
    "ROOT",
    "SECRET",
    "WAKEFUL",
    "Row",
    "Serve",
    "Table",
    "bench_args",
    "fmt_ms",
    "fmt_rate",
    "fmt_ratio",
    "free_port",
    "percentile",
    "print_and_save",
    "render",
    "reproduce",
    "serve",
    "serving",
    "signed_headers",
    "start_serve",
    "start_servers",
    "verdict",
]

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent  # the repository root
RESULTS_DIR = BENCH_DIR / "results"
PYTHON = Path(sys.executable)
WAKEFUL = PYTHON.parent / "wakeful"  # the console script beside the interpreter: run the scripts with .venv/bin/python
SECRET = "bench-secret"  # the generic source's signing secret; loopback only, so a constant is fine


# -- the server under test ------------------------------------------------------------------------------------------


def free_port() -> int:
    """A port the kernel just handed out; it is released before the server binds it (a small, accepted race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Serve:
    """A running `wakeful serve` subprocess with its own data dir, port and generic webhook source `hook`."""

    proc: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @contextmanager
    def worker_stopped(self, stop: bool = True) -> Iterator[None]:
        """The block runs with `wakeful worker` stopped (SIGSTOP; continued after, even on an error), if `stop`."""
        if not stop:
            yield
            return
        worker = int((self.data_dir / "run" / "worker.pid").read_text())
        os.kill(worker, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(worker, signal.SIGCONT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "wakeful.db"

    def db(self) -> sqlite3.Connection:
        """A read connection to the server's database (stdlib sqlite3, so it measures nothing of ours)."""
        return sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30)

    def busy(self) -> int:
        """Events no run has settled yet plus runs still running: 0 once the server has caught up."""
        with self.db() as conn:
            return int(conn.execute("SELECT (SELECT count(*) FROM events WHERE status = 'pending') + "
                                    "(SELECT count(*) FROM runs WHERE outcome = 'running')").fetchone()[0])

    def wait_drained(self, timeout: float) -> float | None:
        """Seconds until the server caught up with its backlog, or None if it did not within the timeout."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.busy() == 0:
                return time.monotonic() - start
            time.sleep(0.2)
        return None

    def stop(self) -> None:
        """SIGTERM by PID (never by name), then SIGKILL if it does not go within 20 s."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _serve_env(data_dir: Path, port: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WAKEFUL_")}  # the caller's config must not leak
    env["WAKEFUL_PROXY_PORT"] = str(free_port())  # each server starts its own egress proxy: they must not share a port
    env.update(extra)  # ... unless the caller names the port (a benchmark of the proxy itself)
    env.update({
        "WAKEFUL_DATA_DIR": str(data_dir),
        "WAKEFUL_PORT": str(port),
        "WAKEFUL_SOURCES__HOOK__KIND": "generic",
        "WAKEFUL_SOURCES__HOOK__SECRET": SECRET,
    })
    return env


def _wait_healthy(server: Serve, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"wakeful serve exited with {server.proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"wakeful serve did not answer /healthz within {timeout} s:\n{server.log_tail()}")


def _launch(data_dir: Path, env: dict[str, str]) -> Serve:
    port = free_port()
    log_path = data_dir / f"serve-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([str(WAKEFUL), "serve"], env=_serve_env(data_dir, port, env), cwd=data_dir,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    return Serve(proc=proc, port=port, data_dir=data_dir, log_path=log_path)


def _ready(server: Serve, data_dir: Path, env: dict[str, str], timeout: float) -> Serve:
    """Wait for `/healthz`; relaunch once on another port if the free port was taken meanwhile."""
    try:
        _wait_healthy(server, timeout)
        return server
    except RuntimeError:
        server.stop()
        if "address already in use" not in server.log_tail().lower():
            raise
    retry = _launch(data_dir, env)
    try:
        _wait_healthy(retry, timeout)
    except RuntimeError:
        retry.stop()
        raise
    return retry


def start_servers(data_dirs: Sequence[Path], *, env: dict[str, str] | None = None,
                  timeout: float = 60.0) -> list[Serve]:
    """Start one `wakeful serve` per data dir, all at once (start-up is seconds of imports on a busy machine).

    Each gets a free loopback port; `env` adds settings (`WAKEFUL_*`), while data dir, port and the `hook`
    source are always the benchmark's. If any fails to come up, all are stopped."""
    extra = env or {}
    launched = [_launch(d, extra) for d in data_dirs]
    ready: list[Serve] = []
    try:
        for server, data_dir in zip(launched, data_dirs, strict=True):
            ready.append(_ready(server, data_dir, extra, timeout))
    except BaseException:
        for server in launched + ready:
            server.stop()
        raise
    return ready


def start_serve(data_dir: Path, *, env: dict[str, str] | None = None) -> Serve:
    return start_servers([data_dir], env=env)[0]


@contextmanager
def serving(count: int, *, env: dict[str, str] | None = None, timeout: float = 60.0) -> Iterator[list[Serve]]:
    """`count` servers, each with its own temp data dir (removed afterwards), stopped at the end of the block."""
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-") as tmp:
        dirs = [Path(tmp) / f"server-{i}" for i in range(count)]
        for d in dirs:
            d.mkdir()
        servers = start_servers(dirs, env=env, timeout=timeout)
        try:
            yield servers
        finally:
            for server in servers:
                server.stop()


@contextmanager
def serve(*, env: dict[str, str] | None = None) -> Iterator[Serve]:
    """One server with a temp data dir for the duration of the block."""
    with serving(1, env=env) as (server,):
        yield server


def signed_headers(body: bytes, delivery_id: str) -> dict[str, str]:
    """One delivery's headers, stamped now: the generic scheme signs the timestamp and the delivery ID with the body,
    so every delivery has its own signature (good for the source's tolerance, five minutes by default)."""
    return sign("generic", secret=SECRET.encode(), body=body, now=time.time(), delivery_id=delivery_id)


# -- statistics -----------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100); NaN for no values, so a missing figure cannot pass as zero."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


# -- tables ---------------------------------------------------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1000:.2f} ms"


def fmt_rate(per_second: float) -> str:
    return "n/a" if math.isnan(per_second) else f"{per_second:,.0f}/s"


def fmt_ratio(ratio: float) -> str:
    return "n/a" if math.isnan(ratio) else f"{ratio:.2f}x"


def verdict(met: bool | None) -> str:
    """`None` is a figure with no target of its own (context for the ones that have one)."""
    return "-" if met is None else ("met" if met else "MISSED")


@dataclass(frozen=True)
class Row:
    measure: str
    wakeful: str
    baseline: str
    target: str = "-"
    verdict: str = "-"


@dataclass
class Table:
    title: str
    rows: list[Row]
    reproduce: str
    notes: list[str] = field(default_factory=list)


_HEADER = Row("measure", "wakeful", "baseline", "target", "verdict")


def render(table: Table) -> str:
    cells = [_HEADER, *table.rows]
    widths = [max(len(getattr(r, col)) for r in cells) for col in ("measure", "wakeful", "baseline", "target")]

    def line(r: Row) -> str:
        parts = [r.measure.ljust(widths[0]), r.wakeful.rjust(widths[1]), r.baseline.rjust(widths[2]),
                 r.target.ljust(widths[3]), r.verdict]
        return "  ".join(parts).rstrip()

    rule = "-" * len(line(_HEADER).ljust(sum(widths) + 8 + 7))
    out = [table.title, rule, line(_HEADER), rule, *(line(r) for r in table.rows), rule]
    out += [f"note: {n}" for n in table.notes]
    out.append(f"reproduce: {table.reproduce}")
    return "\n".join(out)


def print_and_save(tables: Iterable[Table], filename: str, header: str = "", echo: bool = True) -> None:
    """Print every table (unless the caller already did) and write the same text to bench/results/<filename>."""
    text = "\n\n".join(([header] if header else []) + [render(t) for t in tables]) + "\n"
    if echo:
        print(text, end="", flush=True)
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / filename).write_text(text)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def bench_args(description: str, flags: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse `--quick` (and the benchmark's own on/off `flags`: name → help), and make SIGTERM and SIGINT unwind the
    stack so every started server is stopped.

    Python's default SIGTERM kills without running `finally`, and a background job inherits SIGINT ignored."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a shorter smoke run (figures are noisier)")
    for flag, help in (flags or {}).items():
        parser.add_argument(f"--{flag}", action="store_true", help=help)
    return parser.parse_args()


def reproduce(script: str, quick: bool, *flags: str) -> str:
    words = "".join(f" --{f}" for f in (*(("quick",) if quick else ()), *flags))
    return f".venv/bin/python bench/{script}{words}   (from the repository root)"
