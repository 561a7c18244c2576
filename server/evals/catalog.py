"""Every scenario by name, in the order `wakeful eval` runs them."""

from __future__ import annotations

from collections.abc import Sequence

from wakeful.server.evals import cancellation, hongkong, memory, memory_repair, memory_sources, paired
from wakeful.server.evals.scenario import Scenario

__all__ = ["SCENARIOS", "select"]

SCENARIOS: dict[str, Scenario] = {s.name: s for s in [*cancellation.SCENARIOS, *paired.SCENARIOS, *hongkong.SCENARIOS,
                                                       *memory.SCENARIOS, *memory_sources.SCENARIOS,
                                                       *memory_repair.SCENARIOS]}


def select(names: Sequence[str]) -> list[Scenario]:
    """The named scenarios (all when none is named); an unknown name is a ValueError listing the known ones."""
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"no scenario named {', '.join(unknown)}; `wakeful eval --list` shows them")
    return [SCENARIOS[n] for n in names] if names else list(SCENARIOS.values())
