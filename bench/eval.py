"""Wall time of the scripted evaluation scenarios: the subscription cancellation, and every day of the Hong Kong
trip.

Each trial is what `wakeful eval` runs: a fresh data directory, the simulators and a runtime serving the HTTP app on
loopback, the scenario, the judgement, and everything stopped again. Baseline: the same world started and stopped
with an empty scenario (what a trial costs before it does anything), measured in the same run. Target: the whole
scripted trip in 60 s or less, printed beside the cancellation.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median

from _common import Row, Table, bench_args, print_and_save, reproduce, verdict

from wakeful.server.evals.agents import scripted
from wakeful.server.evals.catalog import SCENARIOS
from wakeful.server.evals.runner import run_trial
from wakeful.server.evals.scenario import Scenario, check
from wakeful.server.faces.http import create_app

TRIP_TARGET_SECONDS = 60.0
EMPTY = Scenario(name="empty", family="bench", summary="starts and stops the world", sims=("merchant",),
                 playbook=SCENARIOS["cancel-lost-response"].playbook, play=lambda _w: [check("nothing", True, None)])


def seconds(scenario: Scenario, repeats: int) -> float:
    """The median wall time of `repeats` trials; raises if any failed (a failed trial's time means nothing)."""
    times = []
    for number in range(1, repeats + 1):
        trial = run_trial(scenario, number, model=lambda s: scripted(s.playbook),  # type: ignore[arg-type]
                          app_factory=lambda rt: create_app(rt, manage_runtime=False), timeout=60, faults={})
        if not trial.passed:
            raise SystemExit(f"{scenario.name} failed: {[c for c in trial.checks if not c.passed]}")
        times.append(trial.seconds)
    return median(times)


def trip_days() -> Sequence[Scenario]:
    return [s for s in SCENARIOS.values() if s.name.startswith("hk-")]


def run(quick: bool) -> list[Table]:
    repeats = 1 if quick else 3
    empty = seconds(EMPTY, repeats)
    cancel = seconds(SCENARIOS["cancel-lost-response"], repeats)
    days = {s.name: seconds(s, repeats) for s in trip_days()}
    trip = sum(days.values())
    return [Table(
        title="Scripted evaluation scenarios: wall time per trial (median)",
        rows=[Row("cancellation, response lost (cancel-lost-response)", f"{cancel:.2f} s", f"{empty:.2f} s"),
              *[Row(f"  {name}", f"{t:.2f} s", f"{empty:.2f} s") for name, t in days.items()],
              Row(f"the whole Hong Kong trip, {len(days)} scenarios", f"{trip:.2f} s", f"{empty * len(days):.2f} s",
                  f"<= {TRIP_TARGET_SECONDS:.0f} s", verdict(trip <= TRIP_TARGET_SECONDS))],
        reproduce=reproduce("eval.py", quick),
        notes=["baseline: the same world (simulators, runtime, HTTP app) started and stopped with an empty scenario"])]


if __name__ == "__main__":
    args = bench_args(__doc__ or "")
    print_and_save(run(args.quick), "eval.txt")
