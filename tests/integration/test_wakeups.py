"""Wake-ups between processes (`server.core.wakeups`): the API side's relayed signals reach the worker side's
listener through the real channel — a Unix datagram socket on SQLite, LISTEN/NOTIFY on PostgreSQL."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest
from sqlalchemy import Engine

from wakeful.server.core.wakeups import Signals, listener_for, sender_for, wake_socket
from wakeful.server.errors import Conflict

BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)


@BOTH
def test_a_relayed_signal_wakes_the_same_loop_on_the_listening_side(engine: Engine, tmp_path: Path) -> None:
    heard: queue.Queue[tuple[str, int]] = queue.Queue()
    worker = Signals()
    listener = listener_for(engine, tmp_path)

    def on_wake(loop: str, received: int) -> None:
        worker.woken(loop)
        heard.put((loop, received))

    listener.start(on_wake)
    sender = sender_for(engine, tmp_path, lambda: 41)
    api = Signals.relayed(sender.send)
    try:
        api.dispatch.set()
        assert worker.dispatch.wait(timeout=10), "the worker's dispatcher was not woken"
        assert not worker.timers.is_set()
        while (said := heard.get(timeout=10))[0] != "dispatch":  # PostgreSQL's listener looks once when it starts
            pass
        assert said == ("dispatch", 41)
    finally:
        sender.close()
        listener.stop()


def test_the_wake_socket_is_the_owners_alone_and_goes_with_the_worker(engine: Engine, tmp_path: Path) -> None:
    listener = listener_for(engine, tmp_path)
    listener.start(lambda loop, received: None)
    assert wake_socket(tmp_path).stat().st_mode & 0o777 == 0o600
    listener.stop()
    assert not wake_socket(tmp_path).exists()


def test_a_second_listener_on_one_sqlite_database_is_refused(engine: Engine, tmp_path: Path) -> None:
    first = listener_for(engine, tmp_path)
    first.start(lambda loop, received: None)
    try:
        with pytest.raises(Conflict) as refused:
            listener_for(engine, tmp_path).start(lambda loop, received: None)
        assert refused.value.code == "worker_running"
    finally:
        first.stop()
    second = listener_for(engine, tmp_path)  # the lock went with the first
    second.start(lambda loop, received: None)
    second.stop()


def test_a_wake_up_with_no_worker_listening_is_dropped_without_waiting(engine: Engine, tmp_path: Path) -> None:
    sender = sender_for(engine, tmp_path, lambda: 0)
    done = threading.Event()

    def send() -> None:
        sender.send("work")
        done.set()

    threading.Thread(target=send, daemon=True).start()
    assert done.wait(timeout=10)
    sender.close()
