"""Context per wake over one scripted delegation: its size and the share of it reused from the previous wake.

A delegation of WAKES wakes (an email, an airline push or a daily check each; a steer to v2 before wake 6; a write
that waits for approval at wake 10, approved before wake 11; messages to the user now and then) runs in process
over a real SQLite file with a fake clock (hours between wakes), a scripted model and the merchant simulator on
loopback. For each wake: the bytes its first model step is given (prefix, task snapshot, tail, as
`harness.context.wake_sizes` reads them back from `run_contexts`), tokens estimated as bytes / 4 (no tokenizer is
installed), and how many of those bytes lead the previous wake's byte for byte (what a prefix cache can serve).
Baselines from the same wakes: "whole history" (one conversation continued: every earlier wake's events, tool calls
and results stay in it, append-only) and "new session each wake" (the prefix and this wake's events, nothing else).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from os.path import commonprefix
from pathlib import Path

from _common import ROOT, Row, Table, bench_args, print_and_save, reproduce
from sqlalchemy import Engine, select

from wakeful.proxy.clock import FakeClock
from wakeful.server.acting import approvals
from wakeful.server.acting.connectors import load_connectors
from wakeful.server.acting.policy import Policy
from wakeful.server.core import control, inbox, sessions
from wakeful.server.core.worker import Worker
from wakeful.server.harness.context import render_tail, wake_sizes
from wakeful.server.harness.history import COMPACT_EVERY
from wakeful.server.harness.model import ModelReply, ModelRequest, ScriptedModel, Step, calls, quiet
from wakeful.server.harness.wake import Harness
from wakeful.server.settings import Settings
from wakeful.server.sims import SimClock, create_merchant, serve
from wakeful.server.store import users
from wakeful.server.store.db import make_engine, migrate, read, write
from wakeful.server.store.tables import actions, run_contexts
from wakeful.server.tools.layer import ToolLayer

WAKES = 22
BODY = "Dear traveller, " + "details of the booking and the fare rules follow. " * 12  # ~600 bytes a delivery


def _cancel(request: ModelRequest) -> ModelReply:
    listed = json.loads(request.messages[-1]["content"][0]["content"])
    return calls(("merchant__cancel_renewal", {"subscription": listed["objects"][0]["id"]}))


PLAN: dict[int, list[Step]] = {
    1: [calls(("merchant__list_subscriptions", {})), calls(("send_to_user", {"text": "On it: one subscription."}))],
    6: [calls(("send_to_user", {"text": "Noted: the meeting moved to Thursday."}))],
    10: [calls(("merchant__list_subscriptions", {})), _cancel, quiet("waiting for the user's approval")],
    11: [calls(("send_to_user", {"text": "Cancelled as approved."}))],
    16: [calls(("merchant__list_subscriptions", {})), quiet("nothing changed")],
}


@dataclass(frozen=True)
class Wake:
    """Bytes given to the model at a wake and the leading bytes shared with the previous wake, three ways."""

    sent: int
    reused: int
    whole: int
    whole_reused: int
    fresh: int
    fresh_reused: int


def delegation(tmp: Path) -> list[Wake]:
    merchant_app, _ = create_merchant(clock=SimClock())
    with serve(merchant_app) as url:
        engine = make_engine(f"sqlite:///{tmp}/wakeful.db")
        migrate(engine)
        clock = FakeClock()
        registry = load_connectors(ROOT / "policies" / "connectors", base_urls={"merchant": url})
        tools = ToolLayer(engine, clock, registry=registry, policy=Policy())
        model = ScriptedModel([])
        harness = Harness(model, registry=registry, instructions=None, max_tokens_per_run=10**9)
        worker = Worker(engine, Settings(data_dir=tmp, sources={}, proxy=False), clock, harness, tools=tools)
        with write(engine) as conn:
            owner, _ = users.ensure_user(conn, name="owner", now=clock.now())
            session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
            task_id = control.create_task(conn, user_id=owner, session_id=session_id, title="Hong Kong trip",
                                          constraints={"max_amount_cents": 150_000}, now=clock.now())
        asked: list[tuple[int, int]] = []  # per wake: the model's requests, as a slice of `model.seen`
        for k in range(1, WAKES + 1):
            if k > 1:
                _before(engine, clock, k, owner=owner, task_id=task_id, session_id=session_id)
            model.script.extend(PLAN.get(k, [quiet("nothing new")]))
            start = len(model.seen)
            worker.run_once()
            asked.append((start, len(model.seen)))
            clock.advance(timedelta(hours=6))
        tools.close()
        with read(engine) as conn:
            sizes = wake_sizes(conn, session_id)
            tails = {r.run_id: json.loads(r.tail) for r in conn.execute(select(run_contexts.c.run_id,
                                                                              run_contexts.c.tail))}
        engine.dispose()
    whole = fresh = ""
    wakes = []
    for size, (first, last) in zip(sizes, asked, strict=True):
        tail = tails[size.run_id]
        events_only = render_tail({"now": tail["now"], "events": tail["events"]})  # the tail before it had history
        prefix, conversation = model.seen[first].prefix, model.seen[last - 1].messages[1:]
        previous_whole, previous_fresh = whole, fresh
        whole = (whole or prefix) + "\n\n" + events_only + "\n\n" + json.dumps(conversation)
        fresh = prefix + "\n\n" + events_only
        wakes.append(Wake(sent=size.sent_bytes, reused=size.reused_bytes, whole=len(whole.encode()),
                          whole_reused=len(previous_whole.encode()),
                          fresh=len(fresh.encode()), fresh_reused=len(commonprefix([previous_fresh, fresh]).encode())))
    return wakes


def _before(engine: Engine, clock: FakeClock, k: int, *, owner: str, task_id: str, session_id: str) -> None:
    """What happens before wake `k`: the user steers or approves, and one delivery arrives."""
    with write(engine) as conn:
        if k == 6:
            control.steer(conn, user_id=owner, task_id=task_id, goal="Hong Kong trip; the meeting is Thursday",
                          constraints={"max_amount_cents": 120_000}, actor="user:bench", now=clock.now())
        if k == 11:
            action_id = conn.execute(select(actions.c.id).where(actions.c.task_id == task_id)
                                     .order_by(actions.c.id.desc())).scalars().first()
            approvals.decide(conn, user_id=owner, action_id=str(action_id), approve=True, actor="user:bench",
                             policy=Policy(), now=clock.now())
        source = ("mail", "airline", "check")[k % 3]
        inbox.record(conn, inbox.Delivery(user_id=owner, source=source, source_id=f"{source}-{k}",
                                          payload={"body": BODY, "n": k}, session_id=session_id), now=clock.now())
    clock.advance(timedelta(minutes=5))


def _kb(n: int) -> str:
    return f"{n / 1024:.1f} KB (~{n // 4} tok)"


def _share(reused: int, sent: int) -> str:
    return f"{reused / sent:.0%}"


def run(quick: bool) -> list[Table]:
    with tempfile.TemporaryDirectory() as tmp:
        wakes = delegation(Path(tmp))
    rows = [Row(f"wake {k}: bytes given, reused from wake {k - 1}",
                f"{_kb(w.sent)}, {_share(w.reused, w.sent)}",
                f"whole {_kb(w.whole)}, {_share(w.whole_reused, w.whole)} | new {_kb(w.fresh)}, "
                f"{_share(w.fresh_reused, w.fresh)}")
            for k, w in enumerate(wakes, start=1)]
    later = wakes[1:]

    def total(field: str) -> int:
        return sum(getattr(w, field) for w in wakes)

    rows += [
        Row("mean share reused, wakes 2..", _share(sum(w.reused for w in later), sum(w.sent for w in later)),
            f"whole {_share(sum(w.whole_reused for w in later), sum(w.whole for w in later))} | new "
            f"{_share(sum(w.fresh_reused for w in later), sum(w.fresh for w in later))}"),
        Row(f"bytes given over {len(wakes)} wakes", _kb(total("sent")),
            f"whole {_kb(total('whole'))} | new {_kb(total('fresh'))}"),
        Row("bytes not served by a prefix cache", _kb(total("sent") - total("reused")),
            f"whole {_kb(total('whole') - total('whole_reused'))} | new "
            f"{_kb(total('fresh') - total('fresh_reused'))}"),
    ]
    notes = [f"one delegation, {len(wakes)} wakes, in process (SQLite, fake clock, scripted model, merchant "
             "simulator on loopback); tokens ~ bytes / 4 (no tokenizer installed)",
             f"the snapshot is refreshed at the session's runs 0, {COMPACT_EVERY}, … (wake {COMPACT_EVERY + 1} "
             "re-reads it); the steer to v2 lands before wake 6 and rides in the tail until then",
             "baselines: whole = one conversation continued (append-only, grows each wake); new = prefix and this "
             "wake's events only (small, but the model knows nothing of earlier wakes)"]
    return [Table(title="context: bytes per wake of one delegation and the prefix reused across wakes", rows=rows,
                  reproduce=reproduce("context.py", quick), notes=notes)]


if __name__ == "__main__":
    args = bench_args(__doc__.splitlines()[0])
    print_and_save(run(args.quick), "context.txt")
