"""`wakeful ledger verify` throughput (rows/s), beside a plain SHA-256 over the same bytes in the same run.

A SQLite database gets N chained rows (egress audit records, as the proxy writes them, and control records), the
sealer chains them (its throughput is printed too), then the checks run three ways: the database (`verify_database`:
read every row and entry, canonical form, row hash, chain, checkpoints), an export file offline (`read_export`), and
the baseline: SHA-256 over each row's canonical bytes, already in memory, nothing else.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from _common import Row, Table, bench_args, fmt_rate, print_and_save, reproduce
from sqlalchemy import insert

from wakeful.server.audit.export import read_export, write_export
from wakeful.server.audit.seal import seal
from wakeful.server.audit.signing import load_or_create_key
from wakeful.server.audit.verify import snapshot, verify_database
from wakeful.server.store.db import make_engine, migrate, write
from wakeful.server.store.tables import control, egress_audit


def populate(engine: object, rows: int) -> None:
    start = datetime(2026, 12, 2, tzinfo=UTC)
    audit = [{"request_id": f"egr_{i:08d}", "at": start + timedelta(milliseconds=i), "user_id": None,
              "client": "tool_computer", "grant_id": None, "action_id": None, "method": "GET", "scheme": "https",
              "host": "shop.example.com", "port": 443, "path": f"/cart/{i}", "verdict": "allow", "code": None,
              "rule": "shop", "credential": None, "bytes_up": 512, "bytes_down": 20_000 + i, "upstream_status": 200,
              "latency_ms": 12.5, "recorded_at": start} for i in range(rows - rows // 10)]
    controls = [{"id": f"ctl_{i:08d}", "user_id": None, "task_id": None, "kind": "stop" if i % 2 else "start",
                 "actor": "user:owner", "reason": "bench", "created_at": start} for i in range(rows // 10)]
    with write(engine) as conn:  # type: ignore[arg-type]
        for first in range(0, len(audit), 10_000):
            conn.execute(insert(egress_audit), audit[first:first + 10_000])
        conn.execute(insert(control), controls)


def trigger_cost(tmp: Path, rows: int) -> tuple[float, float]:
    """Seconds to insert `rows` control records, one transaction per 100, with the chain's insert trigger and
    without it (dropped): what chaining adds to a writer of history rows."""
    timings = []
    for chained in (True, False):
        engine = make_engine(f"sqlite:///{tmp / f'trigger-{chained}.db'}")
        migrate(engine)
        if not chained:
            with write(engine) as conn:
                conn.exec_driver_sql("DROP TRIGGER control_chain")
        start = datetime(2026, 12, 2, tzinfo=UTC)
        began = time.perf_counter()
        for first in range(0, rows, 100):
            with write(engine) as conn:
                conn.execute(insert(control), [{"id": f"ctl_{i:08d}", "user_id": None, "task_id": None, "kind": "stop",
                                                "actor": "user:owner", "reason": "bench", "created_at": start}
                                               for i in range(first, first + 100)])
        timings.append(time.perf_counter() - began)
        engine.dispose()
    return timings[0], timings[1]


def run(quick: bool) -> list[Table]:
    rows = 10_000 if quick else 100_000
    with tempfile.TemporaryDirectory() as tmp:
        with_trigger, without = trigger_cost(Path(tmp), 2_000 if quick else 10_000)
        engine = make_engine(f"sqlite:///{Path(tmp) / 'wakeful.db'}")
        migrate(engine)
        populate(engine, rows)
        key = load_or_create_key(Path(tmp) / "ledger.key")
        began = time.perf_counter()
        sealed = seal(engine, key, now=datetime.now(UTC))
        seal_s = time.perf_counter() - began

        began = time.perf_counter()
        verdict = verify_database(engine, key.public)
        verify_s = time.perf_counter() - began
        assert verdict.ok and verdict.entries == rows == sealed, verdict

        seen = snapshot(engine)
        out = io.StringIO()
        write_export(seen, out, key=key.public)
        lines = out.getvalue().splitlines()
        began = time.perf_counter()
        offline = read_export(lines, key.public)
        export_s = time.perf_counter() - began
        assert offline.ok and offline.entries == rows

        data = [json.dumps({"table": e.table, "part": e.part, "row": r}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=False).encode() for e, r in seen.entries]
        began = time.perf_counter()
        for chunk in data:
            hashlib.sha256(chunk).digest()
        plain_s = time.perf_counter() - began
        engine.dispose()
    plain = rows / plain_s
    trigger_rows = 2_000 if quick else 10_000
    size = sum(len(d) for d in data) / len(data)
    table = Table(
        title=f"ledger verify: {rows:,} chained rows (SQLite), {verdict.checkpoints} checkpoints, "
              f"{size:.0f} canonical bytes per row",
        rows=[
            Row("wakeful ledger verify (database)", fmt_rate(rows / verify_s), fmt_rate(plain),
                verdict=f"{plain / (rows / verify_s):.0f}x slower than the hash alone"),
            Row("verify --export (offline, file in memory)", fmt_rate(rows / export_s), fmt_rate(plain),
                verdict=f"{plain / (rows / export_s):.0f}x slower than the hash alone"),
            Row("seal (chain + sign, batches of 500)", fmt_rate(rows / seal_s), fmt_rate(plain)),
            Row("history inserts (100 per commit), chain trigger vs none", fmt_rate(trigger_rows / with_trigger),
                fmt_rate(trigger_rows / without), verdict=f"{with_trigger / without:.2f}x the time"),
        ],
        reproduce=reproduce("ledger_verify.py", quick),
        notes=["baseline: SHA-256 over each row's canonical bytes, already in memory (no database, no JSON)",
               f"seconds: verify {verify_s:.2f}, export check {export_s:.2f}, seal {seal_s:.2f}, "
               f"plain SHA-256 {plain_s:.3f}"],
    )
    return [table]


def main() -> None:
    args = bench_args(__doc__ or "")
    print_and_save(run(args.quick), "ledger_verify.txt")


if __name__ == "__main__":
    main()
