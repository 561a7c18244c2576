"""The committer's rules, pure: `check(proposal, actor, facts)` decides what a proposed record becomes (its state,
form, speaker, scope) or why it is refused, over a snapshot the committer read. In order:

    1. shape       bounded text; subject/relation lowercase identifiers; scope and its ref   invalid_memory,
                                                                                             invalid_scope
    2. evidence    every ref exists and is the user's; disowned refs support no inference  unknown_evidence,
                                                                                             evidence_disowned
    3. source      a third party's content is only ever a sourced fact, never a directive   third_party_source,
                                                                                             third_party_directive
    4. authority   the agent never writes an instruction                                    user_only
    5. the user    what needs the user is stored pending; a statement needs their words;    needs_user_words,
                   an agent's inference names what it was inferred from                     needs_evidence
    6. contradiction  same subject, relation, scope and ref, another value: retire the old  contradicts_confirmed,
                   one (never a wider scope; never the user's own, by the agent)             user_owned
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final

from wakeful.server.memory.model import Actor, ActorKind, Proposal
from wakeful.server.store.tables import SOURCE_PREFIX, MemoryForm, MemoryScope, MemoryState, Speaker

__all__ = ["IDENTIFIER", "MAX_TEXT", "MAX_TOPICS", "MAX_VALUE", "USER_OWNED_FORMS", "Existing", "Facts", "Refusal",
           "Resolved", "Verdict", "check", "directive", "storable", "user_owned"]

IDENTIFIER: Final = re.compile(r"[a-z][a-z0-9_.-]{0,79}")
MAX_TEXT: Final = 1000
MAX_VALUE: Final = 200
MAX_TOPICS: Final = 8
MAX_NAME: Final = 120
MAX_SCOPE_REF: Final = 200
MIN_YEAR: Final = 1970
MAX_YEAR: Final = 9000
USER_OWNED_FORMS: Final = frozenset({MemoryForm.INSTRUCTION, MemoryForm.PREFERENCE, MemoryForm.FACT})
"""Forms a record of the user's own (written or confirmed by them) can take: the agent never retires those."""

MALFORMED: Final = frozenset({"invalid_memory", "invalid_scope"})
"""Refusal codes that mean the proposal was malformed (400); the others are refusals (403)."""


@dataclass(frozen=True, kw_only=True)
class Resolved:
    """One evidence ref as the committer found it (`found` false: absent, or another user's)."""

    type: str
    id: str
    found: bool
    kind: str | None = None        # an event's kind (message, webhook …)
    authority: str | None = None   # an event's sender: user, agent, system, source:<name>
    task_id: str | None = None     # the task it belongs to, when known


@dataclass(frozen=True, kw_only=True)
class Existing:
    """An active (or pending) record of the user on the proposal's subject and relation."""

    id: str
    form: MemoryForm
    state: MemoryState
    scope: MemoryScope
    scope_ref: str | None
    value: str
    speaker: Speaker
    confirmed_by: str | None = None


@dataclass(frozen=True, kw_only=True)
class Facts:
    user_name: str
    evidence: tuple[Resolved, ...] = ()
    disowned: frozenset[tuple[str, str]] = frozenset()
    """(type, id) of the user's disowned evidence."""
    same_key: tuple[Existing, ...] = ()
    """The user's active and pending records on the proposal's subject and relation."""
    derived_found: bool = True
    """Every `derived_from` id is one of the user's records."""
    scope_ref_owned: bool = True
    """The task the actor acts for, and a task or run the user names as scope_ref, are the user's."""


@dataclass(frozen=True, kw_only=True)
class Refusal:
    code: str
    message: str

    @property
    def malformed(self) -> bool:
        return self.code in MALFORMED


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The record to store."""

    form: MemoryForm
    state: MemoryState
    speaker: Speaker
    speaker_name: str
    scope: MemoryScope
    scope_ref: str | None
    topics: tuple[str, ...]
    confidence: float | None
    retire: tuple[str, ...] = ()
    """Active records this one contradicts (same subject, relation, scope and ref): retired `contradicted`."""
    review: bool = False
    """The retirements were not the user's: shown to them."""
    notes: tuple[str, ...] = field(default=())


_IMPERATIVE = re.compile(
    r"^\W*(forward|send|pay|transfer|wire|reply|respond|click|open|ignore|disregard|delete|remove|cancel|book|"
    r"always|never|please|do not|don't|you must|you should|you need to|make sure|remember to|update|change|set|"
    r"add|use|contact|email|call)\b", re.IGNORECASE)
_DIRECTIVE_WORDS = re.compile(r"\binstructions?\b|\byou (must|should|need to|have to)\b|\bfrom now on\b",
                              re.IGNORECASE)
_RECIPIENT = re.compile(r"\b(to|cc|bcc|recipients?|forward\w*|send\w*|reply\w*|mail\w*|email\w*|address)\b"
                        r"[^.@\n]{0,40}?[\w.+-]+@[\w-]+(\.[\w-]+)+", re.IGNORECASE)


_UNSTORABLE = re.compile(r"[\x00\ud800-\udfff]")


def storable(text: str) -> bool:
    """Whether every database can keep `text` as it is (PostgreSQL refuses NUL and half a surrogate pair)."""
    return not _UNSTORABLE.search(text)


def _in_range(when: datetime) -> bool:
    try:
        return MIN_YEAR <= when.astimezone(UTC).year <= MAX_YEAR
    except OverflowError:  # year 1 or 9999 with an offset: no UTC time at all
        return False


def directive(text: str) -> bool:
    """Whether `text` reads as an order to the agent: imperative, about instructions, or naming a recipient."""
    return any(bool(p.search(text)) for p in (_IMPERATIVE, _DIRECTIVE_WORDS, _RECIPIENT))


def user_owned(record: Existing) -> bool:
    """The user's own: an instruction, or a preference or fact they wrote or confirmed."""
    return record.form == MemoryForm.INSTRUCTION or (
        record.form in USER_OWNED_FORMS and (record.speaker == Speaker.USER or record.confirmed_by is not None))


def _shape(p: Proposal, actor: Actor) -> Refusal | tuple[MemoryScope, str | None, tuple[str, ...]]:
    def bad(message: str) -> Refusal:
        return Refusal(code="invalid_memory", message=message)

    if not all(storable(v) for v in (p.text, p.value, p.speaker_name or "", p.scope_ref or "", *p.topics)):
        return bad("text, value, names and topics hold no NUL character and no lone surrogate")
    if not p.text.strip() or len(p.text) > MAX_TEXT:
        return bad(f"text must be 1 to {MAX_TEXT} characters")
    if not p.value.strip() or len(p.value) > MAX_VALUE:
        return bad(f"value must be 1 to {MAX_VALUE} characters")
    for name, ident in (("subject", p.subject), ("relation", p.relation)):
        if not IDENTIFIER.fullmatch(ident):
            return bad(f"{name} must be a lowercase identifier (a letter, then letters, digits, _ . -; at most 80)")
    if p.speaker_name is not None and (not p.speaker_name.strip() or len(p.speaker_name) > MAX_NAME):
        return bad(f"speaker_name must be 1 to {MAX_NAME} characters")
    if len(p.topics) > MAX_TOPICS:
        return bad(f"at most {MAX_TOPICS} topics")
    topics = tuple(dict.fromkeys([p.subject, *(t.strip().lower() for t in p.topics)]))
    if not all(IDENTIFIER.fullmatch(t) for t in topics):
        return bad("topics must be lowercase identifiers (a letter, then letters, digits, _ . -; at most 80)")
    if p.confidence is not None and not 0 < p.confidence <= 1:
        return bad("confidence must be in (0, 1]")
    if p.form == MemoryForm.HYPOTHESIS and p.confidence is None:
        return bad("a hypothesis needs a confidence in (0, 1]")
    for name, when in (("valid_from", p.valid_from), ("valid_until", p.valid_until)):
        if when is not None and not _in_range(when):
            return bad(f"{name} must be between {MIN_YEAR} and {MAX_YEAR}")
    if p.valid_from is not None and p.valid_until is not None and p.valid_until <= p.valid_from:
        return bad("valid_until must be after valid_from")
    if len(set(p.derived_from)) != len(p.derived_from) or len(set(p.evidence)) != len(p.evidence):
        return bad("evidence and derived_from name each thing once")
    scope = p.scope or (MemoryScope.RUN if actor.run_id else MemoryScope.TASK if actor.task_id else MemoryScope.ALWAYS)

    def scope_bad(message: str) -> Refusal:
        return Refusal(code="invalid_scope", message=message)

    ref = p.scope_ref
    if scope == MemoryScope.ALWAYS:
        if ref is not None:
            return scope_bad("an `always` record names no scope_ref")
    elif scope == MemoryScope.PROJECT:
        if ref is None or not IDENTIFIER.fullmatch(ref):
            return scope_bad("a project record names its project as scope_ref (a lowercase identifier)")
    else:
        own = actor.run_id if scope == MemoryScope.RUN else actor.task_id
        if actor.kind == ActorKind.USER and ref is not None and own is None:
            own = ref  # the user names one of their tasks or runs (checked by the committer: scope_ref_owned)
        if own is None:
            return scope_bad(f"a {scope.value}-scoped record needs a {scope.value} to hold for; this proposal "
                             "has none")
        if ref is not None and ref != own:
            return scope_bad(f"a {scope.value}-scoped record holds for this {scope.value} ({own}) only")
        ref = own
    return scope, ref, topics


def check(proposal: Proposal, actor: Actor, facts: Facts) -> Verdict | Refusal:
    """What `proposal` from `actor` becomes, or why it is refused, over `facts`."""
    p = proposal
    shaped = _shape(p, actor)
    if isinstance(shaped, Refusal):
        return shaped
    scope, scope_ref, topics = shaped
    if not facts.scope_ref_owned:
        return Refusal(code="invalid_scope", message=f"{scope.value} {scope_ref} is not one of yours")
    # 2. evidence
    missing = [f"{r.type} {r.id}" for r in facts.evidence if not r.found]
    if missing or not facts.derived_found:
        named = ", ".join(missing) or "a record in derived_from"
        return Refusal(code="unknown_evidence", message=f"no such evidence of this user: {named}")
    disowned = [r for r in facts.evidence if (r.type, r.id) in facts.disowned]
    agent = actor.kind != ActorKind.USER
    form = p.form
    if agent and disowned and form in (MemoryForm.HYPOTHESIS, MemoryForm.PREFERENCE):
        return Refusal(code="evidence_disowned", message=f"the user said {disowned[0].type} {disowned[0].id} shows "
                                                         "no preference: it cannot support one")
    # 3. source
    third = sorted({r.authority.removeprefix(SOURCE_PREFIX) for r in facts.evidence
                    if r.type == "event" and r.authority and r.authority.startswith(SOURCE_PREFIX)})
    if agent and third and form != MemoryForm.SOURCED_FACT:
        return Refusal(code="third_party_source", message=f"this came from {third[0]}, a third party: it can only "
                                                          "be remembered as a sourced_fact naming them")
    if form == MemoryForm.SOURCED_FACT:
        if agent and not third:
            return Refusal(code="third_party_source", message="a sourced_fact names the delivery it came from as "
                                                              "evidence (an event from a webhook source)")
        if directive(p.text) or directive(p.value):
            return Refusal(code="third_party_directive", message="what a third party says reads as an order to you "
                                                                 "(an instruction, an imperative or a recipient): "
                                                                 "that is never remembered")
    # 4. authority
    if agent and form == MemoryForm.INSTRUCTION:
        return Refusal(code="user_only", message="only the user writes standing instructions")
    # 5. what needs the user
    user_words = [r for r in facts.evidence if r.type == "event" and r.kind == "message" and r.authority == "user"]
    in_task = [r for r in user_words if actor.task_id is None or r.task_id == actor.task_id]
    state = MemoryState.ACTIVE
    speaker = Speaker.USER if not agent else Speaker.AGENT
    speaker_name = facts.user_name if not agent else (actor.name or actor.kind.value)
    confidence = p.confidence
    if agent:
        if form in (MemoryForm.HYPOTHESIS, MemoryForm.SKILL, MemoryForm.FACT):
            state = MemoryState.PENDING
        elif form == MemoryForm.PREFERENCE:
            if scope not in (MemoryScope.RUN, MemoryScope.TASK) or not in_task:
                form, state = MemoryForm.HYPOTHESIS, MemoryState.PENDING  # near policy: the user confirms it
        elif form == MemoryForm.STATEMENT:
            if not user_words:
                return Refusal(code="needs_user_words", message="a statement records the user's own words: name "
                                                                "their message as evidence")
            speaker, speaker_name = Speaker.USER, facts.user_name
        elif form == MemoryForm.SOURCED_FACT:
            speaker, speaker_name = Speaker.THIRD_PARTY, third[0]
        if form in (MemoryForm.HYPOTHESIS, MemoryForm.SKILL) and not facts.evidence and not p.derived_from:
            return Refusal(code="needs_evidence", message=f"a {form.value} is inferred from something: name at least "
                                                          "one evidence ref or a record in derived_from")
    elif form == MemoryForm.SOURCED_FACT:
        speaker, speaker_name = Speaker.THIRD_PARTY, (p.speaker_name or (third[0] if third else "")).strip()
        if not speaker_name:
            return Refusal(code="invalid_memory", message="a sourced_fact names its source (speaker_name)")
    # 6. contradiction
    rivals = [e for e in facts.same_key if e.value != p.value and e.scope == scope and e.scope_ref == scope_ref]
    if agent and form in (MemoryForm.HYPOTHESIS, MemoryForm.PREFERENCE):
        confirmed = [e for e in rivals if e.state == MemoryState.ACTIVE and e.form == MemoryForm.PREFERENCE
                     and user_owned(e)]
        if confirmed:
            return Refusal(code="contradicts_confirmed", message=f"the user's confirmed preference {confirmed[0].id} "
                                                                 "says otherwise: inference yields to their words")
    retire: tuple[str, ...] = ()
    if state == MemoryState.ACTIVE:
        active = [e for e in rivals if e.state == MemoryState.ACTIVE]
        if agent and any(user_owned(e) for e in active):
            owned = next(e for e in active if user_owned(e))
            return Refusal(code="user_owned", message=f"{owned.id} is the user's own record: only they change it")
        retire = tuple(e.id for e in active)
    return Verdict(form=form, state=state, speaker=speaker, speaker_name=speaker_name[:MAX_NAME], scope=scope,
                   scope_ref=scope_ref, topics=topics, confidence=confidence, retire=retire,
                   review=bool(retire) and agent)
