"""`wakeful eval`: run the scenarios (server.evals) and judge them by the simulators' records and the ledger.

The table goes to stdout, progress to stderr, the whole report (every check with its evidence) to `--json PATH`.
The exit code is 1 when any trial failed; pending scenarios (mechanisms not built yet) are listed, never failed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from pydantic import ValidationError

from wakeful.server.faces.cli_common import err, say
from wakeful.server.settings import ConfigFileError, load_settings

if TYPE_CHECKING:
    from wakeful.server.evals.runner import ModelFactory, Trial
    from wakeful.server.evals.scenario import Scenario
    from wakeful.server.harness.model import ModelAdapter
    from wakeful.server.runtime import Runtime

__all__ = ["eval_cmd"]

# The scenarios, the simulators and the HTTP app are imported by the command itself, not with this module: every
# `wakeful` process (the egress proxy child among them) imports the command line, and they would add a second to
# each start.

MODELS = ("scripted", "anthropic")


def _listing() -> str:
    from wakeful.server.evals.catalog import SCENARIOS

    width = max(len(name) for name in SCENARIOS)
    lines = []
    for s in SCENARIOS.values():
        state = "pending" if s.pending else "ready"
        lines.append(f"{s.name:<{width}}  {state:<7}  {s.family}: {s.summary}"
                     + (f" [needs: {s.needs}]" if s.pending else ""))
    return "\n".join(lines)


def _faults(given: list[str]) -> dict[str, dict[str, Any]]:
    """`SIM.KNOB=VALUE` (VALUE as JSON: 3, true, 0.5) into {sim: {knob: value}}."""
    from wakeful.server.sims.fleet import SIMULATORS

    faults: dict[str, dict[str, Any]] = {}
    for item in given:
        target, equals, raw = item.partition("=")
        sim, dot, knob = target.partition(".")
        if not (equals and dot and knob) or sim not in SIMULATORS:
            say("bad_fault", f"{item!r}: write SIM.KNOB=VALUE with SIM one of {', '.join(SIMULATORS)}, "
                             "e.g. merchant.fail_before_commit=3")
            raise typer.Exit(2)
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        faults.setdefault(sim, {})[knob] = value
    return faults


def _anthropic() -> ModelFactory:
    """The real model, with the key `wakeful serve` would use; a clear refusal without one."""
    try:
        settings = load_settings()
    except (ConfigFileError, ValidationError) as exc:
        say("invalid_settings", str(exc).splitlines()[0])
        raise typer.Exit(2) from None
    if settings.anthropic_api_key is None:
        say("no_model_key", "--model anthropic needs ANTHROPIC_API_KEY (or WAKEFUL_ANTHROPIC_API_KEY) set")
        raise typer.Exit(2)
    from wakeful.server.harness.model_anthropic import AnthropicModel

    key, name = settings.anthropic_api_key.get_secret_value(), settings.model

    def real(_scenario: Scenario) -> ModelAdapter:
        return AnthropicModel(api_key=key, model=name)
    return real


def _scripted(scenario: Scenario) -> ModelAdapter:
    from wakeful.server.evals.agents import scripted

    assert scenario.playbook is not None, f"{scenario.name} has no scripted part"
    return scripted(scenario.playbook)


def _app(runtime: Runtime) -> Any:
    from wakeful.server.faces.http import create_app

    return create_app(runtime, manage_runtime=False)


def _progress(total: int) -> Any:
    done = [0]

    def show(trial: Trial) -> None:
        done[0] += 1
        failed = [c.name for c in trial.checks if not c.passed]
        err.print(f"[{done[0]}/{total}] {trial.scenario} #{trial.trial}: {trial.status} ({trial.seconds:.1f} s)"
                  + (f" - failed: {'; '.join(failed)}" if failed else ""), markup=False, highlight=False)
    return show


def eval_cmd(names: Annotated[list[str] | None, typer.Argument(help="Scenarios to run (default: all).")] = None,
             list_only: Annotated[bool, typer.Option("--list", help="List the scenarios and exit.")] = False,
             json_path: Annotated[Path | None, typer.Option("--json", help="Write the full report here.")] = None,
             model: Annotated[str, typer.Option(help="scripted (each scenario's playbook) or anthropic.")]
             = "scripted",
             k: Annotated[int, typer.Option("-k", min=1, help="pass^k: how many trials must all pass.")] = 1,
             n: Annotated[int | None, typer.Option("-n", min=1, help="Trials per scenario (default k; n >= k).")]
             = None,
             fault: Annotated[list[str] | None, typer.Option(help="Arm a simulator knob in every scenario: "
                                                                  "SIM.KNOB=VALUE (repeatable).")] = None,
             timeout: Annotated[float, typer.Option(min=1, help="Seconds one wait in a scenario may take.")] = 30.0,
             ) -> None:
    """Run the evaluation scenarios against the simulators; exit 1 if any trial failed."""
    from wakeful.server.evals.catalog import select
    from wakeful.server.evals.runner import report, run_all, table

    if list_only:
        typer.echo(_listing())
        return
    if model not in MODELS:
        say("unknown_model", f"{model!r}: choose scripted or anthropic")
        raise typer.Exit(2)
    trials = n or k
    if trials < k:
        say("bad_trials", f"-n {trials} is fewer than -k {k}: pass^k needs at least k trials")
        raise typer.Exit(2)
    try:
        chosen = select(names or [])
    except ValueError as exc:
        say("unknown_scenario", str(exc))
        raise typer.Exit(2) from None
    faults = _faults(fault or [])
    factory = _anthropic() if model == "anthropic" else _scripted
    total = sum(1 if s.pending else trials for s in chosen)
    results = run_all(chosen, trials=trials, model=factory, app_factory=_app, timeout=timeout, faults=faults,
                      progress=_progress(total))
    document = report(results, k=k, model=model)
    typer.echo(table(document))
    if json_path is not None:
        json_path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    if document["failed"]:
        raise typer.Exit(1)
