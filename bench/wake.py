"""Event-to-run-start latency: from a webhook's 2xx at the client to its run's `started_at` in the database.

N webhooks are sent 20 ms apart, each without a key, so each lands in the owner's triage session (one session, as a
user's deliveries that match no task do) and wakes its run there: one run at a time per session, so an event arriving
while the previous one's run is going waits for it (a run takes up to `run_max_events` pending events, so nothing
waits longer).
The client's clock (`time.time()`) and the server's `runs.started_at` (naive UTC) read the same machine's wall clock.
The baseline is the same server's `/v1/noop` round trip, sent between the webhooks over the same connection.
Target (issue): p50 <= 50 ms.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
from _common import (
    Row,
    Serve,
    Table,
    bench_args,
    fmt_ms,
    percentile,
    print_and_save,
    reproduce,
    serve,
    signed_headers,
    verdict,
)

SPACING = 0.020
TARGET_P50 = 0.050
BODY = b'{"bench":"wake"}'


@dataclass
class Sent:
    sent: float  # epoch seconds just before the request
    acked: float  # epoch seconds when the 2xx arrived


def send(server: Serve, n: int) -> tuple[dict[str, Sent], list[float], list[float]]:
    """(delivery ID -> times, webhook round trips, no-op round trips), interleaved on one keep-alive connection."""
    prefix = f"wake-{uuid.uuid4().hex[:8]}-"
    sent: dict[str, Sent] = {}
    hook_rtt: list[float] = []
    noop_rtt: list[float] = []
    with httpx.Client(base_url=server.url, timeout=10.0) as client:
        client.post("/v1/noop").raise_for_status()  # open the connection outside the measurement
        for i in range(n):
            delivery = f"{prefix}{i}"
            headers = signed_headers(BODY, delivery) | {"Content-Type": "application/json"}
            t_send = time.time()
            client.post("/v1/hooks/hook", content=BODY, headers=headers).raise_for_status()
            t_ack = time.time()
            sent[delivery] = Sent(sent=t_send, acked=t_ack)
            hook_rtt.append(t_ack - t_send)
            time.sleep(SPACING / 2)
            start = time.perf_counter()
            client.post("/v1/noop").raise_for_status()
            noop_rtt.append(time.perf_counter() - start)
            time.sleep(SPACING / 2)
    return sent, hook_rtt, noop_rtt


def _epoch(naive_utc: str) -> float:
    return datetime.fromisoformat(naive_utc).replace(tzinfo=UTC).timestamp()


def run_starts(server: Serve, deliveries: set[str], timeout: float = 60.0) -> dict[str, float]:
    """Delivery ID -> its run's started_at (epoch). `events.run_id` is set when the run commits, so poll."""
    deadline = time.monotonic() + timeout
    found: dict[str, float] = {}
    while time.monotonic() < deadline:
        with server.db() as conn:
            rows = conn.execute("SELECT e.source_id, r.started_at FROM events e JOIN runs r ON r.id = e.run_id "
                                "WHERE e.source = 'hook'").fetchall()
        found = {source_id: _epoch(started) for source_id, started in rows if source_id in deliveries}
        if len(found) == len(deliveries):
            break
        time.sleep(0.2)
    return found


def run(quick: bool = False) -> list[Table]:
    n = 30 if quick else 200
    with serve() as server:
        sent, hook_rtt, noop_rtt = send(server, n)
        starts = run_starts(server, set(sent))
    from_ack = [starts[d] - s.acked for d, s in sent.items() if d in starts]
    from_send = [starts[d] - s.sent for d, s in sent.items() if d in starts]
    p50 = percentile(from_ack, 50)

    def row(measure: str, values: list[float], p: int) -> Row:
        return Row(measure, fmt_ms(percentile(values, p)), fmt_ms(percentile(noop_rtt, p)))

    rows = [
        Row("event -> run start p50 (from the 2xx)", fmt_ms(p50), fmt_ms(percentile(noop_rtt, 50)), "<= 50 ms",
            verdict(p50 <= TARGET_P50 and len(starts) == n)),
        row("event -> run start p99 (from the 2xx)", from_ack, 99),
        row("request sent -> run start p50", from_send, 50),
        row("request sent -> run start p99", from_send, 99),
        row("webhook ack round trip p50", hook_rtt, 50),
        row("webhook ack round trip p99", hook_rtt, 99),
    ]
    notes = [f"{n} webhooks {SPACING * 1000:.0f} ms apart, all to the triage session; baseline: /v1/noop round trip "
             "on the same connection, sent between them",
             "a negative figure means the run started before the 2xx reached the client (the committer wakes the "
             "workers before it answers)"]
    if len(starts) < n:
        notes.append(f"only {len(starts)} of {n} events had a run within 60 s")
    return [Table(title="wake: webhook 2xx -> run started_at", rows=rows, reproduce=reproduce("wake.py", quick),
                  notes=notes)]


if __name__ == "__main__":
    args = bench_args(__doc__.splitlines()[0])
    print_and_save(run(args.quick), "wake.txt")
