"""Signed-webhook ingest: throughput and ack latency, beside the same server's `/v1/noop` at the same loads.

Fixed offered loads (200, 500, 1000 req/s) use the open-loop generator in `_loadgen.py` (latency from each request's
intended send time); saturation uses wrk with a Lua script, the no-op and the webhook taking turns of 2 s (this
machine's speed moves by a third from one few seconds to the next; `saturation`), with 32 and with 128 connections:
each endpoint's throughput at saturation is its better level's (`SATURATION_CONNECTIONS`). Every webhook request is
its own delivery, with its own timestamp, delivery ID and signature (the generic scheme signs all three with the
body), signed just before its phase starts: the open-loop generator gets one set of headers per request, and wrk's Lua
(which cannot compute an HMAC) reads a pool of pre-signed deliveries, twice what the no-op endpoint took in the same
time. Each load gets a fresh server: the deliveries carry no key, so they all go to the owner's triage session, whose
runs (one at a time, each taking up to `run_max_events` pending events) give way to acknowledgements while deliveries
keep coming, so a phase ends with a backlog of them, and the backlog left by one phase would load the next. At a fixed
load the no-op phase runs first, while the server is idle, then the webhook phase. All servers start together
(start-up is seconds of imports on a busy machine); each is stopped as soon as its load is done, so the ones still
waiting idle beside it.

Targets (issue, 2-core machine): fsync-durable ingest >= 0.6x the no-op endpoint's throughput at saturation;
ack p99 <= 10 ms at 1,000 req/s offered; runs keep pace with a sustained 200 deliveries/s (the pace phase: the
backlog left when the load stops, and how fast it drains).

`wakeful serve` runs `wakeful api` beside `wakeful worker` (tool computers off).

With `--tail`, only the 1,000/s load, three times on a fresh server each, with the runs' share as it is
(`ingest_run_share`), as it was (0.05), and with the worker process stopped (SIGSTOP) for the load: how much of the
ack tail the runs' transactions make, and how much it moves from one run to the next.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sqlite3
import statistics
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from _common import (
    Row,
    Serve,
    Table,
    bench_args,
    fmt_ms,
    fmt_rate,
    fmt_ratio,
    percentile,
    print_and_save,
    reproduce,
    serving,
    signed_headers,
    verdict,
)
from _loadgen import LoadResult, LoadSpec, open_loop

TARGET_RATIO = 0.6
TARGET_P99 = 0.010
BODY = '{"bench":"ingest","note":"a constant body: each delivery signs it with its own timestamp and ID"}'
WRK = "/usr/bin/wrk"
WRK_THREADS = 2
TURN_SECONDS = 2.0  # saturation: no-op and webhook alternate this long each (`saturation`)
SATURATION_CONNECTIONS = (32, 128)
"""wrk's connections in the saturation turns; an endpoint's throughput at saturation is the mean of its turns at the
level where that mean is higher: saturation is where more senders bring no more throughput, and the two endpoints
get there at different levels. The no-op is highest with 32; with more, each request cost its event loop more and
its rate fell (three scratch sweeps of 16-256 connections, three 2 s turns each: 7,950-9,080/s with 32, 6,180-8,180/s
with 128-256). A webhook holds its connection until its batch is fsynced: with 32 its loop was busy 94-95% of the
time, with 128 99%, and its batches were larger, so the syncing thread spent about half the CPU per delivery (4 s
turns, worker stopped, `/proc` thread times); its rate rose from 4,310-5,270/s with 32 to 5,080-6,600/s with 64-256
in those sweeps."""


@dataclass(frozen=True)
class Durations:
    loads: tuple[int, ...]
    fixed: float
    warmup: float
    saturation: float
    sqlite_loop: float
    drain: float  # how long an overloaded server gets to answer what was offered before the window closed


FULL = Durations(loads=(200, 500, 1000), fixed=10.0, warmup=1.0, saturation=10.0, sqlite_loop=2.0, drain=10.0)
PACE_RATE = 200
PACE_SECONDS = {True: 3.0, False: 20.0}  # quick, full
PACE_DRAIN_TIMEOUT = 120.0
# Each load needs a fresh server (~5 s of start, stop and drain on a busy machine): the smoke run keeps the one
# load that has a target, so that all benchmarks together stay under a minute.
QUICK = Durations(loads=(1000,), fixed=1.0, warmup=0.3, saturation=2.0, sqlite_loop=0.3, drain=0.5)


# -- fixed offered load ---------------------------------------------------------------------------------------------


def _spec(server: Serve, *, hook: bool, rate: float, d: Durations) -> LoadSpec:
    if not hook:
        return LoadSpec(host="127.0.0.1", port=server.port, path="/v1/noop", body="{}", headers={}, rate=rate,
                        duration=d.fixed, warmup=d.warmup, drain_timeout=d.drain)
    spec = LoadSpec(host="127.0.0.1", port=server.port, path="/v1/hooks/hook", body=BODY, headers={}, rate=rate,
                    duration=d.fixed, warmup=d.warmup, drain_timeout=d.drain)
    run = f"fixed-{uuid.uuid4().hex[:8]}-"
    return dataclasses.replace(spec, per_request=[signed_headers(BODY.encode(), f"{run}{i}")
                                                  for i in range(spec.total)])


def fixed_load(server: Serve, rate: float, d: Durations) -> tuple[LoadResult, LoadResult]:
    """(no-op, webhook) at one offered rate, on a fresh server that is stopped afterwards."""
    noop = open_loop(_spec(server, hook=False, rate=rate, d=d))
    hook = open_loop(_spec(server, hook=True, rate=rate, d=d))
    server.stop()
    return noop, hook


def _fixed_rows(rate: int, noop: LoadResult, hook: LoadResult) -> list[Row]:
    p99_target = rate == 1000
    hook_p99 = percentile(hook.latencies, 99)
    return [
        Row(f"achieved rate @ {rate}/s offered", fmt_rate(hook.achieved), fmt_rate(noop.achieved)),
        Row(f"ack p50 @ {rate}/s", fmt_ms(percentile(hook.latencies, 50)), fmt_ms(percentile(noop.latencies, 50))),
        Row(f"ack p99 @ {rate}/s", fmt_ms(hook_p99), fmt_ms(percentile(noop.latencies, 99)),
            "<= 10 ms" if p99_target else "-",
            verdict(hook_p99 <= TARGET_P99 and hook.unfinished == 0) if p99_target else "-"),
    ]


def _fixed_notes(rate: int, noop: LoadResult, hook: LoadResult) -> list[str]:
    notes = []
    for name, r in (("no-op", noop), ("webhook", hook)):
        if r.failed or r.unfinished:
            notes.append(f"@ {rate}/s {name}: {r.failed} failed and {r.unfinished} unanswered of {r.sent} sent "
                         "(unanswered ones are not in the percentiles, so the true tail is worse)")
    return notes


def generator_note(noop: LoadResult) -> str:
    """Whether the client could offer the top load at all; if not, the fixed-load figures mean nothing.

    Its lag counts in every latency (they run from the intended time), so it must stay well under the 10 ms
    target; on these VMs even a spinning thread sees 2-8 ms stalls, so the bar is half the target."""
    lag = percentile(noop.lag, 99)
    ok = noop.achieved >= 0.98 * noop.offered and lag <= TARGET_P99 / 2
    head = "the generator sustained" if ok else "WARNING: the generator could NOT sustain"
    tail = "so the fixed-load figures are valid" if ok else "so the fixed-load figures are MEANINGLESS"
    return (f"{head} {noop.offered:.0f}/s against /v1/noop (achieved {noop.achieved:,.0f}/s, its own dispatch "
            f"lag p99 {fmt_ms(lag)}), {tail}")


# -- tail: where the ack p99 at 1,000/s comes from --------------------------------------------------------------------

TAIL_RATE = 1000
TAIL_RUNS = 3
TAIL_SETUPS = (("ingest_run_share as set (0.02)", {}, False),
               ("ingest_run_share 0.05 (before)", {"WAKEFUL_INGEST_RUN_SHARE": "0.05"}, False),
               ("worker stopped", {}, True))


def tail_table(quick: bool) -> Table:
    """The fixed 1,000/s load alone, `TAIL_RUNS` times per setup in turn, each on a fresh server."""
    d = QUICK if quick else FULL
    rows: list[Row] = []
    load_before = os.getloadavg()
    for i in range(1 if quick else TAIL_RUNS):
        for label, env, stop_worker in TAIL_SETUPS:
            with serving(1, env={"WAKEFUL_COMPUTERS": "false", **env}, timeout=240.0) as (server,):
                with server.worker_stopped(stop_worker):
                    noop = open_loop(_spec(server, hook=False, rate=TAIL_RATE, d=d))
                    hook = open_loop(_spec(server, hook=True, rate=TAIL_RATE, d=d))
            rows.append(Row(f"ack p99 @ {TAIL_RATE}/s, {label}, run {i + 1}", fmt_ms(percentile(hook.latencies, 99)),
                            fmt_ms(percentile(noop.latencies, 99)), "<= 10 ms",
                            verdict(percentile(hook.latencies, 99) <= TARGET_P99 and hook.unfinished == 0)))
    notes = [f"{d.fixed:.0f} s per load after {d.warmup:.1f} s warm-up; the baseline is the same server's /v1/noop",
             f"machine load (1-minute average, {os.cpu_count()} CPUs) {load_before[0]:.2f} at the start, "
             f"{os.getloadavg()[0]:.2f} at the end"]
    return Table(title="ingest: the ack tail at 1,000/s, with the runs' share as set, as it was, and with no runs",
                 rows=rows, reproduce=reproduce("ingest.py", quick, "tail"), notes=notes)


# -- pace: do runs keep up with a sustained 200 deliveries/s? -------------------------------------------------------


def pace(server: Serve, seconds: float) -> list[Row]:
    """Offer PACE_RATE deliveries/s for `seconds` on a fresh server: the backlog when the load stops (events not yet
    settled by a run), then how long the runs take to settle it, and the rate they settle at meanwhile."""
    spec = LoadSpec(host="127.0.0.1", port=server.port, path="/v1/hooks/hook", body=BODY, headers={},
                    rate=PACE_RATE, duration=seconds, warmup=0.0, drain_timeout=5.0)
    run = f"pace-{uuid.uuid4().hex[:8]}-"
    signed = [signed_headers(BODY.encode(), f"{run}{i}") for i in range(spec.total)]
    spec = dataclasses.replace(spec, per_request=signed)
    result = open_loop(spec)
    backlog = server.busy()
    drained = server.wait_drained(PACE_DRAIN_TIMEOUT)
    server.stop()
    kept = backlog <= PACE_RATE  # at most a second of deliveries behind
    drain_rate = "-" if not drained else fmt_rate(backlog / drained) if backlog else "nothing to drain"
    return [
        Row(f"backlog when a {seconds:.0f} s load of {PACE_RATE}/s stops (events)", f"{backlog:,}",
            f"{result.ok:,} acknowledged", f"<= {PACE_RATE} (runs keep pace)", verdict(kept)),
        Row("backlog drain", f"{drained:.1f} s" if drained is not None else f"> {PACE_DRAIN_TIMEOUT:.0f} s",
            drain_rate, "-", "-"),
    ]


# -- saturation (wrk) -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WrkResult:
    requests: int
    rps: float
    p50: float
    p99: float
    non_2xx: int
    socket_errors: int
    output: str


_NOOP_LUA = 'wrk.method = "POST"\nwrk.body = "{}"\nwrk.headers["Content-Type"] = "application/json"\n'

# Each wrk thread has its own Lua state: `setup` numbers them, and `init` (before wrk's clock starts) reads that
# thread's pool of pre-signed deliveries, one per line: timestamp, delivery ID, signature. Each request takes the next.
_HOOK_LUA = """wrk.method = "POST"
wrk.body = [==[{body}]==]
wrk.headers["Content-Type"] = "application/json"
local threads = 0
function setup(thread) thread:set("tid", threads); threads = threads + 1 end
local stamps, ids, signatures = {{}}, {{}}, {{}}
function init(args)
  for line in io.lines("{pool}." .. tid) do
    local ts, id, sig = line:match("^(%S+) (%S+) (%S+)$")
    stamps[#stamps + 1], ids[#ids + 1], signatures[#signatures + 1] = ts, id, sig
  end
end
local counter = 0
function request()
  counter = counter % #ids + 1
  wrk.headers["X-Wakeful-Timestamp"] = stamps[counter]
  wrk.headers["X-Wakeful-Delivery"] = ids[counter]
  wrk.headers["X-Wakeful-Signature"] = signatures[counter]
  return wrk.format()
end
"""


def pool_size(noop: WrkResult, seconds: float) -> int:
    """Pre-signed deliveries per wrk thread: twice what the no-op endpoint took in the same time (ingest is slower),
    so that the pool does not run out (it would start over, and the repeats would be duplicates)."""
    rate = noop.rps if math.isfinite(noop.rps) else 0.0
    return math.ceil(max(rate, 1000.0) * seconds * 2 / WRK_THREADS)


def write_pool(pool: Path, per_thread: int) -> None:
    """One file per wrk thread (`<pool>.<thread>`), each delivery signed now with its own ID."""
    run = f"sat-{uuid.uuid4().hex[:8]}"
    for tid in range(WRK_THREADS):
        lines = []
        for i in range(per_thread):
            h = signed_headers(BODY.encode(), f"{run}-{tid}-{i}")
            lines.append(f"{h['X-Wakeful-Timestamp']} {h['X-Wakeful-Delivery']} {h['X-Wakeful-Signature']}\n")
        Path(f"{pool}.{tid}").write_text("".join(lines))

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def _duration(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * _UNITS[unit]


def parse_wrk(output: str) -> WrkResult:
    def grab(pattern: str, default: str = "0") -> str:
        match = re.search(pattern, output, re.MULTILINE)
        return match.group(1) if match else default

    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    return WrkResult(
        requests=int(grab(r"^\s*(\d+) requests in")),
        rps=float(grab(r"^Requests/sec:\s*([\d.]+)", "nan")),
        p50=_duration(grab(r"^\s*50%\s+(\S+)", "nanus")) if "50%" in output else math.nan,
        p99=_duration(grab(r"^\s*99%\s+(\S+)", "nanus")) if "99%" in output else math.nan,
        non_2xx=int(grab(r"Non-2xx or 3xx responses: (\d+)")),
        socket_errors=sum(int(g) for g in errors.groups()) if errors else 0,
        output=output,
    )


def run_wrk(url: str, script: Path, seconds: float, connections: int) -> WrkResult:
    cmd = [WRK, f"-t{WRK_THREADS}", f"-c{connections}", f"-d{seconds:.0f}s", "--latency", "-s", str(script), url]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 60)
    return parse_wrk(proc.stdout)


@dataclass(frozen=True)
class Turn:
    connections: int
    noop: WrkResult
    hook: WrkResult
    pool: int  # pre-signed deliveries per wrk thread


@dataclass(frozen=True)
class Saturation:
    turns: list[Turn]  # in the order run
    recorded: tuple[int, int, int]  # events recorded, group-commit batches, events still waiting for their run

    @property
    def levels(self) -> list[int]:
        return sorted({t.connections for t in self.turns})

    @property
    def rounds(self) -> int:
        """Turns per connection level (each level has as many)."""
        return len(self.at(self.levels[0]))

    def at(self, connections: int) -> list[Turn]:
        return [t for t in self.turns if t.connections == connections]

    def rps(self, endpoint: str, connections: int) -> float:
        """The mean rate of an endpoint's (`noop` or `hook`) turns with that many connections (each turn lasts as
        long as the others)."""
        return statistics.fmean(getattr(t, endpoint).rps for t in self.at(connections))

    def saturated(self, endpoint: str) -> int:
        """The connections with which the endpoint's mean rate was higher: its saturation."""
        return max(self.levels, key=lambda c: self.rps(endpoint, c))

    @property
    def noop_rps(self) -> float:
        return self.rps("noop", self.saturated("noop"))

    @property
    def hook_rps(self) -> float:
        return self.rps("hook", self.saturated("hook"))

    @property
    def ratio(self) -> float:
        """Ingest over no-op, each at its saturation."""
        return self.hook_rps / self.noop_rps if self.noop_rps else math.nan

    @property
    def ran_out(self) -> bool:
        return any(t.hook.requests > t.pool * WRK_THREADS for t in self.turns)


def saturation(server: Serve, d: Durations) -> Saturation:
    """wrk against /v1/noop and the webhook in turn, `TURN_SECONDS` each, for `d.saturation` seconds of each with
    each of `SATURATION_CONNECTIONS` (the levels alternate too), on a fresh server that is stopped afterwards.

    The two alternate because this machine's speed does not hold still: the same no-op load gives 5,500-9,700/s
    from one few seconds to the next (the api using one core throughout), so one long run of each compared whatever
    the machine did then. The worker process is stopped (SIGSTOP) during the no-op turns: the backlog the webhook
    turns leave would otherwise run then, unthrottled (the inbox is idle), and slow the baseline."""
    turns: list[Turn] = []
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-wrk-") as tmp:
        noop_lua = Path(tmp) / "noop.lua"
        noop_lua.write_text(_NOOP_LUA)
        for i in range(max(1, round(d.saturation / TURN_SECONDS))):
            for connections in SATURATION_CONNECTIONS:
                with server.worker_stopped():
                    noop = run_wrk(f"{server.url}/v1/noop", noop_lua, TURN_SECONDS, connections)
                    per_thread = pool_size(max([noop] + [t.noop for t in turns], key=lambda r: r.rps), TURN_SECONDS)
                    pool, hook_lua = Path(tmp) / f"signed-{i}-{connections}", Path(tmp) / f"hook-{i}-{connections}.lua"
                    write_pool(pool, per_thread)
                    hook_lua.write_text(_HOOK_LUA.format(body=BODY, pool=pool))
                hook = run_wrk(f"{server.url}/v1/hooks/hook", hook_lua, TURN_SECONDS, connections)
                turns.append(Turn(connections=connections, noop=noop, hook=hook, pool=per_thread))
    server.stop()
    with server.db() as conn:  # one batch shares one `received_at`: the committer reads the clock once
        events, batches, waiting = conn.execute(
            "SELECT count(*), count(DISTINCT received_at), count(*) FILTER (WHERE status = 'pending') "
            "FROM events WHERE source = 'hook'").fetchone()
    return Saturation(turns=turns, recorded=(int(events), int(batches), int(waiting)))


def _saturation_rows(sat: Saturation) -> list[Row]:
    clean = not any(t.hook.non_2xx or t.hook.socket_errors for t in sat.turns)
    n = sat.rounds
    hook_c, noop_c = sat.saturated("hook"), sat.saturated("noop")

    def at(endpoint: str, connections: int) -> list[WrkResult]:
        return [getattr(t, endpoint) for t in sat.at(connections)]

    def p50(results: list[WrkResult]) -> str:
        return fmt_ms(statistics.median(r.p50 for r in results))

    def p99(results: list[WrkResult]) -> str:
        return fmt_ms(max(r.p99 for r in results))

    levels = " or ".join(f"-c{c}" for c in sat.levels)
    return [
        Row(f"throughput at saturation (wrk -t2 {levels}, whichever is higher; mean of {n} turn{'s' * (n != 1)})",
            f"{fmt_rate(sat.hook_rps)} (-c{hook_c})", f"{fmt_rate(sat.noop_rps)} (-c{noop_c})"),
        Row("ingest / no-op throughput, each at its saturation", fmt_ratio(sat.ratio), fmt_ratio(1.0),
            f">= {TARGET_RATIO:.2f}x", verdict(sat.ratio >= TARGET_RATIO and clean)),
        *(Row(f"  throughput with {c} connections (ratio {sat.rps('hook', c) / sat.rps('noop', c):.2f}x)",
              fmt_rate(sat.rps("hook", c)), fmt_rate(sat.rps("noop", c))) for c in sat.levels),
        Row("latency p50 at saturation (closed loop, median turn)", p50(at("hook", hook_c)), p50(at("noop", noop_c))),
        Row("latency p99 at saturation (closed loop, worst turn)", p99(at("hook", hook_c)), p99(at("noop", noop_c))),
    ]


def _saturation_notes(sat: Saturation) -> list[str]:
    events, batches, waiting = sat.recorded
    accepted = sum(t.hook.requests - t.hook.non_2xx for t in sat.turns)
    notes = [f"saturation: {TURN_SECONDS:.0f} s of wrk against the no-op (worker process stopped), then "
             f"{TURN_SECONDS:.0f} s against the webhook, with each of {', '.join(map(str, sat.levels))} connections "
             f"in turn, {sat.rounds} time(s); an endpoint's saturation is the level where its mean "
             "rate is higher"]
    notes += [f"saturation: webhook/no-op per turn with {c} connections: "
              + ", ".join(f"{t.hook.rps:,.0f}/{t.noop.rps:,.0f}" for t in sat.at(c)) for c in sat.levels]
    if sat.ran_out:
        notes.append("saturation: WARNING a turn's pre-signed deliveries ran out, so some requests were repeats "
                     "answered as duplicates (a cheaper path than a new delivery): the throughput is flattered")
    notes += [f"saturation: {accepted:,} webhooks acknowledged, {events:,} distinct events in the database "
              f"(in-flight requests at each wrk's stop can make these differ by up to one per connection a turn), "
              f"{events / batches if batches else math.nan:.1f} deliveries per group commit on average",
              f"saturation: {waiting:,} of those events were still waiting for their run when the server was stopped "
              "(runs give way to acknowledgements under load, ingest_run_share; a restart resumes them)"]
    for t in sat.turns:
        if t.hook.non_2xx or t.hook.socket_errors:
            errors = re.search(r"Socket errors: (.*)", t.hook.output)
            notes.append(f"saturation: {t.hook.non_2xx} non-2xx responses in a turn with {t.connections} "
                         f"connections; socket errors: {errors.group(1) if errors else 'none'} (wrk's timeout is 2 s)")
    return notes


# -- durability baseline: what group commit buys ---------------------------------------------------------------------


def _sqlite_rate(path: Path, per_commit: int, seconds: float) -> float:
    """Rows/s inserting event-sized rows with the server's pragmas (WAL, synchronous=FULL): fsync per commit."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE IF NOT EXISTS ev (id TEXT PRIMARY KEY, source_id TEXT UNIQUE, payload TEXT)")
    rows, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO ev VALUES (?, ?, ?)",
                         [(uuid.uuid4().hex, uuid.uuid4().hex, BODY) for _ in range(per_commit)])
        conn.execute("COMMIT")
        rows += per_commit
    elapsed = time.perf_counter() - start
    conn.close()
    return rows / elapsed


def durability_table(d: Durations, noop_rps: float, quick: bool) -> Table:
    with tempfile.TemporaryDirectory(prefix="wakeful-bench-sqlite-") as tmp:
        one = _sqlite_rate(Path(tmp) / "one.db", 1, d.sqlite_loop)
        batched = _sqlite_rate(Path(tmp) / "batch.db", 32, d.sqlite_loop)
    return Table(
        title="ingest durability baseline: in-process sqlite3 insert, fsync per commit (WAL, synchronous=FULL)",
        rows=[
            Row("rows/s, 32 rows per commit vs 1 per commit", fmt_rate(batched), fmt_rate(one)),
            Row("commit-per-row ceiling / no-op saturation", fmt_ratio(one / noop_rps if noop_rps else math.nan),
                fmt_ratio(1.0)),
        ],
        reproduce=reproduce("ingest.py", quick),
        notes=["the per-row figure is the most a server committing each request on its own could reach, before any "
               "HTTP or Python cost (the issue's note puts that server at ~0.24x no-op)"],
    )


# -- the benchmark --------------------------------------------------------------------------------------------------


def run(quick: bool = False) -> list[Table]:
    d = QUICK if quick else FULL
    rows: list[Row] = []
    notes: list[str] = []
    top_noop: LoadResult | None = None
    env = {"WAKEFUL_COMPUTERS": "false"}
    load_before = os.getloadavg()
    # Several servers of three processes each start at once: on a busy 2-core machine that takes minutes.
    with serving(len(d.loads) + 2, env=env, timeout=240.0) as servers:
        for rate, server in zip(d.loads, servers, strict=False):
            noop, hook = fixed_load(server, rate, d)
            rows += _fixed_rows(rate, noop, hook)
            notes += _fixed_notes(rate, noop, hook)
            top_noop = noop
        sat = saturation(servers[-2], d)
        pace_rows = pace(servers[-1], PACE_SECONDS[quick])
    assert top_noop is not None
    notes.insert(0, generator_note(top_noop))
    rows = _saturation_rows(sat) + rows + pace_rows
    notes += _saturation_notes(sat)
    notes.append(f"machine load (1-minute average, {os.cpu_count()} CPUs) {load_before[0]:.2f} at the start, "
                 f"{os.getloadavg()[0]:.2f} at the end: other work on the machine shows in every figure")
    window = (f"{d.fixed:.0f} s per fixed load after {d.warmup:.1f} s warm-up, {d.saturation:.0f} s wrk each per "
              "connection level")
    main = Table(title=f"ingest: signed webhook (fsync-durable) vs /v1/noop on the same server, wakeful api + "
                       f"wakeful worker ({window})",
                 rows=rows, reproduce=reproduce("ingest.py", quick), notes=notes)
    return [main, durability_table(d, sat.noop_rps, quick)]


if __name__ == "__main__":
    args = bench_args(__doc__.splitlines()[0], {"tail": "only the 1,000/s load, three times per runs' share, and "
                                                        "with the worker stopped"})
    if args.tail:
        print_and_save([tail_table(args.quick)], "ingest_tail.txt")
    else:
        print_and_save(run(args.quick), "ingest.txt")
