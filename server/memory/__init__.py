"""Memory: what the agent learnt about its user, with provenance, scope and time — shaping plans, never authority.

Modules: `recall` (the records a wake's context carries, as of the run's start).
May import: `server.store`, `server.errors`; nothing from `acting`, `egress` or `proxy`. Nothing in an authorization
path imports it (`tests/unit/test_memory_never_authorizes.py`).
"""

from wakeful.server.memory.recall import Recall, recall

__all__ = [
    "Recall",
    "recall",
]
