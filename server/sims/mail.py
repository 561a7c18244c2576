"""A mailbox with a calendar: mail arrives as signed webhooks carrying its thread id; sending mail and adding calendar
events are effects (idempotent).

    app, sim = create_mail()
    sim.webhooks.configure(url, secret)
    sim.receive("client@example.com", "Re: meeting", "I'll confirm with my boss", thread_id="t_1")
    sim.webhooks.flush()        # {"type": "mail.received", "thread_id": "t_1", ...}, signed

The thread id is the correlation key: a reply lands in the thread its sender answered, so a wait opened on a thread
is answered by the next mail in it.

Service API:
    GET  /v1/threads/{thread_id}     {thread_id, messages: [{message_id, direction: "in"|"out", from, to, cc, subject,
                                      body, at}]} | 404 {"error": "not_found"}
    POST /v1/messages                Idempotency-Key required; {"to": [...], "cc": [...], "subject", "body",
                                     "thread_id"?}: send -> 201 {message_id, thread_id}, effect {"kind": "send",
                                     "target": thread_id, "to", "cc", "subject"}; a new thread when none is given
    POST /v1/threads/{thread_id}/replies  Idempotency-Key required; {"body"}: a reply in the thread to the sender
                                     of its latest inbound mail, subject "Re: " its first -> 201 {message_id,
                                     thread_id}, the same "send" effect; 404 {"error": "not_found"}; 409
                                     {"error": "no_sender"} (a thread with no inbound mail)
    GET  /v1/messages?idempotency_key=K  {"messages": [sent message + idempotency_key]}
    POST /v1/calendar/events         Idempotency-Key required; {"title", "starts_at", "ends_at"} -> 201 {event_id, ...},
                                     effect {"kind": "calendar_event", "target": event_id}
    GET  /v1/calendar/events         {"events": [...]}
Sim-only:
    POST /_sim/inbound {"from", "subject", "body", "thread_id"?} -> {message_id, thread_id}: a mail arrives; one
                                     signed {"type": "mail.received", "thread_id", "message_id", "from", "subject",
                                     "body"} webhook is queued

Knobs: dedupe, fail_before_commit, stall_seconds (see _base), and
    commit_then_timeout  int  the next N sends commit, then hold the response back `stall_seconds`
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from wakeful.server.sims._base import Faults, Reply, Sim, SimClock, error, iso, sim_app

__all__ = ["Mail", "MailFaults", "create_mail"]


@dataclass
class MailFaults(Faults):
    commit_then_timeout: int = 0


class Outgoing(BaseModel):
    to: list[str] = Field(min_length=1)
    cc: list[str] = Field(default_factory=list)
    subject: str
    body: str = ""
    thread_id: str | None = None


class Incoming(BaseModel):
    sender: str = Field(alias="from")
    subject: str
    body: str = ""
    thread_id: str | None = None


class ReplyBody(BaseModel):
    body: str = Field(min_length=1)


class CalendarEvent(BaseModel):
    title: str
    starts_at: str
    ends_at: str


class Mail(Sim):
    def __init__(self, clock: SimClock | None = None) -> None:
        super().__init__("mail", MailFaults(), clock)
        self.faults: MailFaults
        self._threads: dict[str, list[dict[str, Any]]] = {}
        self._sent: list[dict[str, Any]] = []
        self._events: list[dict[str, Any]] = []
        self._messages = 0

    def _add(self, thread_id: str | None, message: dict[str, Any]) -> dict[str, Any]:
        self._messages += 1
        thread_id = thread_id or f"t_{len(self._threads) + 1}"
        stored = {"message_id": f"m_{self._messages}", "thread_id": thread_id, "at": iso(self.clock.now()),
                  **message}
        self._threads.setdefault(thread_id, []).append(stored)
        return stored

    def receive(self, sender: str, subject: str, body: str = "", *, thread_id: str | None = None) -> dict[str, Any]:
        """A mail arrives (from outside): kept in its thread, and a signed webhook queued."""
        with self.lock:
            stored = self._add(thread_id, {"direction": "in", "from": sender, "to": [], "cc": [],
                                           "subject": subject, "body": body})
            self.webhooks.queue({"type": "mail.received", "thread_id": stored["thread_id"],
                                 "message_id": stored["message_id"], "from": sender, "subject": subject,
                                 "body": body})
            return {"message_id": stored["message_id"], "thread_id": stored["thread_id"]}

    def thread(self, thread_id: str) -> list[dict[str, Any]] | None:
        with self.lock:
            messages = self._threads.get(thread_id)
            return [dict(m) for m in messages] if messages is not None else None

    def sent(self, idempotency_key: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(m) for m in self._sent if idempotency_key in (None, m["idempotency_key"])]

    def send(self, mail: Outgoing, key: str) -> Reply:
        with self.lock:
            if mail.thread_id is not None and mail.thread_id not in self._threads:
                return Reply(404, {"error": "not_found"})
            stored = self._add(mail.thread_id, {"direction": "out", "from": "me", "to": mail.to, "cc": mail.cc,
                                                "subject": mail.subject, "body": mail.body})
            self._sent.append({**stored, "idempotency_key": key})
            self.record("send", stored["thread_id"], key, message_id=stored["message_id"], to=mail.to, cc=mail.cc,
                        subject=mail.subject)
            return Reply(201, {"message_id": stored["message_id"], "thread_id": stored["thread_id"]}, applied=True)

    def reply(self, thread_id: str, body: str, key: str) -> Reply:
        """Answer the thread's latest inbound mail, in the thread."""
        with self.lock:
            messages = self._threads.get(thread_id)
            if messages is None:
                return Reply(404, {"error": "not_found"})
            inbound = [m for m in messages if m["direction"] == "in"]
            if not inbound:
                return Reply(409, {"error": "no_sender"})
            subject = messages[0]["subject"]
            return self.send(Outgoing(to=[inbound[-1]["from"]], subject=subject if subject.startswith("Re: ")
                                      else f"Re: {subject}", body=body, thread_id=thread_id), key)

    def add_event(self, event: CalendarEvent, key: str) -> Reply:
        with self.lock:
            stored = {"event_id": f"ev_{len(self._events) + 1}", **event.model_dump()}
            self._events.append(stored)
            self.record("calendar_event", stored["event_id"], key, title=event.title, starts_at=event.starts_at)
            return Reply(201, dict(stored), applied=True)

    def events(self) -> list[dict[str, Any]]:
        with self.lock:
            return [dict(e) for e in self._events]


def create_mail(*, clock: SimClock | None = None) -> tuple[FastAPI, Mail]:
    """A mailbox-and-calendar app and its sim; no threads yet (mail arrives with `sim.receive` or /_sim/inbound)."""
    sim = Mail(clock)
    app = sim_app(sim, "mail and calendar simulator")

    @app.get("/v1/threads/{thread_id}", response_model=None)
    def thread(thread_id: str) -> dict[str, Any] | JSONResponse:
        messages = sim.thread(thread_id)
        return {"thread_id": thread_id, "messages": messages} if messages is not None else error(404, "not_found")

    @app.post("/v1/messages")
    async def send(body: Outgoing, request: Request) -> JSONResponse:
        return await sim.effect_request(request, body.model_dump(), lambda key: sim.send(body, key),
                                        stall_knob="commit_then_timeout")

    @app.post("/v1/threads/{thread_id}/replies")
    async def reply(thread_id: str, body: ReplyBody, request: Request) -> JSONResponse:
        return await sim.effect_request(request, {"thread_id": thread_id, **body.model_dump()},
                                        lambda key: sim.reply(thread_id, body.body, key),
                                        stall_knob="commit_then_timeout")

    @app.get("/v1/messages")
    def sent(idempotency_key: str | None = None) -> dict[str, Any]:
        return {"messages": sim.sent(idempotency_key)}

    @app.post("/v1/calendar/events")
    async def add_event(body: CalendarEvent, request: Request) -> JSONResponse:
        return await sim.effect_request(request, body.model_dump(), lambda key: sim.add_event(body, key))

    @app.get("/v1/calendar/events")
    def events() -> dict[str, Any]:
        return {"events": sim.events()}

    @app.post("/_sim/inbound", status_code=201)
    def inbound(body: Incoming) -> dict[str, Any]:
        return sim.receive(body.sender, body.subject, body.body, thread_id=body.thread_id)

    return app, sim
