"""The egress proxy's place in a deployment: the vault keys, the deployment CA, the decider channel that `wakeful
serve` answers on, and `wakeful proxy` run as its child process.

The proxy holds no policy: it asks the server over a unix socket (owner-only, in `<data_dir>/run/`) and
authenticates with a token the server writes there at each start; the proxy reads that file again at each connect,
so it follows the server through a restart. The vault's secrets are decrypted only in the proxy process; the server
never reads them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.dialects.sqlite import dialect as sqlite_dialect

from wakeful.proxy.clock import Clock
from wakeful.proxy.contract import DecisionRequest, Verdict
from wakeful.proxy.vault import KEY_ENV, Key, KeyRing, Vault, init_key, keys_from_env, rotate_key_file
from wakeful.server.egress import grants as egress
from wakeful.server.errors import WakefulError
from wakeful.server.observe import metrics
from wakeful.server.settings import Settings, child_environment
from wakeful.server.store.db import read, write

if TYPE_CHECKING:
    from wakeful.proxy.audit import EgressRecord
    from wakeful.proxy.channel import DeciderServer

__all__ = ["DeciderService", "ProxyChild", "abort_proxy_start", "decider_token", "new_decider_token", "open_vault",
           "proxy_port_taken", "rotate_vault_key", "run_proxy", "serve_egress", "vault_keys"]

log = logging.getLogger(__name__)
TOKEN_FILE = "decider.token"
READY_TIMEOUT = 20.0


def _keys_in_env() -> bool:
    return bool(os.environ.get(KEY_ENV, "").strip())


def vault_keys(settings: Settings) -> KeyRing:
    """The vault's keys: from `WAKEFUL_VAULT_KEY` when set, else the key file (created 0600 on first use)."""
    if _keys_in_env():
        return keys_from_env()
    return init_key(settings.vault_key_path)


def open_vault(settings: Settings) -> Vault:
    return Vault(settings.vault_path, vault_keys(settings))


def rotate_vault_key(settings: Settings) -> Key:
    """A fresh key in the key file for every credential and for the deployment CA's private key: the old keys leave
    the file only once both are sealed under the new one (a CA sealed under a key no longer loaded stops the proxy).
    Raises `VaultError` (`CAError` for the CA) with the old keys still in the file."""
    from wakeful.proxy.tls import CA_KEY_FILE, load_or_create_ca

    def reseal_ca(both: KeyRing) -> None:
        if (settings.proxy_dir / CA_KEY_FILE).exists():
            load_or_create_ca(settings.proxy_dir, both)  # re-seals a key found under an old one

    return rotate_key_file(open_vault(settings), settings.vault_key_path, reseal=reseal_ca)


def _token_path(settings: Settings) -> Path:
    return settings.decider_socket.parent / TOKEN_FILE


def new_decider_token(settings: Settings) -> str:
    """A fresh channel token for this server run, written owner-only beside the socket."""
    directory = settings.decider_socket.parent
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    token = secrets.token_urlsafe(32)
    path = _token_path(settings)
    tmp = path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)
    return token


def _kept_token(settings: Settings) -> str | None:
    try:
        return _token_path(settings).read_text().strip() or None
    except FileNotFoundError:
        return None


def _current_token(settings: Settings, first: str) -> Callable[[], str]:
    """The token file as it is now, for each connect of the proxy to the decider: `wakeful api` writes a new one at
    each start (a stale one from a killed api may be all the proxy found when it started). The last one read when
    the file is gone or unreadable: the connect then fails on its own, and the next one reads again."""
    last = first

    def current() -> str:
        nonlocal last
        with contextlib.suppress(OSError, UnicodeDecodeError):
            last = _kept_token(settings) or last
        return last

    return current


def decider_token(settings: Settings, *, wait: float = 0.0) -> str:
    """The running server's channel token (for `wakeful proxy`), waiting up to `wait` seconds for `wakeful api` to
    write it as it starts (under systemd the proxy's unit starts beside the api's)."""
    deadline = time.monotonic() + wait
    token = _kept_token(settings)
    if token is None and wait:
        log.info("waiting up to %g s for `wakeful api` to open the decider channel (%s)", wait, _token_path(settings))
    while token is None and time.monotonic() < deadline:
        time.sleep(0.1)  # starting only: one file, read ten times a second for at most `wait`
        token = _kept_token(settings)
    if token is not None:
        return token
    within = f" within {wait:g} s" if wait else ""
    raise WakefulError("decider_unavailable", f"no running `wakeful serve` or `wakeful api` for {settings.data_dir}"
                                              f"{within}: start it first (it answers the proxy's policy questions)")


class _InlineLookup:
    """The tool-computer credential lookup on a connection of its own, for the event loop to run inline.

    It is one statement over a few indexed rows: tens of microseconds on SQLite, against about a millisecond for a
    pooled SQLAlchemy transaction behind a thread hop. Autocommit, so each lookup reads the newest committed state
    (a STOP or a revocation counts from the next request on), and `fetchall` so no statement keeps a snapshot open.
    It never waits for a lock (busy timeout 0): `None` tells the caller to take the ordinary path instead."""

    def __init__(self, path: str) -> None:
        compiled = egress.client_state_statement().compile(
            dialect=sqlite_dialect(paramstyle="named"), compile_kwargs={"render_postcompile": True})
        self._sql = str(compiled)
        self._params = dict(compiled.params)
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=0)
        self._conn.execute("PRAGMA query_only = ON")
        self._lock = threading.Lock()

    def state(self, digest: str) -> tuple[egress.ClientState | None] | None:
        """(the state,) or None when SQLite could not answer at once (busy, or in use by another thread)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            rows = self._conn.execute(self._sql, {**self._params, "digest": digest}).fetchall()
        except sqlite3.Error as exc:
            log.debug("inline egress lookup unavailable (%s); using the pooled path", type(exc).__name__)
            return None
        finally:
            self._lock.release()
        return (egress.client_state(rows[0] if rows else None),)

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _sqlite_file(engine: Engine) -> str | None:
    url = engine.url
    if engine.dialect.name != "sqlite" or url.query or not url.database or url.database == ":memory:":
        return None
    return url.database if Path(url.database).is_file() else None


class DeciderService:
    """Answers the proxy from the records.

    Tool-computer requests (every request of every tool computer's browser) are looked up inline on the event loop
    when the database is a SQLite file (`_InlineLookup`); everything else, connector grants included, runs in a
    thread through SQLAlchemy, so the event loop never waits on a lock or on a long read."""

    def __init__(self, engine: Engine, clock: Clock, settings: Settings) -> None:
        self._engine = engine
        self._clock = clock
        self._rules_path = settings.policies / "egress.toml"
        self._rules = egress.load_egress_rules(self._rules_path)  # a typo stops the server at start
        self._rules_stamp = self._stamp()
        path = _sqlite_file(engine)
        self._inline = _InlineLookup(path) if path is not None else None

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._rules_path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def _current_rules(self) -> egress.EgressRules:
        stamp = self._stamp()
        if stamp != self._rules_stamp:
            try:
                self._rules = egress.load_egress_rules(self._rules_path)
            except WakefulError as exc:
                # Fail closed: a broken edit allows nothing until it is fixed.
                log.error("%s; tool computers reach nothing until it is fixed", exc.message)
                self._rules = egress.EgressRules()
            self._rules_stamp = stamp
        return self._rules

    def decide_inline(self, req: DecisionRequest) -> Verdict | None:
        """The verdict without a transaction or a thread, or None when it needs the ordinary path."""
        if req.client != "tool_computer" or self._inline is None:
            return None
        digest = egress.client_digest(req)
        if digest is None:
            return egress.tool_computer_verdict(req, None, self._current_rules())
        found = self._inline.state(digest)
        if found is None:
            return None
        return egress.tool_computer_verdict(req, found[0], self._current_rules())

    def decide_now(self, req: DecisionRequest) -> Verdict:
        verdict = self.decide_inline(req)
        if verdict is not None:
            return verdict
        rules = self._current_rules()
        transaction = write if req.client == "connector" else read  # an allowed connector grant is used up
        with transaction(self._engine) as conn:
            return egress.decide(conn, req, now=self._clock.now(), rules=rules)

    def record_now(self, records: list[EgressRecord]) -> None:
        with write(self._engine) as conn:
            egress.store_audit(conn, records, now=self._clock.now())
        metrics.egress_recorded(records)

    async def decide(self, req: DecisionRequest) -> Verdict:
        verdict = self.decide_inline(req)
        if verdict is not None:
            return verdict
        return await asyncio.to_thread(self.decide_now, req)

    async def record(self, records: list[EgressRecord]) -> None:
        await asyncio.to_thread(self.record_now, records)

    def close(self) -> None:
        if self._inline is not None:
            self._inline.close()


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def proxy_port_taken(settings: Settings) -> bool:
    return _listening(settings.proxy_port)


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


_starting: set[ProxyChild] = set()


def abort_proxy_start() -> None:
    """Stop waiting for a proxy child that is still starting (its `start` raises `interrupted`): a SIGTERM to a
    starting server ends the start at once instead of after the proxy's whole start-up timeout. Signal-safe: it
    only sets events."""
    for child in list(_starting):
        child._abort.set()


class ProxyChild:
    """`wakeful proxy` as a child of this process: restarted if it dies, stopped by its PID with the server.

    One thread spawns and watches it for its whole life: the kernel's parent-death signal is tied to the thread
    that spawned the child, so that thread must be the one that lives as long as the child is wanted."""

    def __init__(self, settings: Settings, *, log_file: Path | None = None) -> None:
        self._settings = settings
        self._log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._stop_pipe = os.pipe()  # written by `stop`: wakes the watcher's select
        self._spawned = threading.Event()
        self._abort = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="proxy-child", daemon=True)

    def _spawn(self) -> subprocess.Popen[bytes]:
        env = child_environment(self._settings)  # our resolution, whole: the child listens where we look
        # Its own session: a Ctrl-C or a signal to our process group reaches us, and we stop it in order. If we
        # die without that, the kernel ends it too (Linux), so no proxy outlives its policy.
        with contextlib.ExitStack() as stack:
            log = stack.enter_context(self._log_file.open("ab")) if self._log_file else None
            return subprocess.Popen([sys.executable, "-m", "wakeful.server", "proxy"], env=env, start_new_session=True,
                                    stdout=log, stderr=log,
                                    preexec_fn=_die_with_parent if sys.platform == "linux" else None)

    def start(self) -> None:
        """Start it and wait (bounded) until it listens; raises `proxy_failed` if it does not, `interrupted` when
        `abort_proxy_start` was called meanwhile."""
        _starting.add(self)
        try:
            self._wait_listening()
        finally:
            _starting.discard(self)
        log.info("egress proxy listening on 127.0.0.1:%d (pid %d)", self._settings.proxy_port,
                 self._proc.pid if self._proc else -1)

    def _wait_listening(self) -> None:
        self._watcher.start()
        self._spawned.wait()
        deadline = time.monotonic() + READY_TIMEOUT
        while not _listening(self._settings.proxy_port):
            if self._abort.is_set():
                self.stop()
                raise WakefulError("interrupted", "asked to stop before the egress proxy listened")
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                self.stop()
                raise WakefulError("proxy_failed", f"the egress proxy exited with code {proc.returncode} before it "
                                                   f"listened on 127.0.0.1:{self._settings.proxy_port}; its error "
                                                   "is above")
            if time.monotonic() > deadline:
                self.stop()
                raise WakefulError("proxy_failed", f"the egress proxy did not listen on 127.0.0.1:"
                                                   f"{self._settings.proxy_port} within {READY_TIMEOUT:g} s")
            self._abort.wait(0.05)

    def _watch(self) -> None:
        self._proc = self._spawn()
        self._spawned.set()
        backoff = 0.5
        while not self._exited_or_stopping(self._proc):
            log.error("the egress proxy exited with code %s; restarting it in %.1f s", self._proc.returncode,
                      backoff)
            if self._stopping.wait(backoff):
                break
            backoff = min(backoff * 2, 30.0)
            self._proc = self._spawn()
        self._terminate(self._proc)  # from this thread: once it ends, the kernel kills the child outright
        os.close(self._stop_pipe[0])

    def _exited_or_stopping(self, proc: subprocess.Popen[bytes]) -> bool:
        """Sleep until the child exits (False) or `stop` is called (True). Without polling where the kernel can
        say when a process ends: an idle server should not wake twice a second to look."""
        if not hasattr(os, "pidfd_open"):  # not Linux
            while not self._stopping.wait(0.5):
                if proc.poll() is not None:
                    return False
            return True
        try:
            pidfd = os.pidfd_open(proc.pid)
        except ProcessLookupError:  # already gone (and reaped)
            return self._stopping.is_set()
        try:
            select.select([pidfd, self._stop_pipe[0]], [], [])
        finally:
            os.close(pidfd)
        proc.poll()  # reap it if it ended: its exit code is logged
        return self._stopping.is_set()

    @staticmethod
    def _terminate(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        os.write(self._stop_pipe[1], b"\0")
        os.close(self._stop_pipe[1])
        if self._watcher.is_alive() and threading.current_thread() is not self._watcher:
            self._watcher.join(timeout=15)


def run_proxy(settings: Settings, *, await_api: float = 0.0) -> None:
    """`wakeful proxy`: serve on 127.0.0.1:<proxy_port> (and on `proxy_bridge_listen` for tool computers on the
    isolated network, and on `proxy_relay_socket` for those on other hosts' isolated networks) until SIGTERM, asking
    the running server's decider (waiting up to `await_api` seconds for it to open its channel)."""
    from wakeful.proxy import server
    from wakeful.proxy.config import ProxyConfig

    keys = vault_keys(settings)
    config = ProxyConfig(
        decider_socket=settings.decider_socket,
        decider_token=_current_token(settings, decider_token(settings, wait=await_api)),
        ca_dir=settings.proxy_dir,
        keys=keys, listen_port=settings.proxy_port,
        vault=Vault(settings.vault_path, keys, key_file=None if _keys_in_env() else settings.vault_key_path),
        decider_timeout=settings.proxy_decider_timeout, upstream_cafile=settings.egress_upstream_ca,
        resolve=settings.egress_resolve, allowed_private=frozenset(settings.egress_allow_private),
        no_intercept=frozenset(settings.egress_no_intercept), address_listen=settings.bridge_listen,
        address_book=settings.address_book if settings.bridge_listen else None,
        relay_socket=settings.proxy_relay_socket)
    server.run(config)


@contextlib.asynccontextmanager
async def serve_egress(engine: Engine, clock: Clock, settings: Settings, *, proxy_child: bool = True,
                       await_proxy: bool = False) -> AsyncIterator[DeciderServer]:
    """Inside the HTTP process: answer the proxy on the decider socket (yielded: `/readyz` asks it whether it refuses
    the proxy), and run the proxy as a child unless `proxy_child` is False (`wakeful api`: `wakeful serve` supervises
    the proxy beside it). `await_proxy`: return only once that proxy listens (bounded), so the API, too, answers only
    once a connector call can go out."""
    from wakeful.proxy.channel import DeciderServer
    from wakeful.proxy.tls import load_or_create_ca

    load_or_create_ca(settings.proxy_dir, vault_keys(settings))
    service = DeciderService(engine, clock, settings)
    # Supervised (`await_proxy`): serve wrote the token before it started the proxy and this process together.
    token = _kept_token(settings) if await_proxy else None
    server = DeciderServer(settings.decider_socket, token or new_decider_token(settings), service.decide,
                           service.record, decide_now=service.decide_inline)
    await server.start()
    child = ProxyChild(settings) if proxy_child else None
    try:
        if child is not None:
            await asyncio.to_thread(child.start)
        elif await_proxy:
            deadline = time.monotonic() + READY_TIMEOUT
            while not await asyncio.to_thread(_listening, settings.proxy_port):
                if time.monotonic() > deadline:
                    log.warning("the egress proxy does not listen on 127.0.0.1:%d after %g s: serving without it "
                                "(connector calls fail until it does)", settings.proxy_port, READY_TIMEOUT)
                    break
                await asyncio.sleep(0.05)
        yield server
    finally:
        if child is not None:
            await asyncio.to_thread(child.stop)
        await server.close()
        service.close()
        if not await_proxy:  # a supervised api's token outlives it: the proxy beside it keeps using it
            with contextlib.suppress(FileNotFoundError):
                _token_path(settings).unlink()
