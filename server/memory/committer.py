"""The committer: the one door through which a proposed record is stored. It reads the facts a proposal is judged
on (its evidence resolved, the active records on its subject and relation, the user's disowned evidence), asks the
pure rules (`rules.check`), and writes the version, its topics and links and a `memory_changes` row — `committed`,
or `refused` with its code and the proposal — in the caller's transaction.

    propose   commit a proposal for a user, or record its refusal and raise it
    facts     the snapshot `rules.check` judges a proposal on
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Connection

from wakeful.server.memory.model import Actor, Proposal, Stored
from wakeful.server.memory.rules import Facts

__all__ = ["facts", "propose"]


def facts(conn: Connection, *, user_id: str, actor: Actor, proposal: Proposal, now: datetime) -> Facts:
    raise NotImplementedError


def propose(conn: Connection, *, user_id: str, actor: Actor, proposal: Proposal, now: datetime) -> Stored:
    """Commit `proposal` for `user_id` as `actor`: the version (pending or active, as the rules say), its topics,
    links and change. A refusal is recorded (`memory_changes`, memory_id NULL) and raised: `BadRequest` for a
    malformed proposal (`invalid_memory`, `invalid_scope`), `Refused` otherwise (`unknown_evidence`,
    `evidence_disowned`, `third_party_source`, `third_party_directive`, `user_only`, `user_owned`,
    `needs_user_words`, `contradicts_confirmed`)."""
    raise NotImplementedError
