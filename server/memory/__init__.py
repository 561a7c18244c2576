"""Memory: what the agent learnt about its user, with provenance, scope and time — shaping plans, never authority.

A record is a versioned, bi-temporal row (`store.tables.memories`): proposed by the agent (the `remember` tool) or
written by the user, judged by pure rules (`rules`), stored by one committer (`committer`), changed only by the
user's hand or a contradiction (`records`), recalled into the context TAIL only (`recall`).

This package may import `server.store` and `server.errors`, and nothing from `acting/`, `egress/` or `proxy/`.
Nothing in an authorization path (admission, approvals, verdicts, policy, egress, core.control/authority/widening)
may import it: memory informs, never authorizes.
"""

from __future__ import annotations

from wakeful.server.memory.committer import propose, try_propose
from wakeful.server.memory.model import Actor, ActorKind, EvidenceRef, Proposal, Reach, Stored, parse_proposal
from wakeful.server.memory.recall import Recall, recall
from wakeful.server.memory.records import (
    confirm,
    correct,
    edit,
    expire_task,
    forget,
    list_records,
    mark_reviewed,
    propagate,
    reject,
    show,
    trace,
)

__all__ = ["Actor", "ActorKind", "EvidenceRef", "Proposal", "Reach", "Stored", "confirm", "correct", "edit",
           "expire_task", "forget", "list_records", "mark_reviewed", "parse_proposal", "propagate", "propose",
           "reject", "show", "trace", "try_propose",
           "Recall", "recall"]
