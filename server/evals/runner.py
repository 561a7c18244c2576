"""Run scenarios: each trial in a fresh world, judged by its checks; results as a table and a JSON report.

A trial passes when every check passes. A scenario that raises (a wait that ran out, an HTTP error) fails with the
error as its evidence; a pending scenario is reported `pending`, neither a pass nor a failure.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from wakeful.server.acting.ledger import describe
from wakeful.server.evals.passk import pass_hat_k
from wakeful.server.evals.scenario import Check, Scenario, check
from wakeful.server.evals.world import AppFactory, EvalWorld, Gave, world
from wakeful.server.harness.model import ModelAdapter

__all__ = ["ModelFactory", "Trial", "report", "run_trial", "run_all", "table"]

TAIL = 25
"""How many ledger entries a failed trial shows."""
ModelFactory = Callable[[Scenario], ModelAdapter]
"""The model one trial of a scenario runs with: its scripted playbook, or the real model."""


@dataclass(frozen=True)
class Trial:
    scenario: str
    trial: int
    status: str
    """passed, failed or pending"""
    checks: tuple[Check, ...]
    seconds: float
    needs: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_trial(scenario: Scenario, trial: int, *, model: ModelFactory, app_factory: AppFactory,
              timeout: float, faults: dict[str, dict[str, Any]]) -> Trial:
    if scenario.play is None:
        return Trial(scenario=scenario.name, trial=trial, status="pending", checks=(), seconds=0.0,
                     needs=scenario.needs)
    started = time.monotonic()
    checks = _play(scenario, model, app_factory, timeout, faults)
    status = "passed" if checks and all(c.passed for c in checks) else "failed"
    return Trial(scenario=scenario.name, trial=trial, status=status, checks=tuple(checks),
                 seconds=round(time.monotonic() - started, 2))


def _play(scenario: Scenario, model: ModelFactory, app_factory: AppFactory, timeout: float,
          faults: dict[str, dict[str, Any]]) -> list[Check]:
    assert scenario.play is not None
    with world(scenario.sims, model=model(scenario), app_factory=app_factory, policy=scenario.policy,
               timeout=timeout) as w:
        try:
            for sim, knobs in faults.items():
                if sim in w.sims:
                    w.faults(sim, **knobs)
            return scenario.play(w)
        except Exception as exc:  # a scenario's error is its failure, shown with what went wrong and where it was
            return [check("the scenario ran to its end", False, {
                "error": str(exc) if isinstance(exc, Gave) else "".join(traceback.format_exception_only(exc)).strip(),
                "ledger_tail": _tail(w)})]


def _tail(w: EvalWorld) -> list[str]:
    """The last entries of the last task's ledger, one line each (or why they could not be read)."""
    if not w.tasks:
        return []
    try:
        entries = w.ledger(w.tasks[-1])
    except Exception as exc:
        return [f"(the ledger could not be read: {exc})"]
    return [describe(e) for e in entries[-TAIL:]]


def run_all(scenarios: Iterable[Scenario], *, trials: int, model: ModelFactory, app_factory: AppFactory,
            timeout: float = 30.0, faults: dict[str, dict[str, Any]] | None = None,
            progress: Callable[[Trial], None] = lambda _: None) -> list[Trial]:
    results = []
    for scenario in scenarios:
        for number in range(1, (1 if scenario.pending else trials) + 1):
            trial = run_trial(scenario, number, model=model, app_factory=app_factory, timeout=timeout,
                              faults=faults or {})
            progress(trial)
            results.append(trial)
    return results


def _by_scenario(results: list[Trial]) -> dict[str, list[Trial]]:
    grouped: dict[str, list[Trial]] = {}
    for trial in results:
        grouped.setdefault(trial.scenario, []).append(trial)
    return grouped


def report(results: list[Trial], *, k: int, model: str) -> dict[str, Any]:
    """The JSON report: every trial with its checks and evidence, and pass^k per scenario and overall."""
    grouped = _by_scenario(results)
    scored = {name: pass_hat_k(len(ts), sum(t.passed for t in ts), k)
              for name, ts in grouped.items() if ts[0].status != "pending"}
    return {
        "model": model, "k": k,
        "trials": [{**asdict(t), "passed": t.passed, "checks": [asdict(c) for c in t.checks]} for t in results],
        "scenarios": {name: {"status": _status(ts), "trials": len(ts), "passed": sum(t.passed for t in ts),
                             "pass^k": scored.get(name), "needs": ts[0].needs} for name, ts in grouped.items()},
        "pass^k": sum(scored.values()) / len(scored) if scored else None,
        "failed": sum(t.status == "failed" for t in results),
        "pending": sorted(name for name, ts in grouped.items() if ts[0].status == "pending"),
    }


def _status(trials: list[Trial]) -> str:
    if trials[0].status == "pending":
        return "pending"
    return "passed" if all(t.passed for t in trials) else "failed"


def table(document: dict[str, Any]) -> str:
    """The report as a plain table: one line per scenario, then the overall pass^k."""
    width = max([len("scenario"), *(len(n) for n in document["scenarios"])])
    k = document["k"]
    lines = [f"{'scenario':<{width}}  {'status':<8} {'passed':>7}  pass^{k}"]
    for name, s in document["scenarios"].items():
        score = "" if s["pass^k"] is None else f"{s['pass^k']:.3f}"
        passed = "" if s["status"] == "pending" else f"{s['passed']}/{s['trials']}"
        lines.append(f"{name:<{width}}  {s['status']:<8} {passed:>7}  {score}"
                     + (f"  needs: {s['needs']}" if s["status"] == "pending" else ""))
    overall = document["pass^k"]
    lines.append(f"overall pass^{k}: " + ("n/a" if overall is None else f"{overall:.3f}")
                 + f" ({document['failed']} failed trial(s), {len(document['pending'])} pending scenario(s))")
    return "\n".join(lines)
