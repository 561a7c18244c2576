"""The user's hand on memory over HTTP (bearer token): read what the agent learnt, write standing instructions,
preferences and facts, confirm or reject what waits for you, edit, correct, forget (docs/memory.md).

    GET  /v1/memory                       the records, oldest first (?form=&state=&review=&task_id=&after=&limit=)
    GET  /v1/memory/{id}                  one record: every version, its evidence, what was derived from it, uses
    POST /v1/memory                       you write: an instruction, a preference or a fact (active at once)
    POST /v1/memory/{id}/confirm|reject   answer a pending record (a hypothesis confirmed becomes a preference)
    POST /v1/memory/{id}/edit             a new version, written by you
    POST /v1/memory/{id}/correct          the repair: its evidence disowned, it and what derives from it retired
    POST /v1/memory/{id}/forget           retired, and what derives from it too
    POST /v1/memory/{id}/reviewed         a retirement you did not make, seen

Every route acts for the token's user only: another user's record answers `404 unknown_memory`, as an unknown one
does. The agent has no route here: its one door to memory is the `remember` tool, through the same committer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from pydantic import AwareDatetime, BaseModel, Field

from wakeful.server.errors import WakefulError
from wakeful.server.faces import memory_views as views
from wakeful.server.faces.auth import User
from wakeful.server.faces.routes import Rt
from wakeful.server.faces.schemas import MemoryChanged, MemoryDetail, MemoryPage, refusals
from wakeful.server.store.db import read, write
from wakeful.server.store.tables import MemoryForm, MemoryScope, MemoryState

__all__ = ["memory_router"]

memory_router = APIRouter()

_Text = Annotated[str, Field(min_length=1, max_length=1000)]
_Name = Annotated[str, Field(min_length=1, max_length=80)]
_Reason = Annotated[str, Field(min_length=1, max_length=1000, description="why, in your words, for the record")]
_ID = r"^[A-Za-z0-9_.-]+$"


class MemoryIn(BaseModel):
    """What you write yourself: stored active, spoken by you, confirmed by this request."""

    model_config = {"extra": "forbid"}
    form: Literal["instruction", "preference", "fact"]
    text: _Text = Field(description="in plain words, as the agent will read it")
    subject: _Name = Field(description="what it is about (`seat`): a lowercase identifier")
    relation: _Name = Field(description="how (`prefers`): a lowercase identifier")
    value: Annotated[str, Field(min_length=1, max_length=200)] = Field(description="(`window`)")
    scope: MemoryScope | None = Field(default=None, description="run, task, project or always; default: always")
    scope_ref: Annotated[str, Field(min_length=1, max_length=200)] | None = Field(
        default=None, description="the task's ID for `task`, a project's name for `project`; none for `always`")
    valid_from: AwareDatetime | None = None
    valid_until: AwareDatetime | None = None
    topics: list[_Name] = Field(default_factory=list, max_length=8, description="what it is recalled for, besides "
                                                                                "its subject")


class EditIn(BaseModel):
    """A new version, written by you; a field left out keeps its value."""

    model_config = {"extra": "forbid"}
    text: _Text | None = None
    value: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    scope: MemoryScope | None = None
    scope_ref: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    valid_until: AwareDatetime | None = None


class CorrectIn(BaseModel):
    model_config = {"extra": "forbid"}
    reason: _Reason
    text: _Text | None = Field(default=None, description="what is true instead, kept as your statement")


class ForgetIn(BaseModel):
    model_config = {"extra": "forbid"}
    reason: _Reason


_FOUND = ("unknown_memory",)
_MOVED = ("unknown_memory", "invalid_transition")


@memory_router.get("/v1/memory", response_model=MemoryPage)
def list_memory(user: User, rt: Rt, limit: Annotated[int, Query(ge=1, le=200, description="rows per page")] = 50,
                form: Annotated[MemoryForm | None, Query()] = None,
                state: Annotated[MemoryState | None, Query()] = None,
                review: Annotated[bool | None, Query(description="only records retired by someone else, awaiting "
                                                                 "your review (true), or only others (false)")] = None,
                task_id: Annotated[str | None, Query(max_length=40, pattern=_ID,
                                                     description="records learnt in this task")] = None,
                after: Annotated[str | None, Query(max_length=40, pattern=_ID,
                                                   description="the `next` of the previous page")] = None,
                ) -> dict[str, Any]:
    """Your records, the latest version of each, in the order they were recorded (retired ones too, unless `state`
    says otherwise)."""
    with read(rt.engine) as conn:
        return views.page(conn, user, form=form, state=state, review=review, task_id=task_id, after=after,
                          limit=limit)


@memory_router.get("/v1/memory/{memory_id}", response_model=MemoryDetail, responses=refusals(*_FOUND))
def show_memory(user: User, rt: Rt, memory_id: str) -> dict[str, Any]:
    with read(rt.engine) as conn:
        return views.detail(conn, user, memory_id)


@memory_router.post("/v1/memory", status_code=201, response_model=MemoryChanged, response_model_exclude_unset=True,
                    responses=refusals("invalid_memory", "invalid_scope"))
def add_memory(user: User, rt: Rt, body: MemoryIn) -> dict[str, Any]:
    """You write a standing instruction, a preference or a fact: active at once, spoken by you."""
    with write(rt.engine) as conn:
        added = views.add(conn, user, body.model_dump(), now=rt.clock.now())
    if isinstance(added, WakefulError):
        raise added  # its refusal is recorded: committed above
    return added


@memory_router.post("/v1/memory/{memory_id}/confirm", response_model=MemoryChanged, response_model_exclude_unset=True,
                    responses=refusals(*_MOVED, "invalid_memory", "invalid_scope"))
def confirm_memory(user: User, rt: Rt, memory_id: str) -> dict[str, Any]:
    """A pending record becomes active (a hypothesis becomes a preference), confirmed by you."""
    with write(rt.engine) as conn:
        return views.confirm(conn, user, memory_id, now=rt.clock.now())


@memory_router.post("/v1/memory/{memory_id}/reject", response_model=MemoryChanged, response_model_exclude_unset=True,
                    responses=refusals(*_MOVED))
def reject_memory(user: User, rt: Rt, memory_id: str) -> dict[str, Any]:
    """A pending record is retired, rejected: never recalled."""
    with write(rt.engine) as conn:
        return views.reject(conn, user, memory_id, now=rt.clock.now())


@memory_router.post("/v1/memory/{memory_id}/edit", response_model=MemoryChanged, response_model_exclude_unset=True,
                    responses=refusals(*_MOVED, "invalid_memory", "invalid_scope", "third_party_directive"))
def edit_memory(user: User, rt: Rt, memory_id: str, body: EditIn) -> dict[str, Any]:
    """A new version in your words, judged by the same rules as every record: a third party's sourced fact is never
    edited into an order to the agent (`403 third_party_directive`)."""
    with write(rt.engine) as conn:
        return views.edit(conn, user, memory_id, body.model_dump(exclude_unset=True), now=rt.clock.now())


@memory_router.post("/v1/memory/{memory_id}/correct", response_model=MemoryChanged,
                    response_model_exclude_unset=True, responses=refusals(*_MOVED, "invalid_memory"))
def correct_memory(user: User, rt: Rt, memory_id: str, body: CorrectIn) -> dict[str, Any]:
    """The repair: the evidence that produced the record is disowned (it never supports a preference again), the
    record is retired `corrected`, your `text` is kept as your statement, and what was derived from it is
    invalidated."""
    with write(rt.engine) as conn:
        return views.correct(conn, user, memory_id, reason=body.reason, text=body.text, now=rt.clock.now())


@memory_router.post("/v1/memory/{memory_id}/forget", response_model=MemoryChanged, response_model_exclude_unset=True,
                    responses=refusals(*_MOVED, "invalid_memory"))
def forget_memory(user: User, rt: Rt, memory_id: str, body: ForgetIn) -> dict[str, Any]:
    """Retired `forgotten` (kept, never recalled), and what was derived from it invalidated."""
    with write(rt.engine) as conn:
        return views.forget(conn, user, memory_id, reason=body.reason, now=rt.clock.now())


@memory_router.post("/v1/memory/{memory_id}/reviewed", response_model=MemoryChanged,
                    response_model_exclude_unset=True, responses=refusals(*_MOVED))
def mark_reviewed(user: User, rt: Rt, memory_id: str) -> dict[str, Any]:
    """A retirement someone else made (a contradiction, an invalidation), seen by you: no longer flagged."""
    with write(rt.engine) as conn:
        return views.reviewed(conn, user, memory_id, now=rt.clock.now())
