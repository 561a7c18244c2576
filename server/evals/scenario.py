"""What a scenario is, and what judging it produces.

A scenario drives one world (`world.EvalWorld`) through the public surfaces and returns its checks; each check is
read from the simulators' own records or the task's ledger and status, and keeps that reading as its evidence. A
scenario whose mechanisms do not exist yet is declared with `needs` and no `play`: the runner reports it pending.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wakeful.server.evals.agents import Playbook
from wakeful.server.evals.world import EvalWorld

__all__ = ["Check", "Scenario", "check"]


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    evidence: Any


def check(name: str, passed: bool, evidence: Any) -> Check:
    return Check(name=name, passed=bool(passed), evidence=evidence)


@dataclass(frozen=True, kw_only=True)
class Scenario:
    name: str
    family: str
    summary: str
    """What it checks, in one sentence (the `--list` line and the docs' table)."""
    sims: tuple[str, ...] = ("merchant",)
    play: Callable[[EvalWorld], list[Check]] | None = None
    playbook: Playbook | None = None
    """The scripted model's part (the default `--model scripted`)."""
    policy: str = ""
    """The user's policy.toml for this scenario."""
    needs: str = ""
    """For a pending scenario: the mechanisms it waits for."""

    @property
    def pending(self) -> bool:
        return self.play is None
