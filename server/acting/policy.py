"""The user's policy (`policies/policy.toml`): risk tiers, auto-approval rules, budgets and time limits.

Policy is control state the user edits; nothing a model, a tool or an event says can change it. The risk tier of
a write is the connector's declared tier, overridden per tool here, and lowered to `auto` only by a named rule
(recorded as the approver) whose amount ceiling the action fits under.
"""

from __future__ import annotations

import tomllib
from datetime import timedelta
from pathlib import Path

from pydantic import BaseModel, Field, ValidationError

from wakeful.server.acting.admission import Budgets
from wakeful.server.errors import BadRequest
from wakeful.server.store.tables import Risk

__all__ = ["AutoRule", "Policy", "load_policy"]


class AutoRule(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    tool: str
    """The tool (`connector__operation`) this rule approves."""
    max_amount_cents: int | None = Field(default=None, ge=0)
    """Approve only actions at or under this amount; None: any amount (budgets still apply)."""


class Policy(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}

    per_action_cents: int | None = Field(default=None, ge=0)
    task_total_cents: int | None = Field(default=None, ge=0)
    daily_cents: int | None = Field(default=None, ge=0)
    approval_ttl: timedelta = timedelta(hours=24)
    """How long a user's approval stays valid."""
    object_ttl: timedelta = timedelta(hours=6)
    """How long a server-issued object ID stays usable after the read that minted it."""
    reconcile_window: timedelta = timedelta(minutes=30)
    """How long an unknown outcome is reconciled before the user is told what is and is not known."""
    verify_window: timedelta = timedelta(hours=24)
    """How long an accepted effect is re-read for the task's verification (a provider still "processing") before the
    reads stop and the user is told what the provider last said."""
    tiers: dict[str, Risk] = Field(default_factory=dict)
    """Per-tool overrides of the connector's declared risk tier."""
    rules: tuple[AutoRule, ...] = ()

    @property
    def budgets(self) -> Budgets:
        return Budgets(per_action_cents=self.per_action_cents, task_total_cents=self.task_total_cents,
                       daily_cents=self.daily_cents)

    def tier(self, tool: str, declared: Risk, amount_cents: int | None) -> tuple[Risk, str | None]:
        """(risk, the auto rule that applies) for this tool and amount."""
        tier = self.tiers.get(tool, declared)
        if tier is Risk.DENY:
            return tier, None
        for rule in self.rules:
            if rule.tool == tool and (rule.max_amount_cents is None or (amount_cents or 0) <= rule.max_amount_cents):
                return Risk.AUTO, rule.name
        return tier, None


def load_policy(path: Path) -> Policy:
    """The policy in `path`, or the defaults when the file does not exist. Errors name the file and the field."""
    if not path.exists():
        return Policy()
    try:
        data = tomllib.loads(path.read_text())
        return Policy.model_validate(data)
    except tomllib.TOMLDecodeError as exc:
        raise BadRequest("invalid_policy", f"{path}: {exc}", file=str(path)) from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise BadRequest("invalid_policy", f"{path}: {problems}", file=str(path)) from None
