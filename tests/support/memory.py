"""Memory records for recall tests, written straight into the tables (the committer's rules are tested on their own):
one active version with its topics, and a retirement as the committer would stamp it."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import Connection, update

from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import MemoryForm, MemoryScope, MemoryState, Speaker, memories, memory_topics


def seed(conn: Connection, *, user_id: str, text: str, subject: str, relation: str, value: str, at: datetime,
         form: MemoryForm = MemoryForm.PREFERENCE, scope: MemoryScope = MemoryScope.ALWAYS,
         scope_ref: str | None = None, state: MemoryState = MemoryState.ACTIVE, speaker: Speaker = Speaker.USER,
         speaker_name: str = "user", topics: Sequence[str] = (), valid_from: datetime | None = None,
         valid_until: datetime | None = None, task_id: str | None = None, run_id: str | None = None,
         confirmed_by: str | None = None) -> str:
    """One record's first version, recorded at `at`; its topics are its subject and `topics`."""
    memory_id = new_id("mem")
    conn.execute(memories.insert().values(
        id=memory_id, user_id=user_id, lineage_id=memory_id, version=1, form=form.value, state=state.value,
        subject=subject, relation=relation, value=value, text=text, scope=scope.value, scope_ref=scope_ref,
        speaker=speaker.value, speaker_name=speaker_name, review=False, run_id=run_id, task_id=task_id,
        confirmed_by=confirmed_by, confirmed_at=at if confirmed_by else None, valid_from=valid_from or at,
        valid_until=valid_until, recorded_at=at))
    conn.execute(memory_topics.insert(), [{"memory_id": memory_id, "topic": t, "user_id": user_id}
                                          for t in dict.fromkeys([subject, *topics])])
    return memory_id


def retire(conn: Connection, memory_id: str, *, reason: str, at: datetime, by: str = "user") -> None:
    conn.execute(update(memories).where(memories.c.id == memory_id).values(
        state=MemoryState.RETIRED.value, retired_at=at, retire_reason=reason, retired_by=by))
