"""Does a steer widen a delegation? Pure rules over two task versions; `core.steers` is the shell around them.

The agent may narrow what it was delegated, never widen it (principle 9). What cannot be shown to narrow counts as
widening:

    goal          free text: no rule can show new words ask for less, so any change widens
    completion    when the task counts as done: any change widens (sooner is a false "done", later is more time)
    constraints   a key named `max_…` holding a number is a ceiling: lowering one or adding one narrows; raising or
                  removing one widens. Any other key (a scope, a list of recipients …) may only stay as it was.

Each widening is said in plain words, for the card that asks the user.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_CEILING", "Delegation", "ceiling_problem", "over_ceilings", "widenings"]

_SHOWN = 80
"""Characters of a value a widening quotes: enough to recognise it, never a wall of text on a card."""


@dataclass(frozen=True, kw_only=True)
class Delegation:
    """What one task version asks for and allows, as JSON values (so a stored and a proposed one compare)."""

    goal: str
    constraints: Mapping[str, Any]
    completion: Sequence[Any]

    @classmethod
    def of(cls, *, goal: str, constraints: Mapping[str, Any], completion: Sequence[Any]) -> Delegation:
        return cls(goal=goal, constraints=json.loads(json.dumps(dict(constraints))),
                   completion=json.loads(json.dumps(list(completion))))


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= _SHOWN else text[:_SHOWN - 1] + "…"


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _ceiling(key: str) -> bool:
    return key.startswith("max_")


MAX_CEILING = 2**53
"""The largest ceiling a constraint may hold: every number up to it compares exactly, in JSON readers too."""


def ceiling_problem(key: str, value: Any) -> str | None:
    """What is wrong with a constraint as a task version may hold it (None: nothing): a `max_…` key is a ceiling, a
    number from 0 to `MAX_CEILING` (not negative, not NaN or infinite, not too large to compare)."""
    if not _ceiling(key) or (_number(value) and math.isfinite(value) and 0 <= value <= MAX_CEILING):
        return None
    return f"{key} is a ceiling: a number from 0 to {MAX_CEILING}, not {_shown(value)}"


def _constraint_widening(key: str, old: Any, new: Any, *, had: bool, has: bool) -> str | None:
    """How changing one constraint widens the delegation, or None when it keeps or narrows it."""
    if had and has and old == new:
        return None
    if _ceiling(key) and has and _number(new):
        if not had:
            return None  # a new ceiling
        if _number(old):
            return None if new <= old else f"raises {key} from {_shown(old)} to {_shown(new)}"
    if not has:
        return f"removes {key} (was {_shown(old)})"
    if not had:
        return f"adds {key} = {_shown(new)}"
    return f"changes {key} from {_shown(old)} to {_shown(new)}"


def widenings(old: Delegation, new: Delegation) -> tuple[str, ...]:
    """Each way `new` asks for more than `old`, in plain words; empty when it narrows or keeps every part."""
    found: list[str] = []
    if new.goal != old.goal:
        found.append(f"changes the goal from {_shown(old.goal)} to {_shown(new.goal)}")
    for key in sorted(set(old.constraints) | set(new.constraints)):
        said = _constraint_widening(key, old.constraints.get(key), new.constraints.get(key),
                                    had=key in old.constraints, has=key in new.constraints)
        if said is not None:
            found.append(said)
    if list(new.completion) != list(old.completion):
        found.append(f"changes the completion conditions from {_shown(old.completion)} to {_shown(new.completion)}")
    return tuple(found)


def over_ceilings(constraints: Mapping[str, Any], ceilings: Mapping[str, int | None]) -> tuple[str, ...]:
    """Each `max_…` constraint above the user's own ceiling for it (None: the user set none), in plain words."""
    return tuple(f"{key} = {_shown(constraints[key])} is not within your limit of {ceiling}"
                 for key, ceiling in sorted(ceilings.items())
                 if ceiling is not None and key in constraints
                 and not (_number(constraints[key]) and constraints[key] <= ceiling))
