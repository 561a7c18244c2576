"""The console: server-rendered pages at `/` for the people a wakeful server serves (docs/console.md).

Sign in with a user token (a session cookie, a CSRF token on every form), then: approval cards with approve / deny,
tasks with everything their records say and pause / resume / revoke / close, STOP / START, activity (events, runs
with their history a page at a time, timers, the outbox), the egress audit, memory and the handoff page. A one-time
link in an approval request opens its card; deciding still takes the signed-in user.

Modules: `signin` (console sessions and CSRF), `web` (templates, forms, refusals as pages, the signed-in
dependency), `account` (sign in / out, the home page, STOP / START), `approvals`, `tasks`, `activity` (with the
egress audit and handoff pages), `memory` (records; confirm, reject, correct, forget), `links` (where an approval
link lands), `templates/`.
May import: anything in `server` below `faces`, and `faces.bodies`, `faces.pages`, `faces.memory_views`; only
`faces.http` imports it.
"""

from fastapi import APIRouter

from wakeful.server.faces.console import account, activity, approvals, links, memory, tasks

__all__ = ["console_routers"]


def console_routers() -> list[APIRouter]:
    """Every console page's router, for `create_app` to include."""
    return [account.router, approvals.router, tasks.router, activity.router, memory.router, links.router]
