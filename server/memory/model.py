"""The values memory passes around: who proposes (`Actor`), what is proposed (`Proposal`, untrusted input: a model's
tool arguments, an HTTP body), what was stored (`Stored`) and what a correction reached (`Reach`).

    Actor        the user, the agent (in a run, or over MCP for a task) or the system
    EvidenceRef  one piece of evidence by ID: an event, decision, approval, action, steer, message, run or memory
    Proposal     a record to commit; its shape is checked here, its meaning by `rules.check`
    Stored       the version the committer wrote (or the change it made)
    Reach        what a correction or a forgetting invalidated, and which runs had recalled the record
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

from wakeful.server.errors import BadRequest
from wakeful.server.store.tables import MemoryForm, MemoryScope

__all__ = ["REF_TYPES", "Actor", "ActorKind", "EvidenceRef", "Proposal", "Reach", "Stored", "parse_proposal"]

REF_TYPES: Final = ("event", "decision", "approval", "action", "steer", "message", "run", "memory")
"""What evidence may name: `message` is an outbox id, `steer` a steer proposal's, `memory` another record."""


_ID: Final = r"^[A-Za-z0-9_.-]+$"


class ActorKind(StrEnum):
    USER = "user"
    AGENT = "agent"
    SYSTEM = "system"


@dataclass(frozen=True, kw_only=True)
class Actor:
    """Who proposes or changes a record."""

    kind: ActorKind
    run_id: str | None = None
    """The run that proposes (the harness face); None over MCP and for the user's hand."""
    task_id: str | None = None
    """The task it acts for: task scope means this task."""
    name: str = ""
    """How records name it: the user's name, `run:<id>`, `mcp`, `system`."""


class EvidenceRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["event", "decision", "approval", "action", "steer", "message", "run", "memory"]
    id: Annotated[str, Field(min_length=1, max_length=40, pattern=_ID)]


class Proposal(BaseModel):
    """A record to commit. Types are checked here; bounds, scope, evidence and authority by `rules.check`, so that
    every refusal of a well-typed proposal is recorded with its code."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # strict=False: the MCP face validates tool arguments strictly, and an enum, a time or a number arrives as JSON
    form: MemoryForm = Field(strict=False, description="instruction (the user's only), preference, fact, "
                                                       "hypothesis, statement, episode, sourced_fact or skill.")
    text: str = Field(description="In plain words, as the model and the user read it (at most 1000 characters).")
    subject: str = Field(description="What it is about, a lowercase identifier: seat, flight.departure, hotel.floor.")
    relation: str = Field(description="A lowercase identifier: prefers, avoids, said, is.")
    value: str = Field(description="The value (window, aisle); contradiction is judged on subject and relation.")
    scope: MemoryScope | None = Field(default=None, strict=False,
                                      description="run (the default in a wake), task, project or always.")
    scope_ref: str | None = Field(default=None, description="A project's name; run and task scopes fill it in.")
    valid_from: AwareDatetime | None = Field(default=None, strict=False, description="ISO 8601 with its offset.")
    valid_until: AwareDatetime | None = Field(default=None, strict=False, description="ISO 8601 with its offset: "
                                                                                       "when it stops holding.")
    evidence: list[EvidenceRef] = Field(default_factory=list, max_length=32,
                                        description="What produced it, by ID: events, decisions, approvals, ...")
    derived_from: list[Annotated[str, Field(min_length=1, max_length=40, pattern=_ID)]] = Field(
        default_factory=list, max_length=16, description="Memory IDs it was derived from (a skill from episodes).")
    confidence: float | None = Field(default=None, strict=False, description="A hypothesis's, in (0, 1].")
    topics: list[Annotated[str, Field(max_length=200)]] = Field(
        default_factory=list, max_length=32, description="What it is recalled for (at most 8 tags).")
    speaker_name: str | None = Field(default=None, description="A sourced fact's source (filled in from evidence).")


def parse_proposal(data: Any) -> Proposal:
    """`data` (a tool's arguments, an HTTP body) as a Proposal, or `invalid_memory` (400) saying what is wrong."""
    try:
        return Proposal.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise BadRequest("invalid_memory", f"{where}: {first['msg']}", field=where) from None


@dataclass(frozen=True, kw_only=True)
class Stored:
    """One version written (or, for a change without a new version, the version it changed)."""

    memory_id: str
    lineage_id: str
    version: int
    state: str
    form: str
    change_id: str
    retired: tuple[str, ...] = ()
    """Versions this one retired as `contradicted`."""
    reach: Reach | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"memory_id": self.memory_id, "version": self.version, "state": self.state,
                               "form": self.form}
        if self.retired:
            out["retired"] = list(self.retired)
        if self.reach is not None:
            out["reach"] = self.reach.to_json()
        return out


@dataclass(frozen=True, kw_only=True)
class Reach:
    """What a correction or a forgetting reached: derived records invalidated (for review), runs that recalled it,
    and the open tasks whose next wake will be told (history is not rewritten)."""

    invalidated: tuple[str, ...] = ()
    runs: tuple[str, ...] = ()
    tasks: tuple[str, ...] = ()
    at: datetime | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"invalidated": list(self.invalidated), "runs": list(self.runs), "tasks": list(self.tasks)}
