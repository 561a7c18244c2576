"""The console in real headless Chromium (Playwright over Debian's chromium) against the real HTTP stack: sign in,
approval cards raised by real runs of a scripted model, approve and watch the dispatch appear, deny, pause a task
while its approval is open (approving then refuses, and says why), STOP and START, an admin's STOP / START over
everything (a plain user is refused it), the activity pages. A screenshot
of each page is saved under the test's tmp dir, and copied to the folder `WAKEFUL_SCREENSHOTS` names when it is set."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, sync_playwright  # noqa: TID251 - a test drives the browser, not the server
from sqlalchemy import Engine

from tests.support.acting import CANCEL_VERIFIED, World, world
from tests.support.chromium import CHROMIUM
from tests.support.serve import serving
from wakeful.proxy.clock import FakeClock
from wakeful.server import memory
from wakeful.server.core import inbox
from wakeful.server.core.worker import Binding, Worker
from wakeful.server.faces import listing
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.harness.model import ModelReply, ModelRequest, ScriptedModel, calls
from wakeful.server.harness.wake import Harness
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import read, write
from wakeful.server.store.ids import new_id
from wakeful.server.store.tables import EventKind
from wakeful.server.store.users import ensure_user, issue_token

pytestmark = pytest.mark.browser
SHOTS = os.environ.get("WAKEFUL_SCREENSHOTS")
"""Where a person who wants to look at the pages keeps their screenshots (unset: only the test's tmp dir)."""


@dataclass
class Console:
    w: World
    url: str
    token: str
    page: Page
    shots: Path

    def shot(self, name: str, page: Page | None = None) -> None:
        path = self.shots / f"console-{name}.png"
        (page or self.page).screenshot(path=str(path), full_page=True)
        if SHOTS:
            Path(SHOTS).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(SHOTS) / path.name)

    def open(self, path: str) -> None:
        self.page.goto(self.url + path)

    def pending(self, task: Binding) -> str:
        with read(self.w.engine) as conn:
            (action,) = listing.pending_approvals(conn, user_id=self.w.owner, task_id=task.task_id)
        return str(action["id"])


@pytest.fixture
def console(engine: Engine, clock: FakeClock, owner: str, settings: Settings, tmp_path: Path) -> Iterator[Console]:
    with world(engine, clock, owner) as w:
        runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, registry=w.tools.registry)
        runtime.prepare()
        with write(engine) as conn:
            token = issue_token(conn, user_id=owner)
        shots = tmp_path / "shots"
        shots.mkdir()
        with serving(create_app(runtime, manage_runtime=False)) as url, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            try:
                page = browser.new_context(viewport={"width": 420, "height": 860}).new_page()  # a phone's width
                page.set_default_timeout(15_000)
                yield Console(w=w, url=url, token=token, page=page, shots=shots)
            finally:
                browser.close()


def a_cancellation(w: World, settings: Settings) -> tuple[Binding, Worker]:
    """A new task, and a worker whose scripted model lists the subscriptions and asks to cancel the first: its run
    ends waiting for the user's approval."""
    task = w.task(completion=CANCEL_VERIFIED)

    def cancel_first(request: ModelRequest) -> ModelReply:
        listed = json.loads(request.messages[-1]["content"][0]["content"])
        return calls(("merchant__cancel_renewal", {"subscription": listed["objects"][0]["id"]}))

    model = ScriptedModel([calls(("merchant__list_subscriptions", {})), cancel_first])
    harness = Harness(model, registry=w.tools.registry, instructions=None, max_tokens_per_run=100_000)
    return task, Worker(w.engine, settings, w.clock, harness, tools=w.tools)


def run_a_cancellation(w: World, settings: Settings) -> Binding:
    """A cancellation's one real run, ended waiting for the user's approval."""
    task, worker = a_cancellation(w, settings)
    assert worker.run_once()
    return task


def sign_in(c: Console) -> None:
    c.open("/")
    c.page.wait_for_selector("#token")
    assert "/signin" in c.page.url
    c.shot("signin")
    c.page.fill("#token", c.token)
    c.page.click("button[type=submit]")
    c.page.wait_for_selector("text=Hello, owner")


def test_approve_deny_and_a_paused_tasks_refusal_in_a_real_browser(console: Console, settings: Settings) -> None:
    c, w = console, console.w
    approved, denied, paused = (run_a_cancellation(w, settings) for _ in range(3))
    sign_in(c)
    assert c.page.locator("main li").count() == 3
    c.shot("home")
    c.open("/approvals")
    assert c.page.locator(".approval").count() == 3
    c.shot("approvals")

    # Approve: the card says what, to whom, how much and the content hash; the dispatch then shows on the task.
    action_id = c.pending(approved)
    c.open(f"/approvals/{action_id}")
    card = c.page.inner_text("#card")
    assert "merchant__cancel_renewal" in card and "sha256:" in card and "19.99 EUR" in card
    c.shot("card")
    c.page.click("#approve")
    c.page.wait_for_selector("#result")
    assert c.page.inner_text("#verdict") == "admitted"
    c.shot("approved")
    w.dispatcher.drain()
    c.open(f"/tasks/{approved.task_id}")
    assert c.page.inner_text("#actions .outcome") == "accepted"
    assert len(w.merchant.effects) == 1
    c.shot("task")

    # Deny.
    c.open(f"/approvals/{c.pending(denied)}")
    c.page.click("#deny")
    c.page.wait_for_selector("#result")
    assert c.page.inner_text("h1") == "Denied"

    # Pause a task while its approval is open: the card says approving would be refused, and approving refuses.
    action_id = c.pending(paused)
    c.open(f"/tasks/{paused.task_id}")
    c.page.click("#pause")
    c.page.wait_for_selector("#task-state:has-text('paused')")
    c.open(f"/approvals/{action_id}")
    assert "approving now would be refused" in c.page.inner_text("#verdict-now")
    c.shot("card-paused")
    c.page.click("#approve")
    c.page.wait_for_selector("#result")
    assert c.page.inner_text("#verdict") == "refused" and "paused" in c.page.inner_text("#reason")
    c.shot("refused-paused")
    w.dispatcher.drain()
    assert len(w.merchant.effects) == 1

    c.open("/tasks")
    assert c.page.locator("#tasks a").count() == 3
    c.shot("tasks")


def test_the_approval_link_from_another_site_opens_the_card_in_the_signed_in_browser(console: Console,
                                                                                      settings: Settings) -> None:
    """The session cookie is SameSite=Strict, so the click in a mail (another site) does not carry it: the link's
    page comes straight back to itself, which does."""
    c = console
    task = run_a_cancellation(c.w, settings)
    sign_in(c)
    auth = {"Authorization": f"Bearer {c.token}"}
    (message,) = httpx.get(f"{c.url}/v1/messages", headers=auth).json()["messages"]
    link = message["body"]["link"].replace("http://127.0.0.1:8787", c.url)  # public_url unset: the default address
    c.page.goto("about:blank")
    c.page.set_content(f'<p>From your mail: <a id="mail" href="{link}">approve?</a></p>')
    c.page.click("#mail")
    c.page.wait_for_selector("#card")
    assert c.page.url.endswith(f"/approvals/{c.pending(task)}")
    c.shot("card-from-link")
    c.page.goto(link)  # the link is good once
    assert "link_used" in c.page.inner_text("#code")


def test_stop_and_start_and_a_forged_post_in_a_real_browser(console: Console, settings: Settings) -> None:
    c = console
    run_a_cancellation(c.w, settings)
    sign_in(c)
    c.page.fill("input[name=reason]", "going on holiday")
    c.page.click("#stop")
    c.page.wait_for_selector("#stop-banner")
    c.shot("stopped")
    auth = {"Authorization": f"Bearer {c.token}"}
    assert httpx.get(f"{c.url}/v1/control", headers=auth).json()["stopped"] is True
    c.open("/")
    c.page.click("#start")
    c.page.wait_for_selector("text=START recorded")
    assert c.page.locator("#stop-banner").count() == 0
    assert httpx.get(f"{c.url}/v1/control", headers=auth).json()["stopped"] is False

    # A form posted with the browser's own cookie but without the CSRF token (what a forged form would send).
    cookies = {k["name"]: k["value"] for k in c.page.context.cookies()}
    forged = httpx.post(f"{c.url}/stop", data={"reason": "forged"}, cookies=cookies)
    assert forged.status_code == 403 and "bad_csrf_token" in forged.text
    assert httpx.get(f"{c.url}/v1/control", headers=auth).json()["stopped"] is False

    for name, path in (("activity-events", "/activity"), ("activity-runs", "/activity?view=runs"),
                       ("activity-timers", "/activity?view=timers"), ("activity-outbox", "/activity?view=outbox"),
                       ("egress", "/egress"), ("handoff", "/handoff")):
        c.open(path)
        assert c.page.locator("main h1").count() == 1
        c.shot(name)
    c.open("/activity?view=runs")
    c.page.click("#activity a")
    c.page.wait_for_selector("#steps")
    assert c.page.locator("#steps tr").count() >= 3  # the header, and the run's two steps
    c.shot("run")


def test_an_admin_stops_everything_a_run_is_held_until_start_and_a_plain_user_cannot(console: Console,
                                                                                      settings: Settings) -> None:
    c, w = console, console.w
    with write(w.engine) as conn:
        _, root_token = ensure_user(conn, name="root", now=w.clock.now(), admin=True)
    assert root_token is not None

    # The owner here is a plain user: no deployment-wide control, and a form forged in their own signed-in page
    # (with its CSRF token) is refused.
    sign_in(c)
    assert c.page.locator("#stop-everything").count() == 0 and c.page.locator("#stop").count() == 1
    c.page.evaluate("""() => { const f = document.createElement('form'); f.method = 'post';
        f.action = '/everything/stop'; const t = document.querySelector('input[name=csrf]').cloneNode();
        f.appendChild(t); document.body.appendChild(f); f.submit(); }""")
    c.page.wait_for_selector("#code")
    assert c.page.inner_text("#code") == "admin_required"
    c.shot("admin-required")
    auth = {"Authorization": f"Bearer {c.token}"}
    assert httpx.get(f"{c.url}/v1/control", headers=auth).json() == {"stopped": False, "global_stop": False}

    # The admin, in a browser of their own, stops everything.
    browser = c.page.context.browser
    assert browser is not None
    admin = browser.new_context(viewport={"width": 420, "height": 860}).new_page()
    admin.set_default_timeout(15_000)
    admin.goto(c.url + "/")
    admin.fill("#token", root_token)
    admin.click("button[type=submit]")
    admin.wait_for_selector("text=Hello, root")
    c.shot("admin-home", admin)
    admin.fill("#everything input[name=reason]", "incident: the merchant double-charges")
    admin.click("#stop-everything")
    admin.wait_for_selector("text=STOP recorded over everything")
    assert "lift it on the home page" in admin.inner_text("#stop-banner")
    c.shot("admin-stopped", admin)

    # The owner's new delegation is held: no worker claims it while the STOP is in force.
    task, worker = a_cancellation(w, settings)
    assert not worker.run_once()
    c.open("/")
    assert "an admin lifts it" in c.page.inner_text("#stop-banner")
    assert c.page.locator("#nothing-pending").count() == 1
    assert c.page.locator("#start").count() == 0  # their own START would not lift it: their STOP is offered
    c.shot("held-by-admin-stop")

    # START everything: the run proceeds, and its approval request reaches the owner.
    admin.goto(c.url + "/")
    admin.click("#start-everything")
    admin.wait_for_selector("text=START recorded over everything")
    assert admin.locator("#stop-banner").count() == 0
    assert worker.run_once()
    c.open("/")
    assert c.page.locator("#stop-banner").count() == 0
    c.pending(task)  # exactly one action waits for the owner's approval
    assert c.page.locator("main li").count() == 1
    c.shot("after-admin-start")


def test_the_memory_page_confirms_a_candidate_and_corrects_it_in_a_real_browser(console: Console) -> None:
    c = console
    task = c.w.task("book the flight to Hong Kong")
    actor = memory.Actor(kind=memory.ActorKind.AGENT, task_id=task.task_id, name="run")
    with write(c.w.engine) as conn:
        choice = inbox.record(conn, inbox.Delivery(  # what it was inferred from: the user picked the 07:10 flight
            user_id=c.w.owner, source="chat", source_id=new_id("chat"), kind=EventKind.MESSAGE, trust="user",
            authority="user", session_id=task.session_id, payload={"text": "the 07:10 one, please"}),
            now=c.w.clock.now()).event_id
        inferred = memory.propose(conn, user_id=c.w.owner, actor=actor, now=c.w.clock.now(), proposal=(
            memory.parse_proposal({"form": "hypothesis", "text": "the user seems to prefer early flights",
                                   "subject": "flight.departure", "relation": "prefers", "value": "early",
                                   "scope": "always", "confidence": 0.6,
                                   "evidence": [{"type": "event", "id": choice}]})))
    sign_in(c)
    c.open("/memory")
    c.page.wait_for_selector(f"#memory-{inferred.memory_id}")
    c.shot("memory")
    c.page.click(f"#memory-{inferred.memory_id} a")
    c.page.click("#memory-confirm")
    c.page.wait_for_selector("#memory-correct")
    assert c.page.inner_text("#memory-state") == "active"
    confirmed = c.page.url.rsplit("/", 1)[1]
    c.shot("memory-record")
    c.page.fill("#correct-form input[name=reason]", "those times had no alternatives")
    c.page.fill("#correct-form input[name=text]", "I don't prefer early flights")
    c.page.click("#memory-correct")
    c.page.wait_for_selector("#retire-reason")
    assert c.page.inner_text("#retire-reason") == "corrected"
    with read(c.w.engine) as conn:
        shown = memory.show(conn, c.w.owner, confirmed)
    assert (shown["record"]["form"], shown["record"]["retire_reason"]) == ("preference", "corrected")
