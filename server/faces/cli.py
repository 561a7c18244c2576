"""The `wakeful` command line.

Wrong input never ends in a traceback: a refusal is one line (`wakeful: <code>: <message>`) on stderr and exit
code 2; a usage mistake is click's message and exit code 2. Records go to stdout (`--json` for one JSON document),
everything else (logs, progress, explanations) to stderr.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from sqlalchemy import Engine, func, select

from wakeful.proxy.clock import SystemClock
from wakeful.server.acting import approvals, ledger
from wakeful.server.acting.policy import load_policy
from wakeful.server.core import control, holds, speaking, steers
from wakeful.server.core.nudge import nudge
from wakeful.server.errors import BadRequest, WakefulError
from wakeful.server.faces.cli_agent import agent_app
from wakeful.server.faces.cli_common import DataDir, DbUrl, Json, err, print_json, say
from wakeful.server.faces.cli_common import fail as _fail
from wakeful.server.faces.cli_common import open_engine as _engine
from wakeful.server.faces.cli_common import settings_or_exit as _settings
from wakeful.server.faces.cli_egress import egress_app, proxy_app, secret_app
from wakeful.server.faces.cli_eval import eval_cmd
from wakeful.server.faces.cli_hosts import hosts_app
from wakeful.server.faces.cli_image import image_app
from wakeful.server.faces.cli_memory import memory_app
from wakeful.server.faces.cli_sim import sim
from wakeful.server.observe.logs import announce
from wakeful.server.settings import Settings
from wakeful.server.store import users
from wakeful.server.store.db import current_revision, read, write
from wakeful.server.store.tables import ControlKind, EventStatus, OutboxState, RunOutcome, events, outbox, runs, tasks

if TYPE_CHECKING:
    from wakeful.server.runtime import Runtime


class _Wakeful(typer.Typer):
    """The app, with one last net: a refusal that reaches the top is printed as one line, never a traceback."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except WakefulError as exc:
            say(exc.code, exc.message)
            sys.exit(2)
        except Exception as exc:  # a bug, not the user's input: still one line, the traceback on request
            if os.environ.get("WAKEFUL_TRACEBACK"):
                raise
            say("unexpected_error", f"{type(exc).__name__}: {exc} (WAKEFUL_TRACEBACK=1 shows where)")
            sys.exit(1)


app = _Wakeful(rich_markup_mode=None, help="wakeful: a runtime for always-on personal agents.", no_args_is_help=True,
               pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]})
app.add_typer(agent_app, name="agent")
app.add_typer(proxy_app, name="proxy")
app.add_typer(secret_app, name="secret")
app.add_typer(egress_app, name="egress")
app.add_typer(image_app, name="image")
app.add_typer(memory_app, name="memory")
app.add_typer(hosts_app, name="hosts")
app.command("sim")(sim)
app.command("eval")(eval_cmd)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"wakeful {version('wakeful')}")
        except PackageNotFoundError:  # run from a checkout that was never installed
            typer.echo("wakeful (not installed)")
        raise typer.Exit()


@app.callback()
def _main(_version_flag: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                      help="Print the version and exit.")] = False) -> None:
    """wakeful: a runtime for always-on personal agents."""


class _StartupFailureInOneLine(logging.Filter):
    """uvicorn logs a failed start-up with the lifespan's whole traceback; when a refusal caused it (the egress proxy
    did not start, a stop was asked for meanwhile) its own message says everything, so that is what is logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        cause = re.search(r"^wakeful\.server\.errors\.\w+: (.*)\Z", text.rstrip(), re.M)
        if text.startswith("Traceback") and cause:
            record.msg, record.args = f"wakeful: {cause[1]}", ()
        return True


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise WakefulError("cannot_listen", f"{host}:{port}: {exc.strerror} (host is an address of this "
                                                "machine's, or 0.0.0.0 for all)") from None
    return True


Host = Annotated[str | None, typer.Option(help="Listen address [env WAKEFUL_HOST; default 127.0.0.1].")]
Port = Annotated[int | None, typer.Option(help="Listen port [env WAKEFUL_PORT; default 8787].")]


def _log_to_stderr() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _refuse_taken_ports(settings: Settings, *, proxy: bool) -> None:
    from wakeful.server.egress.grants import load_egress_rules
    from wakeful.server.egress.proxyctl import proxy_port_taken

    if proxy and settings.proxy:
        load_egress_rules(settings.policies / "egress.toml")
        if proxy_port_taken(settings):
            raise WakefulError("proxy_port_in_use", f"127.0.0.1:{settings.proxy_port} is taken (another wakeful "
                                                    "serve?): set proxy_port, or proxy = false")
    if not _port_free(settings.host, settings.port):
        raise WakefulError("port_in_use", f"{settings.host}:{settings.port}: address already in use (another "
                                          "wakeful serve?): set port or --port")


def _prepare(runtime: Runtime) -> str | None:
    """`runtime.prepare()`, or exit 2 with why the database cannot be migrated (a newer version migrated it)."""
    try:
        return runtime.prepare()
    except WakefulError as exc:
        _fail(exc)


def _show_token(token: str | None) -> None:
    if token:
        announce("Created user 'owner'. Its API token is on stdout, shown once (`wakeful token` issues a new one).")
        typer.echo(token)


def _observe(settings: Settings) -> None:
    """Log lines in the settings' format; metrics kept in the shared directory the api's /metrics sums (serve
    emptied it when it started them; started on their own, as the systemd units do, they add to what is there)."""
    from wakeful.server.observe import metrics
    from wakeful.server.observe.logs import configure_logging

    configure_logging(settings)
    if metrics.ENV not in os.environ:
        metrics.share_across_processes(settings.metrics_dir, clean=False)


@app.command()
def serve(data_dir: DataDir = None, database_url: DbUrl = None, host: Host = None, port: Port = None) -> None:
    """Run wakeful on one data directory: prepare the database (the owner's token is printed once, on the first
    start), then start `wakeful api`, `wakeful worker` and `wakeful proxy` as child processes and supervise them (a
    child that exits is restarted, said in the log; SIGTERM or Ctrl-C stops them all, the API first). Their PIDs
    are in the log and in <data_dir>/run/*.pid. Tool computers (computers = true) live in the API, which serves them
    to the worker on <data_dir>/run/computers.sock."""
    from wakeful.server.faces.supervise import Supervisor
    from wakeful.server.observe import metrics
    from wakeful.server.observe.logs import configure_logging

    _log_to_stderr()
    settings = _settings(data_dir, database_url, host=host, port=port)
    configure_logging(settings)
    try:
        _refuse_taken_ports(settings, proxy=True)
    except WakefulError as exc:
        _fail(exc)
    engine = _engine(settings)  # migrates: its logs on stderr, before the token on stdout
    with write(engine) as conn:
        _, token = users.ensure_user(conn, name=users.OWNER, now=SystemClock().now(), admin=True)
    engine.dispose()
    # Before the children start (they inherit the directory) and before anything is observed: the api's /metrics
    # sums what every child observed since serve started.
    metrics.share_across_processes(settings.metrics_dir, clean=True)
    _show_token(token)
    names: tuple[str, ...] = ("api", "worker")
    if settings.proxy:
        names += ("proxy",)
    # The children are forks of this process: what they run is imported once, here, so a child's (re)start costs
    # a fork and not an interpreter's start. A setting a child refuses (a connector declaration, say) stops serve
    # with exit 2.
    _preload(settings)
    raise typer.Exit(Supervisor(settings, _child_main, names=names).run())


_PRELOAD = ("uvicorn", "uvicorn.lifespan.on", "uvicorn.protocols.http.h11_impl",
            "uvicorn.protocols.http.httptools_impl",
            "uvicorn.loops.asyncio", "uvicorn.loops.uvloop", "wakeful.server.faces.http", "wakeful.server.runtime",
            "wakeful.server.egress.proxyctl", "wakeful.proxy.server", "wakeful.proxy.config",
            "wakeful.proxy.channel", "wakeful.proxy.tls")


def _preload(settings: Settings) -> None:
    """Import what `wakeful api`, `worker` and `proxy` run (optional parts that are not installed are skipped).
    Imports only: no thread, connection, socket or event loop is made, which a fork would not carry well."""
    import importlib

    modules = list(_PRELOAD)
    if settings.anthropic_api_key is not None:
        modules += ["wakeful.server.harness.model_anthropic", "wakeful.server.harness.wake"]
    for name in modules:
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def _child_main(argv: list[str]) -> int:
    """A child of serve runs `wakeful <argv>` (`server.faces.supervise`); its exit code."""
    try:
        app(args=argv, prog_name="wakeful")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


@app.command()
def api(data_dir: DataDir = None, database_url: DbUrl = None, host: Host = None, port: Port = None,
        await_proxy: Annotated[bool, typer.Option("--await-proxy", hidden=True, help=(
            "Listen only once the egress proxy does (`wakeful serve` starts it beside the api)."))] = False) -> None:
    """Serve HTTP: /v1, /mcp, the console and webhooks (each delivery committed before it is acknowledged), and the
    egress proxy's policy decisions. Runs no runs: every commit wakes `wakeful worker` (a socket in <data_dir>/run on
    SQLite, LISTEN/NOTIFY on PostgreSQL). It holds the tool computers (computers = true) and serves them to the worker
    on <data_dir>/run/computers.sock. Start `wakeful proxy` beside it when proxy = true (`wakeful serve` does all of
    that)."""
    import uvicorn

    from wakeful.server.egress.proxyctl import abort_proxy_start
    from wakeful.server.faces.http import QuietServer, create_app
    from wakeful.server.runtime import Role, Runtime, load_registry, make_handler

    _log_to_stderr()
    logging.getLogger("uvicorn.error").addFilter(_StartupFailureInOneLine())
    # The event loop acknowledges deliveries while worker threads run; at CPython's default 5 ms, a loop coming back
    # from a system call waited up to that long for a busy thread to let go of the interpreter lock, several times
    # per request. At 0.5 ms: ack p99 at 1,000/s and throughput at saturation both improve (bench/ingest.py).
    sys.setswitchinterval(0.0005)
    settings = _settings(data_dir, database_url, host=host, port=port)
    _observe(settings)
    try:
        registry = load_registry(settings)
        _refuse_taken_ports(settings, proxy=False)
    except WakefulError as exc:
        _fail(exc)
    runtime = Runtime(settings, handler=make_handler(settings, registry), registry=registry, role=Role.API)
    _show_token(_prepare(runtime))

    class Serving(QuietServer):
        """Says where it serves only once it does; a SIGTERM or Ctrl-C while it starts stops the start, too."""

        signalled = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            self.signalled = True
            super().handle_exit(sig, frame)
            if not self.started:
                abort_proxy_start()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                announce(f"wakeful serving on http://{settings.host}:{settings.port} (database {settings.db_shown})")

    app = create_app(runtime, proxy_child=False, await_proxy=await_proxy)
    server = Serving(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                    access_log=False, timeout_graceful_shutdown=10))
    try:
        server.run()
    except SystemExit:  # uvicorn's way to end a failed start-up; what failed is logged above
        if server.signalled:
            return  # stopped while starting, as asked
        raise typer.Exit(2) from None


@app.command()
def worker(data_dir: DataDir = None, database_url: DbUrl = None,
           workers: Annotated[int | None, typer.Option("--workers", min=1, max=64, help=(
               "Worker threads that run sessions [env WAKEFUL_WORKERS; default 2]."))] = None) -> None:
    """Run the runs: workers, scheduler, dispatcher, reconciler and sweeper, until SIGTERM or Ctrl-C. Woken at once
    by `wakeful api`'s commits (a socket in <data_dir>/run on SQLite, LISTEN/NOTIFY on PostgreSQL), by its own, and
    by a poll as the fallback. On SQLite one worker process at a time (a second is refused: worker_running); on
    PostgreSQL start as many as you like, on other hosts too while tool computers are off. With computers = true
    they are the API's, and the worker reaches them on <data_dir>/run/computers.sock: on the API's host."""
    import signal

    from wakeful.server.runtime import Role, Runtime, load_registry, make_handler

    _log_to_stderr()
    settings = _settings(data_dir, database_url, workers=workers)
    _observe(settings)
    try:
        registry = load_registry(settings)
    except WakefulError as exc:
        _fail(exc)
    runtime = Runtime(settings, handler=make_handler(settings, registry), registry=registry, role=Role.WORKER)
    _show_token(_prepare(runtime))
    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)  # the loops' threads inherit it: only sigwait takes them
    try:
        runtime.start()
    except WakefulError as exc:
        runtime.stop()
        _fail(exc)
    announce(f"wakeful worker running {settings.workers} worker threads (pid {os.getpid()}, database "
             f"{settings.db_shown})")
    received = signal.sigwait(stop_signals)
    announce(f"wakeful worker: {signal.Signals(received).name}: finishing the runs in progress")
    runtime.stop()


@app.command()
def stop(reason: Annotated[str, typer.Option(help="Why, for the record.")] = "",
         user: Annotated[str | None, typer.Option(help="Stop one user; default: the whole deployment.")] = None,
         data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """STOP: workers, scheduler and dispatcher halt before their next step until `wakeful start`."""
    _set_stop(True, reason, user, data_dir, database_url)


@app.command()
def start(reason: Annotated[str, typer.Option(help="Why, for the record.")] = "",
          user: Annotated[str | None, typer.Option(help="Lift one user's STOP; default: the deployment's.")] = None,
          data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Lift a STOP."""
    _set_stop(False, reason, user, data_dir, database_url)


def _set_stop(stopped: bool, reason: str, user: str | None, data_dir: Path | None, database_url: str | None) -> None:
    settings = _settings(data_dir, database_url, existing=True)
    try:
        with write(_engine(settings)) as conn:
            user_id = users.user_id_by_name(conn, user) if user else None
            control.set_stop(conn, stopped=stopped, user_id=user_id, actor="cli", reason=reason,
                             now=SystemClock().now())
            state = control.stop_state(conn)
    except WakefulError as exc:
        _fail(exc)
    nudge(settings)
    scope = f"user {user}" if user else "everything"
    typer.echo(f"{'STOP' if stopped else 'START'} recorded for {scope}.")
    if not stopped and state.everything:  # the answer says what holds now, not what was asked for
        typer.echo("A STOP over everything is still in force: lift it with `wakeful start` (no --user).")



@app.command()
def token(user: Annotated[str, typer.Option(help="Whose token.")] = "owner",
          data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Issue a new API token for a user (the old one stops working). Prints only the token."""
    engine = _engine(_settings(data_dir, database_url))
    with write(engine) as conn:
        try:
            user_id, _ = users.ensure_user(conn, name=users.OWNER, now=SystemClock().now(), admin=True) \
                if user == users.OWNER else (users.user_id_by_name(conn, user), None)
        except WakefulError as exc:
            _fail(exc)
        typer.echo(users.issue_token(conn, user_id=user_id))


@app.command("user-add")
def user_add(name: str, admin: Annotated[bool, typer.Option(
                 "--admin", help="Also let this user STOP / START the whole deployment from the console.")] = False,
             data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Create a user and print its API token (shown once)."""
    engine = _engine(_settings(data_dir, database_url))
    with write(engine) as conn:
        _, new = users.ensure_user(conn, name=name, now=SystemClock().now(), admin=admin)
    if new is None:
        say("user_exists", f"{name!r} exists; `wakeful token --user {name}` re-issues its token")
        raise typer.Exit(2)
    typer.echo(new)


@app.command()
def status(as_json: Json = False, data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Counts of events, runs and outbox messages by state, and whether STOP is in force."""
    engine = _engine(_settings(data_dir, database_url, existing=True))
    counted: dict[str, dict[str, int]] = {}
    with read(engine) as conn:
        stop_state = control.stop_state(conn)
        for table, column, states in ((events, events.c.status, EventStatus), (runs, runs.c.outcome, RunOutcome),
                                      (outbox, outbox.c.state, OutboxState)):
            counts: dict[str, int] = dict(conn.execute(select(column, func.count()).group_by(column)).all())
            counted[table.name] = {s.value: counts.get(s.value, 0) for s in states}
    if as_json:
        print_json({**counted, "stop": {"everything": stop_state.everything, "users": sorted(stop_state.users)}})
        return
    for name, by_state in counted.items():
        typer.echo(f"{name}: " + ", ".join(f"{state}={n}" for state, n in by_state.items()))
    typer.echo(f"stop: {'in force for everything' if stop_state.everything else 'not in force'}"
               + (f"; users stopped: {len(stop_state.users)}" if stop_state.users else ""))


@app.command("migrate")
def migrate_cmd(data_dir: DataDir = None, database_url: DbUrl = None,
                to: Annotated[str | None, typer.Option("--to", help=(
                    "A revision to go to instead of the newest, e.g. back to an older release's before installing "
                    "it (`base`: no tables). Refused, changing nothing, where the database holds records the older "
                    "schema cannot."))] = None) -> None:
    """Create or upgrade the database schema (or take it to the revision --to names)."""
    settings = _settings(data_dir, database_url)
    engine = _engine(settings, to or "head")
    newest = ", the newest" if to is None else ""
    typer.echo(f"schema is at revision {current_revision(engine) or 'base (no tables)'}{newest}")


Target = Annotated[str, typer.Argument(help="The task or action ID.")]
UserOpt = Annotated[str, typer.Option("--user", help="Whose records (the CLI acts as that user).")]
Reason = Annotated[str, typer.Option(help="Why, for the record.")]


def _as_user(data_dir: Path | None, database_url: str | None, user: str) -> tuple[Settings, Engine, str]:
    settings = _settings(data_dir, database_url, existing=True)
    engine = _engine(settings)
    with read(engine) as conn:
        return settings, engine, users.user_id_by_name(conn, user)


def _control(kind: ControlKind, task: str, reason: str, user: str, data_dir: Path | None,
             database_url: str | None) -> None:
    try:
        _, engine, user_id = _as_user(data_dir, database_url, user)
        with write(engine) as conn:
            state = control.set_task_state(conn, user_id=user_id, task_id=task, kind=kind, actor=f"cli:{user}",
                                           reason=reason, now=SystemClock().now())
    except WakefulError as exc:
        _fail(exc)
    nudge(_settings(data_dir, database_url))
    typer.echo(f"{task} is {state.value}.")


@app.command()
def pause(task: Target, reason: Reason = "", user: UserOpt = "owner", data_dir: DataDir = None,
          database_url: DbUrl = None) -> None:
    """Pause a task: a run in progress stops at its next step; nothing is dispatched for it until resume."""
    _control(ControlKind.PAUSE, task, reason, user, data_dir, database_url)


@app.command()
def resume(task: Target, reason: Reason = "", user: UserOpt = "owner", data_dir: DataDir = None,
           database_url: DbUrl = None) -> None:
    """Resume a paused task."""
    _control(ControlKind.RESUME, task, reason, user, data_dir, database_url)


@app.command()
def revoke(task: Target, reason: Reason = "", user: UserOpt = "owner", data_dir: DataDir = None,
           database_url: DbUrl = None) -> None:
    """Withdraw a delegation: queued dispatches are voided, timers and waits end; what already left is still
    reconciled and reported, never claimed undone."""
    _control(ControlKind.REVOKE, task, reason, user, data_dir, database_url)


@app.command("close")
def close_task(task: Target, reason: Reason = "", user: UserOpt = "owner", data_dir: DataDir = None,
               database_url: DbUrl = None) -> None:
    """Close a task (only the user closes or reopens one)."""
    _control(ControlKind.CLOSE, task, reason, user, data_dir, database_url)


@app.command()
def reopen(task: Target, reason: Reason = "", user: UserOpt = "owner", data_dir: DataDir = None,
           database_url: DbUrl = None) -> None:
    """Reopen a closed task."""
    _control(ControlKind.REOPEN, task, reason, user, data_dir, database_url)


Text = Annotated[str, typer.Argument(help="What you want the agent to hear, in your own words.")]


@app.command("say")
def say_to_task(task: Annotated[str, typer.Argument(help="The task's ID (task_…).")], text: Text,
                user: UserOpt = "owner", data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Write to the agent about a task. The task is held at once (nothing new goes out) and a run in progress
    stops at its next step; the next run reads your message and either confirms a pause or lets the work go on."""
    if not text.strip():
        say("invalid_parameter", "the message is empty")
        raise typer.Exit(2)
    try:
        _, engine, user_id = _as_user(data_dir, database_url, user)
        with write(engine) as conn:
            said = holds.say(conn, user_id=user_id, task_id=task, text=text, actor=f"cli:{user}",
                             now=SystemClock().now())
    except WakefulError as exc:
        _fail(exc)
    nudge(_settings(data_dir, database_url))
    typer.echo(f"{task} is {said.state.value}; your message is {said.event_id}.")


def _decide(action: str, approve: bool, reason: str, user: str, data_dir: Path | None,
            database_url: str | None) -> None:
    try:
        settings, engine, user_id = _as_user(data_dir, database_url, user)
        policy = load_policy(settings.policies / "policy.toml")
        with write(engine) as conn:
            decided = approvals.decide(conn, user_id=user_id, action_id=action, approve=approve,
                                       actor=f"cli:{user}", policy=policy, now=SystemClock().now(), reason=reason)
    except WakefulError as exc:
        _fail(exc)
    nudge(settings)
    typer.echo(f"{action}: {decided.verdict.kind.value} ({decided.verdict.code}): {decided.verdict.reason}")


@app.command()
def approve(action: Target, reason: Reason = "", user: UserOpt = "owner", data_dir: DataDir = None,
            database_url: DbUrl = None) -> None:
    """Approve an action waiting for approval; it is re-admitted against the facts as they are now."""
    _decide(action, True, reason, user, data_dir, database_url)


@app.command()
def deny(action: Target, reason: Reason = "", user: UserOpt = "owner", data_dir: DataDir = None,
         database_url: DbUrl = None) -> None:
    """Deny an action waiting for approval."""
    _decide(action, False, reason, user, data_dir, database_url)


def _answer_steer(steer: str, confirmed: bool, user: str, data_dir: Path | None, database_url: str | None) -> None:
    answer = steers.confirm if confirmed else steers.reject
    try:
        settings, engine, user_id = _as_user(data_dir, database_url, user)
        with write(engine) as conn:
            decided = answer(conn, user_id=user_id, steer_id=steer, actor=f"cli:{user}", now=SystemClock().now())
    except WakefulError as exc:
        _fail(exc)
    nudge(settings)
    typer.echo(f"{steer}: {decided.state.value}; {decided.task_id} is at version {decided.version}.")


SteerId = Annotated[str, typer.Argument(help="The proposed steer's ID (stp_…), from its card or `wakeful ledger`.")]


@app.command()
def confirm(steer: SteerId, user: UserOpt = "owner", data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Confirm a steer the agent proposed (it asked for more than the task had): it becomes the next version."""
    _answer_steer(steer, True, user, data_dir, database_url)


@app.command()
def reject(steer: SteerId, user: UserOpt = "owner", data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Reject a steer the agent proposed: the task stays as it is."""
    _answer_steer(steer, False, user, data_dir, database_url)


@app.command()
def preferences(
        timezone: Annotated[str | None, typer.Option(help="Your IANA time zone, e.g. Asia/Hong_Kong.")] = None,
        quiet: Annotated[str | None, typer.Option(help="Quiet hours, local HH:MM-HH:MM (23:00-07:30), or off.")] = None,
        budget: Annotated[str | None, typer.Option(help="Messages per local day, or off.")] = None,
        user: UserOpt = "owner", data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Show, or set, when the agent may speak: time zone, quiet hours, daily attention budget (as JSON)."""
    changes: dict[str, Any] = {} if timezone is None else {"timezone": timezone}
    try:
        if quiet is not None:
            changes["quiet_hours"] = None if quiet == "off" else _quiet_hours(quiet)
        if budget is not None:
            changes["attention_budget"] = None if budget == "off" else _budget(budget)
        _, engine, user_id = _as_user(data_dir, database_url, user)
        with write(engine) as conn:
            print_json(speaking.describe(speaking.change_preferences(conn, user_id=user_id, changes=changes)))
    except WakefulError as exc:
        _fail(exc)


def _quiet_hours(text: str) -> speaking.QuietHours:
    start, _, end = text.partition("-")
    return speaking.QuietHours.parse(start, end)


def _budget(text: str) -> int:
    if not text.isdigit() or int(text) > 1000:
        raise BadRequest("invalid_parameter", f"{text!r}: the budget is a whole number of messages, 0..1000, or off")
    return int(text)


@app.command("ledger")
def ledger_cmd(task: Annotated[str, typer.Argument(help="A task ID; `export` for every task as JSON Lines (or, with "
                                                        "FILE, the verifiable ledger); `verify`; `key`.")],
               file: Annotated[Path | None, typer.Argument(help="For `export FILE`: the verifiable ledger, every "
                                                                "row with its hashes and signed checkpoints.")] = None,
               output: Annotated[Path | None, typer.Option("--output", "-o", help="For export: a file.")] = None,
               export: Annotated[Path | None, typer.Option("--export", help="For verify: check this export offline, "
                                                                            "without the database.")] = None,
               key: Annotated[str | None, typer.Option("--key", help="For verify: the ledger's public key "
                                                                     "(ed25519:…, or a file holding it).")] = None,
               as_json: Json = False, user: UserOpt = "owner", data_dir: DataDir = None,
               database_url: DbUrl = None) -> None:
    """A task's whole history in order; `wakeful ledger export` writes every task's as JSON Lines.

    The verifiable ledger: `wakeful ledger verify` checks every history row against its hash chain and signed
    checkpoints and names the first bad row (exit 1); `wakeful ledger export FILE` writes the rows with their
    hashes and checkpoints; `wakeful ledger verify --export FILE --key KEY` checks such a file offline;
    `wakeful ledger key` prints the public key."""
    if task == "export" and file is not None and output is not None:
        _fail(BadRequest("invalid_parameter", f"`export {file}` writes the verifiable ledger and `export -o {output}` "
                                              "every task's history as JSON Lines: give one"))
    if task in ("verify", "key") or (task == "export" and file is not None):
        from wakeful.server.faces import cli_ledger

        try:
            if task == "verify":
                cli_ledger.verify_ledger(export=export, key=key, as_json=as_json, data_dir=data_dir,
                                         database_url=database_url)
            elif task == "key":
                cli_ledger.print_key(data_dir=data_dir, database_url=database_url)
            else:
                assert file is not None
                cli_ledger.export_ledger(file, data_dir=data_dir, database_url=database_url)
        except WakefulError as exc:
            _fail(exc)
        return
    try:
        _, engine, user_id = _as_user(data_dir, database_url, user)
        with read(engine) as conn:
            if task == "export":
                task_ids = conn.execute(select(tasks.c.id).where(tasks.c.user_id == user_id)
                                        .order_by(tasks.c.created_at)).scalars().all()
                lines = [json.dumps({"task_id": t, **e}, sort_keys=True)
                         for t in task_ids for e in ledger.entries(conn, task_id=t, user_id=user_id)]
                text = "\n".join(lines) + ("\n" if lines else "")
                if output is None:
                    typer.echo(text, nl=False)
                else:
                    try:
                        output.write_text(text)
                    except OSError as exc:
                        raise WakefulError("cannot_write", f"cannot write {output}: {exc.strerror}") from None
                    err.print(f"wrote {len(lines)} entries for {len(task_ids)} tasks to {output}")
                return
            entries = ledger.entries(conn, task_id=task, user_id=user_id)
    except WakefulError as exc:
        _fail(exc)
    if as_json:
        print_json({"task_id": task, "entries": entries})
        return
    for entry in entries:
        typer.echo(ledger.describe(entry))


@app.command()
def demo(data_dir: DataDir = None) -> None:
    """Run the subscription-cancellation delegation end to end against the merchant simulator, print the ledger."""
    from wakeful.server.faces.demo import run_demo

    _settings(data_dir, None)  # a broken config stops the demo too, as it stops every command
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    count = run_demo(data_dir)
    if count != 1:
        err.print(f"[red]wakeful demo: the merchant recorded {count} cancellations; exactly 1 was expected[/red]")
        raise typer.Exit(1)


@app.command()
def mcp(url: Annotated[str | None, typer.Option(
            "--url", envvar="WAKEFUL_URL", show_envvar=False,
            help="The running server, e.g. http://127.0.0.1:8787 (its /mcp) [env WAKEFUL_URL].")] = None,
        token_file: Annotated[Path | None, typer.Option(
            "--token-file", envvar="WAKEFUL_AGENT_TOKEN_FILE", show_envvar=False,
            help="A file holding the credential [env WAKEFUL_AGENT_TOKEN_FILE; or the credential itself in "
                 "WAKEFUL_AGENT_TOKEN].")] = None) -> None:
    """MCP over stdio for a client that starts wakeful (`claude mcp add wakeful -- wakeful mcp --url …`): a bridge
    to a running `wakeful serve`'s /mcp. It opens no database; logs go to stderr."""
    import anyio

    from wakeful.server.faces.bridge import endpoint, run_bridge

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if not url:
        raise WakefulError("missing_url", "no server URL: pass --url http://127.0.0.1:8787 or set WAKEFUL_URL")
    token = os.environ.get("WAKEFUL_AGENT_TOKEN", "").strip()
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise WakefulError("unreadable_token_file", f"cannot read {token_file}: {exc.strerror}") from None
        if not token:
            raise WakefulError("missing_token", f"{token_file} is empty: it should hold the credential")
    if not token:
        raise WakefulError("missing_token", "no credential: pass --token-file FILE, or set WAKEFUL_AGENT_TOKEN")
    anyio.run(run_bridge, endpoint(url), token)


@app.command()
def replay(run_id: Annotated[str, typer.Argument(help="The run to re-run from its records.")],
           data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Re-run a recorded model run with its recorded decisions and tool results; show where the outcome differs."""
    from wakeful.server.harness.replay import replay as replay_run
    from wakeful.server.runtime import load_registry

    settings = _settings(data_dir, database_url, existing=True)
    try:
        registry = load_registry(settings)
        with read(_engine(settings)) as conn:
            report = replay_run(conn, run_id, registry=registry, computers=settings.computers,
                                instructions=settings.instructions_file or settings.data_dir / "instructions.md")
    except WakefulError as exc:
        _fail(exc)
    for line in report.lines():
        typer.echo(line)
    if report.differences:
        raise typer.Exit(1)

