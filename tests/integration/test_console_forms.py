"""The console over plain HTTP: sessions, CSRF, approval links, refusals as pages and stable pages — on SQLite and
PostgreSQL. (tests/integration/test_console.py drives the same pages in real Chromium.)"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, select

from tests.support.acting import World, world
from tests.support.docs import DOCS
from wakeful.proxy.clock import FakeClock
from wakeful.server.core import control, outbox, sessions
from wakeful.server.core.outbox import linked
from wakeful.server.core.speaking import Level
from wakeful.server.core.worker import Binding
from wakeful.server.faces.http import create_app
from wakeful.server.harness.handlers import EchoHandler
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings
from wakeful.server.store.db import write
from wakeful.server.store.tables import control as control_table
from wakeful.server.store.tables import decisions, run_contexts, runs
from wakeful.server.store.users import ensure_user, is_admin, issue_token, user_id_by_name

BOTH = pytest.mark.parametrize("engine", ["sqlite", "postgresql"], indirect=True)
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


@pytest.fixture
def setup(engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> Iterator[tuple[World, TestClient, str]]:
    settings = settings.model_copy(update={"public_url": "https://agent.example.org"})
    with world(engine, clock, owner) as w:
        runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine, registry=w.tools.registry)
        runtime.prepare()
        with write(engine) as conn:
            token = issue_token(conn, user_id=owner)
        with TestClient(create_app(runtime, manage_runtime=False), base_url="https://testserver") as client:
            yield w, client, token


def sign_in(client: TestClient, token: str, next_: str = "/") -> str:
    """Signs in through the form; returns the session's CSRF token (from the page it lands on)."""
    form = client.get("/signin")
    assert form.status_code == 200, form.text
    landed = client.post("/signin", data={"csrf": CSRF.search(form.text).group(1), "token": token, "next": next_})
    assert landed.status_code == 200, landed.text
    return CSRF.search(landed.text).group(1)


def raise_approval(w: World) -> tuple[Binding, str]:
    task = w.task("cancel my subscription")
    (sub,) = w.call(task, "merchant__list_subscriptions")["objects"]
    return task, w.call(task, "merchant__cancel_renewal", subscription=sub["id"])["action_id"]


@BOTH
def test_signing_in_sets_a_strict_httponly_secure_cookie_and_signing_out_ends_the_session(
        setup: tuple[World, TestClient, str]) -> None:
    _, client, token = setup
    assert client.get("/", follow_redirects=False).headers["location"] == "/signin?next=%2F"
    form = client.get("/signin")
    answer = client.post("/signin", data={"csrf": CSRF.search(form.text).group(1), "token": token, "next": "/tasks"},
                         follow_redirects=False)
    assert answer.status_code == 303 and answer.headers["location"] == "/tasks"
    cookie = next(v for k, v in answer.headers.multi_items() if k == "set-cookie" and "wakeful_console=" in v)
    assert {"httponly", "samesite=strict", "secure"} <= {p.strip().lower() for p in cookie.split(";")}
    home = client.get("/")
    assert home.status_code == 200 and "No approval is waiting." in home.text
    client.post("/signout", data={"csrf": CSRF.search(home.text).group(1)})
    assert client.get("/", follow_redirects=False).status_code == 303


@BOTH
def test_a_token_issued_again_ends_the_console_sessions_signed_in_with_the_old_one(
        setup: tuple[World, TestClient, str], engine: Engine, owner: str) -> None:
    _, client, token = setup
    sign_in(client, token)
    assert client.get("/", follow_redirects=False).status_code == 200
    with write(engine) as conn:
        issue_token(conn, user_id=owner)  # what `wakeful token` does when the old one leaked
    assert client.get("/", follow_redirects=False).headers["location"] == "/signin?next=%2F"


def test_a_wrong_token_or_a_foreign_next_does_not_sign_in_or_leave_the_server(
        setup: tuple[World, TestClient, str]) -> None:
    _, client, token = setup
    form = client.get("/signin")
    refused = client.post("/signin", data={"csrf": CSRF.search(form.text).group(1), "token": "wk_nope"})
    assert refused.status_code == 401 and "That token is not valid" in refused.text
    form = client.get("/signin")
    away = client.post("/signin", data={"csrf": CSRF.search(form.text).group(1), "token": token,
                                        "next": "//evil.example/x"}, follow_redirects=False)
    assert away.headers["location"] == "/"
    forged = TestClient(client.app, base_url="https://testserver").post("/signin", data={"csrf": "x", "token": token})
    assert forged.status_code == 403 and 'id="code">bad_csrf_token<' in forged.text


@BOTH
def test_a_forged_form_without_the_csrf_token_is_refused_and_changes_nothing(
        setup: tuple[World, TestClient, str]) -> None:
    w, client, token = setup
    _, action_id = raise_approval(w)
    sign_in(client, token)
    for path, data in ((f"/approvals/{action_id}/approve", {}), (f"/approvals/{action_id}/approve", {"csrf": "x"}),
                       ("/stop", {"reason": "forged"})):
        refused = client.post(path, data=data)
        assert refused.status_code == 403 and 'id="code">bad_csrf_token<' in refused.text, refused.text
    assert "Approve" in client.get(f"/approvals/{action_id}").text
    assert client.get("/v1/control", headers={"Authorization": f"Bearer {token}"}).json()["stopped"] is False
    w.dispatcher.drain()
    assert w.merchant.effects == []


@BOTH
def test_the_approval_link_in_the_message_opens_the_card_once_under_the_public_url(
        setup: tuple[World, TestClient, str]) -> None:
    w, client, token = setup
    _, action_id = raise_approval(w)
    (message,) = client.get("/v1/messages", headers={"Authorization": f"Bearer {token}"}).json()["messages"]
    link = message["body"]["link"]
    assert message["body"]["kind"] == "approval_request" and link.startswith("https://agent.example.org/a/")
    path = link.removeprefix("https://agent.example.org")
    # Without the (SameSite=Strict) cookie, a page that comes straight back; still without it, the sign-in page
    # first. Neither uses the link up.
    hop = client.get(path, follow_redirects=False)
    assert hop.status_code == 200 and f'content="0;url={path}?again=1"' in hop.text
    assert client.get(f"{path}?again=1", follow_redirects=False).headers["location"].startswith(
        "/signin?next=%2Fa%2F")
    sign_in(client, token, next_=path)
    assert client.get(path, follow_redirects=False).status_code == 409  # used by the sign-in's redirect
    card = client.get(f"/approvals/{action_id}")
    assert 'id="approve"' in card.text and "sha256:" in card.text


def test_a_link_for_an_action_the_task_moved_past_refuses(setup: tuple[World, TestClient, str]) -> None:
    w, client, token = setup
    task, _ = raise_approval(w)
    auth = {"Authorization": f"Bearer {token}"}
    link = client.get("/v1/messages", headers=auth).json()["messages"][0]["body"]["open"]
    client.post(f"/v1/tasks/{task.task_id}/steer", json={"goal": "keep it after all"}, headers=auth)
    sign_in(client, token)
    refused = client.get(link)
    assert refused.status_code == 409 and 'id="code">action_changed<' in refused.text
    expired = client.get("/a/nosuchtoken")
    assert expired.status_code == 404 and 'id="code">unknown_link<' in expired.text


def test_another_users_approval_is_not_found_in_the_console(setup: tuple[World, TestClient, str]) -> None:
    w, client, _ = setup
    _, action_id = raise_approval(w)
    with write(w.engine) as conn:
        _, other = ensure_user(conn, name="mallory", now=w.clock.now())
    assert other is not None
    sign_in(client, other)
    assert client.get(f"/approvals/{action_id}").status_code == 404
    assert client.get("/approvals").status_code == 200


@BOTH
def test_every_page_renders_for_a_user_with_nothing_and_junk_parameters_are_a_400_page(
        setup: tuple[World, TestClient, str]) -> None:
    _, client, token = setup
    sign_in(client, token)
    for path in ("/", "/approvals", "/tasks", "/tasks?state=paused", "/activity", "/activity?view=runs",
                 "/activity?view=timers", "/activity?view=outbox&status=sent", "/activity?source=hook&status=done",
                 "/egress", "/egress?verdict=refuse", "/handoff"):
        answer = client.get(path)
        assert answer.status_code == 200, (path, answer.text)
        assert '<meta name="viewport"' in answer.text
    for path in ("/tasks?cursor=junk", "/tasks?cursor=WyJ4IiwieSJd", "/activity?view=nope", "/activity?cursor=%00",
                 "/tasks?state=%00", "/egress?verdict=maybe", "/egress?cursor=WyJ4IiwieSJd", "/runs/nope",
                 "/runs/x?cursor=WyJ4Il0", "/tasks/nope", "/approvals/nope", "/approvals/%00", "/tasks/" + "x" * 300,
                 "/activity?view=runs&cursor=" + "A" * 600, "/a/%00"):
        answer = client.get(path)
        assert 400 <= answer.status_code < 500, (path, answer.status_code, answer.text)


def test_the_deploy_docs_setting_makes_links_in_messages_use_the_public_url(tmp_path: Path) -> None:
    block = re.search(r"```toml\n(.*?)```", (DOCS / "deploy.md").read_text(), re.S)
    assert block is not None
    settings = Settings(data_dir=tmp_path, **tomllib.loads(block.group(1)))
    assert settings.base_url == "https://agent.example.org"
    assert linked({"kind": "approval_request", "open": "/a/tok"}, settings.base_url)["link"] == \
        "https://agent.example.org/a/tok"
    assert linked({"kind": "note", "open": "https://evil.example/"}, settings.base_url) == \
        {"kind": "note", "open": "https://evil.example/"}


@BOTH
def test_a_run_of_20000_steps_is_shown_a_page_at_a_time_in_step_order(setup: tuple[World, TestClient, str]) -> None:
    w, client, token = setup
    task = w.task("a long run")
    with write(w.engine) as conn:
        conn.execute(runs.insert().values(id="run_long", session_id=task.session_id, user_id=w.owner,
                                          fencing_token=1, worker="test", outcome="running", started_at=w.clock.now()))
        conn.execute(decisions.insert(), [
            {"id": f"dec_{n:05d}", "run_id": "run_long", "session_id": task.session_id, "step": n,
             "proposal": json.dumps({"n": n}), "created_at": w.clock.now()} for n in range(20_000)])
    sign_in(client, token)
    first = client.get("/runs/run_long")
    assert first.status_code == 200 and len(first.content) < 200_000
    steps = re.findall(r"<tr><td>(\d+)<div", first.text)
    assert steps == [str(n) for n in range(50)]
    following = re.search(r'id="next" href="([^"]+)"', first.text)
    assert following is not None
    second = client.get(following.group(1).replace("&amp;", "&"))
    assert re.findall(r"<tr><td>(\d+)<div", second.text) == [str(n) for n in range(50, 100)]


def test_a_run_page_offers_wakeful_replay_only_for_a_run_that_kept_its_model_context(
        setup: tuple[World, TestClient, str]) -> None:
    w, client, token = setup
    task = w.task("two runs")
    with write(w.engine) as conn:
        for run_id in ("run_echo", "run_model"):
            conn.execute(runs.insert().values(id=run_id, session_id=task.session_id, user_id=w.owner, fencing_token=1,
                                              worker="test", outcome="completed", steps=1, started_at=w.clock.now()))
        conn.execute(run_contexts.insert().values(run_id="run_model", prefix_sha256="0" * 64, prefix="p", tail="{}",
                                                  model="m", harness_version="1", created_at=w.clock.now()))
    sign_in(client, token)
    echo, model = client.get("/runs/run_echo").text, client.get("/runs/run_model").text
    assert "wakeful replay" not in echo and "a run without a model records none" in echo
    assert "<code>wakeful replay run_model</code>" in model and "1 step ·" in model


def test_hostile_posts_are_refused_with_a_page_and_a_code_never_a_500(setup: tuple[World, TestClient, str]) -> None:
    w, client, token = setup
    task, action_id = raise_approval(w)
    signed_out = client.post(f"/approvals/{action_id}/approve", data={"csrf": "x"})
    assert signed_out.status_code == 401 and 'id="code">signed_out<' in signed_out.text
    csrf = sign_in(client, token)
    form = {"content-type": "application/x-www-form-urlencoded"}
    for path, body, status, code in (
            (f"/approvals/{action_id}/approve", b"csrf=" + b"x" * 20_000, 413, "payload_too_large"),
            (f"/approvals/{action_id}/approve", b"csrf=\xff\xfe", 400, "malformed_form"),
            (f"/approvals/{action_id}/approve", b"csrf=%00", 400, "malformed_form"),
            (f"/approvals/{action_id}/launch", f"csrf={csrf}".encode(), 404, "unknown_operation"),
            (f"/tasks/{task.task_id}/explode", f"csrf={csrf}".encode(), 404, "unknown_operation"),
            ("/tasks/nope/pause", f"csrf={csrf}".encode(), 404, "unknown_task"),
            (f"/tasks/{task.task_id}/resume", f"csrf={csrf}".encode(), 409, "invalid_transition")):
        answer = client.post(path, content=body, headers=form)
        assert answer.status_code == status and f'id="code">{code}<' in answer.text, (path, answer.text)
    w.dispatcher.drain()
    assert w.merchant.effects == []


def test_the_handoff_page_lists_the_links_sent_and_opens_a_view_only_live_view(
        engine: Engine, clock: FakeClock, owner: str, settings: Settings) -> None:
    settings = settings.model_copy(update={"computers": True, "public_url": "https://agent.example.org"})
    runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine)
    runtime.prepare()
    assert runtime.live is not None
    with write(engine) as conn:
        token = issue_token(conn, user_id=owner)
        session_id = sessions.create_session(conn, user_id=owner, now=clock.now())
        outbox.enqueue(conn, user_id=owner, session_id=session_id, now=clock.now(), level=Level.ASK,
                       body={"kind": "handoff", "task_id": "tsk_x", "link": "https://agent.example.org/v1/live/tok",
                             "text": "Your tool computer needs you"})
    with TestClient(create_app(runtime, manage_runtime=False), base_url="https://testserver") as client:
        csrf = sign_in(client, token)
        page = client.get("/handoff")
        assert page.status_code == 200 and "https://agent.example.org/v1/live/tok" in page.text
        watched = client.post("/handoff/view", data={"csrf": csrf})
        assert watched.status_code == 200 and "view only" in watched.text


@BOTH
def test_the_owner_serve_creates_is_an_admin_and_no_other_user_is_unless_made_one(
        engine: Engine, clock: FakeClock, settings: Settings) -> None:
    runtime = Runtime(settings, handler=EchoHandler(), clock=clock, engine=engine)
    token = runtime.prepare()
    assert token is not None
    with write(engine) as conn:
        owner_id = user_id_by_name(conn, "owner")
        alice, _ = ensure_user(conn, name="alice", now=clock.now())
        root, _ = ensure_user(conn, name="root", now=clock.now(), admin=True)
        assert (is_admin(conn, owner_id), is_admin(conn, alice), is_admin(conn, root)) == (True, False, True)
    assert runtime.prepare() is None  # a second start neither re-creates the owner nor touches who is admin
    with write(engine) as conn:
        assert is_admin(conn, owner_id) and not is_admin(conn, alice)


@BOTH
def test_only_an_admin_stops_and_starts_everything_and_a_forged_global_form_is_refused(
        setup: tuple[World, TestClient, str]) -> None:
    w, client, token = setup  # the owner made by the fixture is a plain user
    auth = {"Authorization": f"Bearer {token}"}
    csrf = sign_in(client, token)
    assert 'id="stop-everything"' not in client.get("/").text
    for path in ("/everything/stop", "/everything/start"):
        refused = client.post(path, data={"csrf": csrf, "reason": "forged"})
        assert refused.status_code == 403 and 'id="code">admin_required<' in refused.text, refused.text
        answer = client.post(f"/v1/control{path}", json={"reason": "forged"}, headers=auth)
        assert answer.status_code == 403 and answer.json()["error"]["code"] == "admin_required"
    assert client.get("/v1/control", headers=auth).json() == {"stopped": False, "global_stop": False}

    with write(w.engine) as conn:
        _, root_token = ensure_user(conn, name="root", now=w.clock.now(), admin=True)
    assert root_token is not None
    admin = TestClient(client.app, base_url="https://testserver")  # a second browser (the app is already started)
    admin_csrf = sign_in(admin, root_token)
    home = admin.get("/")
    assert 'id="stop-everything"' in home.text and 'action="/everything/stop"' in home.text
    stopped = admin.post("/everything/stop", data={"csrf": admin_csrf, "reason": "incident"})
    assert stopped.status_code == 200 and "STOP recorded over everything" in stopped.text
    assert 'id="start-everything"' in admin.get("/").text
    assert client.get("/v1/control", headers=auth).json() == {"stopped": True, "global_stop": True}
    assert "an admin lifts it" in client.get("/").text
    own_start = client.post("/v1/control/start", headers=auth).json()
    assert own_start["global_stop"] is True and "an admin lifts it" in own_start["note"]
    started = admin.post("/everything/start", data={"csrf": admin_csrf})
    assert started.status_code == 200 and "START recorded over everything" in started.text
    assert client.get("/v1/control", headers=auth).json() == {"stopped": False, "global_stop": False}
    # The API follows the same rule: an admin's bearer token records it, named as the admin's.
    api = client.post("/v1/control/everything/stop", json={"reason": "drill"},
                      headers={"Authorization": f"Bearer {root_token}"})
    assert api.status_code == 200 and api.json()["global_stop"] is True
    with write(w.engine) as conn:
        assert control.stop_state(conn).everything
        assert conn.execute(select(control_table.c.actor).where(control_table.c.user_id.is_(None))
                            .order_by(control_table.c.created_at.desc(), control_table.c.id.desc())
                            ).scalars().first().startswith("admin:")
