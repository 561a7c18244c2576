"""Who may satisfy a wait: every wait records one authority, every delivery holds one, and the inbox lets a delivery
satisfy only a wait its authority is entitled to.

    user            the user's control channel (an approval or a denial)
    agent           (a sender's only) the agent's own word over MCP: it satisfies no wait
    system          the server itself (what reconciliation found, a timer, a timeout)
    source:<name>   the webhook source <name>
    any_source      (a wait's only) any webhook source: what a run waits for when it names no source

A delivery holds `source:<its source>` unless the server code that builds it says otherwise, and the webhook inbox
never does: the authority comes from the name of the source whose secret signed the delivery, never from its body or
its `trust` setting. So no outside event holds `user` or `system`, and a key the server waits on for itself is out
of every webhook's reach, whatever the key reads. The same holds for session keys: a key binds a session for the
authority that bound it (`server.core.inbox`).
"""

from __future__ import annotations

from wakeful.server.store.tables import SOURCE_PREFIX, Authority

__all__ = ["may_satisfy", "of_source", "satisfiable_by"]


def of_source(name: str) -> str:
    """The authority of a delivery from the webhook source `name` (and of a wait only that source may satisfy)."""
    return f"{SOURCE_PREFIX}{name}"


def satisfiable_by(delivery: str) -> tuple[str, ...]:
    """The authorities of the waits a delivery holding `delivery` may satisfy."""
    if delivery.startswith(SOURCE_PREFIX):
        return delivery, Authority.ANY_SOURCE.value
    return (delivery,)


def may_satisfy(wait: str, delivery: str) -> bool:
    """Whether a delivery holding `delivery` may satisfy a wait recorded with `wait`."""
    return wait in satisfiable_by(delivery)
