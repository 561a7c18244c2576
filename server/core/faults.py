"""Fault injection for the crash tests: die abruptly (`os._exit`) at a named protocol point.

Configured once per process from `Settings.crash_at` (`point[:probability],...`); without it every call is a
dictionary lookup that finds nothing. The points:

    after_event_commit     the delivery is durable, the 2xx has not been sent
    after_claim            a worker holds the session, the run has not started
    before_run_commit      the run did its work, its commit has not happened
    after_outbox_write     the run committed its outbox rows, nothing was dispatched
    after_dispatch         the receiver accepted a message, it is not yet marked sent
    after_attempt_persisted  an action's attempt is committed, its request has not been sent
    after_send             the remote answered an action's request, the outcome is not yet recorded
"""

from __future__ import annotations

import os
import random
import sys

__all__ = ["POINTS", "configure", "crash_point"]

POINTS = ("after_event_commit", "after_claim", "before_run_commit", "after_outbox_write", "after_dispatch",
          "after_attempt_persisted", "after_send")
EXIT_CODE = 77

_armed: dict[str, float] = {}


def configure(spec: str) -> None:
    _armed.clear()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, probability = part.partition(":")
        if name not in POINTS:
            raise ValueError(f"unknown crash point {name!r}; known: {', '.join(POINTS)}")
        _armed[name] = float(probability or 1.0)


def crash_point(name: str) -> None:
    probability = _armed.get(name)
    if probability is not None and random.random() < probability:
        print(f"wakeful: crash point {name} reached, exiting", file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)
