"""The database: engine with durable SQLite settings, write/read transactions, migrations.

SQLite runs in WAL mode with `synchronous=FULL`, so a committed transaction is fsynced before `commit()` returns:
that is what lets the inbox acknowledge a delivery only after it is durable against power loss. Write transactions
start with `BEGIN IMMEDIATE` so two writers queue on the lock instead of deadlocking on an upgrade.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Connection, Dialect, Engine, RootTransaction, create_engine, event, insert, inspect
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.sql.schema import Table

from wakeful.server.errors import BadRequest, Conflict

__all__ = ["Busy", "OpenWrite", "begin_unless_busy", "bound", "checkpoint", "connect_nowait", "current_revision",
           "insert_many", "make_engine", "migrate", "newest_revision", "read", "sqlite_driver",
           "upsert", "write", "write_lock_time", "write_unless_busy"]

_MIGRATIONS = Path(__file__).parent / "migrations"


def make_engine(url: str) -> Engine:
    if not url.startswith("sqlite"):
        return create_engine(url, pool_pre_ping=True)
    if url.startswith("sqlite:///"):
        # Owner-only: the database is the records, token digests and the ledger (docs/security.md).
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60}, pool_size=8)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we issue BEGIN ourselves (below)
        for pragma in ("journal_mode=WAL", "synchronous=FULL", "busy_timeout=60000", "foreign_keys=ON"):
            dbapi_conn.execute(f"PRAGMA {pragma}")

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "IMMEDIATE")
        try:  # straight to sqlite3: every write transaction starts here
            sqlite_driver(conn).execute(f"BEGIN {mode}")
        except sqlite3.Error as exc:  # raised as SQLAlchemy raises driver errors everywhere else
            raise DBAPIError.instance(f"BEGIN {mode}", (), exc, sqlite3.Error) from exc

    return engine


def sqlite_driver(conn: Connection) -> sqlite3.Connection:
    """The sqlite3 connection under `conn`, for the few hot paths that skip SQLAlchemy's execution layer."""
    driver = conn.connection.dbapi_connection  # (`driver_connection` is None once a connection is detached)
    assert isinstance(driver, sqlite3.Connection)
    return driver


class _WriteLock:
    """The in-process write lock of one SQLite database. Threads wait for it (re-entrantly); an event loop never
    does: `try_acquire` either takes it at once or leaves a callback that every release calls until the loop has
    taken it, and while a loop is waiting, threads let it go first — acknowledgements do not queue behind runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None  # the holding thread
        self._depth = 0
        self._waiting: dict[object, Callable[[], object]] = {}  # event loops waiting, and how to wake each
        self._since = 0.0  # when the holder took it

    LOOP_FIRST = 1.0
    """Seconds a thread lets waiting loops go first, at most: a preference, so a loop that stopped without saying
    so cannot hold the threads up for ever."""

    def __enter__(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                patience = time.monotonic() + self.LOOP_FIRST
                while self._owner is not None or (self._waiting and time.monotonic() < patience):
                    self._cond.wait(timeout=self.LOOP_FIRST if self._waiting else None)
                self._waiting.clear()  # any still here did not come for the lock: a live loop asks again
                self._owner, self._since = me, time.monotonic()
            self._depth += 1

    def __exit__(self, *_exc: object) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth:
                return
            _held.seconds = getattr(_held, "seconds", 0.0) + time.monotonic() - self._since
            self._owner = None
            self._cond.notify_all()
            wake = list(self._waiting.items())
        for key, callback in wake:
            try:
                callback()
            except RuntimeError:  # that loop is closed: it no longer waits
                self.forget(key)

    def try_acquire(self, key: object, on_free: Callable[[], object]) -> bool:
        """Take the lock if it is free (release it with `__exit__`); else `on_free` is called, from the releasing
        thread, after each release until `key` takes the lock or is forgotten."""
        with self._cond:
            if self._owner is None:
                self._waiting.pop(key, None)
                self._owner, self._depth, self._since = threading.get_ident(), 1, time.monotonic()
                return True
            self._waiting[key] = on_free
            return False

    def granted(self) -> None:
        """SQLite has just granted the holder its lock: the time held counts from now, not from when it began to
        wait for another process writing (which never waits for this one: `write_unless_busy`)."""
        with self._cond:
            if self._depth == 1:
                self._since = time.monotonic()

    def hand_off(self) -> None:
        """The holder passes the lock on to the thread that will release it: until then, no thread holds it as its
        own (so none re-enters it)."""
        with self._cond:
            self._owner = _HANDED_OFF

    def forget(self, key: object) -> None:
        with self._cond:
            if self._waiting.pop(key, None) is not None:
                self._cond.notify_all()


_HANDED_OFF = -1  # the owner of a lock being passed between threads: no thread's ident

_held = threading.local()  # seconds this thread has held a write lock, all told


def write_lock_time() -> float:
    """Seconds the calling thread has held SQLite write locks of this process so far (0 on PostgreSQL): from SQLite
    granting each, so a wait for another process's commit is not counted."""
    return float(getattr(_held, "seconds", 0.0))


_WRITERS: dict[int, _WriteLock] = {}
_WRITERS_GUARD = threading.Lock()


def _writer_lock(engine: Engine) -> _WriteLock:
    with _WRITERS_GUARD:
        return _WRITERS.setdefault(id(engine), _WriteLock())


@contextmanager
def write(engine: Engine) -> Iterator[Connection]:
    """A write transaction: committed (and on SQLite fsynced) on clean exit, rolled back on error.

    On SQLite the threads of one process queue on an in-process lock first: SQLite's own busy handler makes a
    waiting writer sleep in steps of up to 100 ms, so without it a lock released in a millisecond is taken up late.
    Other processes (the CLI, `wakeful mcp`) still meet the busy timeout."""
    if engine.dialect.name != "sqlite":
        with engine.connect() as conn, conn.begin():
            yield conn
        return
    lock = _writer_lock(engine)
    with lock, engine.connect() as conn, conn.begin():
        lock.granted()
        yield conn


def connect_nowait(engine: Engine) -> Connection:
    """A SQLite connection of its own (outside the pool) whose write transactions never wait for another process's
    lock: for `write_unless_busy`. Its busy timeout is 0; close it when done."""
    conn = engine.connect()
    conn.detach()  # the pool must not hand this connection, with its busy timeout of 0, to anyone else
    sqlite_driver(conn).execute("PRAGMA busy_timeout = 0")
    return conn


def checkpoint(engine: Engine) -> None:
    """Copy SQLite's write-ahead log into the database, so that the next writer starts the log over.

    First without waiting for anyone: the bulk of it, while this process's writers go on (a `PASSIVE` checkpoint).
    Then, holding this process's write lock, what they wrote meanwhile, which is little: while they go on, a
    checkpoint never catches up with the log's end, and SQLite starts the log over only once one has."""
    with engine.connect() as conn:
        driver = sqlite_driver(conn)
        driver.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        with _writer_lock(engine):
            driver.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


class OpenWrite:
    """A write transaction begun by `begin_unless_busy`, holding the write lock until `commit` or `rollback`, which
    may be called from another thread than the one that began it (the inbox's loop writes, a thread syncs)."""

    def __init__(self, conn: Connection, transaction: RootTransaction, lock: _WriteLock) -> None:
        self.conn = conn
        self._transaction = transaction
        self._lock = lock

    def hand_off(self) -> None:
        """From now on the lock belongs to whichever thread ends the transaction: the thread that began it waits
        for it like any other (it no longer re-enters it)."""
        self._lock.hand_off()

    def commit(self) -> None:
        """Commit (and on SQLite fsync), rolling back if that fails; releases the lock either way."""
        try:
            self._transaction.commit()
        finally:
            if self._transaction.is_active:
                self._transaction.rollback()
            self._lock.__exit__()

    def rollback(self) -> None:
        try:
            self._transaction.rollback()
        finally:
            self._lock.__exit__()


class Busy(StrEnum):
    """Why `begin_unless_busy` began nothing: a thread of this process holds the write lock (its release calls
    back), or another process holds SQLite's (nothing calls back: look again later)."""

    HERE = "here"
    ELSEWHERE = "elsewhere"


def begin_unless_busy(conn: Connection, key: object, on_free: Callable[[], object]) -> OpenWrite | Busy:
    """A write transaction on `conn` (from `connect_nowait`) if one can start at once, else why not.

    For an event loop (`key`), which must never block. If a thread of this process holds the write lock (or a
    transaction handed off to one is syncing), `on_free` is called when it is released (and threads wait for the
    loop meanwhile); if another process holds SQLite's lock, nothing calls back, and the loop must look again later."""
    lock = _writer_lock(conn.engine)
    if not lock.try_acquire(key, on_free):
        return Busy.HERE
    try:
        transaction = conn.begin()
    except OperationalError:  # another process is writing (SQLite: database is locked)
        lock.__exit__()
        return Busy.ELSEWHERE
    except BaseException:
        lock.__exit__()
        raise
    return OpenWrite(conn, transaction, lock)


@contextmanager
def write_unless_busy(conn: Connection, key: object, on_free: Callable[[], object]) -> Iterator[Connection | None]:
    """`begin_unless_busy` as a context: the transaction (None if busy) is committed on clean exit, else rolled
    back."""
    opened = begin_unless_busy(conn, key, on_free)
    if isinstance(opened, Busy):
        yield None
        return
    try:
        yield conn
    except BaseException:
        opened.rollback()
        raise
    opened.commit()


@contextmanager
def read(engine: Engine) -> Iterator[Connection]:
    """A read-only snapshot that takes no write lock."""
    with engine.connect().execution_options(sqlite_begin="DEFERRED") as conn, conn.begin():
        yield conn


def upsert(conn: Connection, table: Table) -> sqlite.Insert | postgresql.Insert:
    """`INSERT` with the dialect's `ON CONFLICT` support (SQLite and PostgreSQL spell it the same way)."""
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def insert_many(conn: Connection, table: Table, columns: tuple[str, ...], rows: Sequence[tuple[Any, ...]]) -> None:
    """Insert rows (tuples in `columns` order) with the driver's own statement, compiled once per dialect.

    For the inbox's hot path. SQLAlchemy processes every parameter of every row in Python, which cost more than
    the insert itself; here the rows go to the driver as they are, so each value must already be in the driver's
    form (`bound` converts one, e.g. a datetime or a bool). On SQLite the rows go straight to the sqlite3
    connection (in the caller's transaction) as one multi-row `INSERT`: executemany would step once per row,
    giving up and re-taking the interpreter lock each time, which is slow while the HTTP thread is busy."""
    sql, order = _insert_sql(conn.dialect, table, columns)
    if conn.dialect.name != "sqlite":  # psycopg batches an executemany itself
        conn.exec_driver_sql(sql, [dict(zip(columns, row, strict=True)) for row in rows] if order is None
                             else [tuple(row[i] for i in order) for row in rows])
        return
    assert order is not None  # sqlite3's parameters are positional
    driver = sqlite_driver(conn)
    per_statement = _SQLITE_MAX_VARIABLES // len(columns)
    # each row's values in the statement's order (itemgetter of one index gives the value, not a tuple)
    in_order = operator.itemgetter(*order) if len(order) > 1 else lambda row: (row[order[0]],)
    for first in range(0, len(rows), per_statement):
        chunk = rows[first:first + per_statement]
        statement = _multi_row(sql, len(chunk))
        params = tuple(itertools.chain.from_iterable(map(in_order, chunk)))
        try:
            driver.execute(statement, params)
        except sqlite3.Error as exc:  # raised as SQLAlchemy raises driver errors everywhere else
            raise DBAPIError.instance(statement, params, exc, sqlite3.Error) from exc


_SQLITE_MAX_VARIABLES = 32_766  # parameters per statement (SQLite >= 3.32)


@functools.lru_cache(maxsize=256)
def _multi_row(sql: str, count: int) -> str:
    """A one-row `INSERT … VALUES (…)` as `count` rows."""
    head, _, one = sql.partition(" VALUES ")
    return f"{head} VALUES {', '.join([one] * count)}"


def bound(conn: Connection, column: Column[Any], value: Any) -> Any:
    """`value` as the driver takes it for `column` (what SQLAlchemy would send): for `insert_many`."""
    process = column.type.bind_processor(conn.dialect)
    return value if process is None else process(value)


@functools.cache
def _insert_sql(dialect: Dialect, table: Table, columns: tuple[str, ...]) -> tuple[str, tuple[int, ...] | None]:
    """The INSERT's SQL for this driver, and for positional paramstyles the order its parameters go in."""
    compiled = insert(table).compile(dialect=dialect, column_keys=list(columns))
    if not compiled.positional:
        return str(compiled), None
    names = compiled.positiontup or []
    if sorted(names) != sorted(columns):  # a column default would need a value the rows do not carry
        raise ValueError(f"insert into {table.name} binds {names}, the rows carry {list(columns)}")
    return str(compiled), tuple(columns.index(name) for name in names)


def _alembic_config(conn: Connection) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS))
    cfg.attributes["connection"] = conn
    return cfg


_REVISION = re.compile(r"^revision(?:\s*:[^=]+)?\s*=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)
_DOWN_REVISION = re.compile(r"^down_revision(?:\s*:[^=]+)?\s*=(.*)$", re.MULTILINE)


@functools.cache
def newest_revision() -> str | None:
    """The one head of the migration files, read from their text without alembic; None when that reading is not
    sure (a file it cannot parse, several heads), and then only alembic may say."""
    revisions: set[str] = set()
    parents: set[str] = set()
    for path in (_MIGRATIONS / "versions").glob("*.py"):
        text = path.read_text()
        revision, down = _REVISION.findall(text), _DOWN_REVISION.findall(text)
        if len(revision) != 1 or len(down) != 1:
            return None
        revisions.add(revision[0])
        parents.update(re.findall(r"['\"]([^'\"]+)['\"]", down[0]))
    heads = revisions - parents
    return heads.pop() if len(heads) == 1 else None


_MIGRATION_LOCK = 0x77616B65  # "wake": PostgreSQL's advisory lock held by the transaction that migrates


class Irreversible(Exception):
    """A migration's downgrade meets records the older schema has no place for, or that going back would destroy:
    the downgrade is refused (`downgrade_refused`, with this message) and nothing changes."""


def migrate(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to the newest revision (the only way a database is created); to `revision` instead, up or
    down: `wakeful migrate --to` takes a database back before an older release is installed, and the migration
    tests start from an older schema. `base` is before the first revision (no tables).

    A database already at the newest revision costs one query: every start migrates, and alembic's import and its
    reading of every migration file were a good part of a start's time."""
    if revision == "head" and (newest := newest_revision()) is not None:
        with engine.connect().execution_options(sqlite_begin="DEFERRED") as conn:  # a read: no write lock
            if _revision(conn) == newest:
                return
    with engine.connect().execution_options(sqlite_begin="IMMEDIATE") as conn:
        sqlite = conn.dialect.name == "sqlite"
        if sqlite:  # SQLite's batch mode rebuilds a table: its references must not fail or cascade meanwhile
            sqlite_driver(conn).execute("PRAGMA foreign_keys = OFF")  # (a no-op inside a transaction)
        try:
            # Processes started together on a new database (the units, serve's children) each migrate: one at a
            # time, each after the other's commit (SQLite's write lock, taken first; a lock of the transaction's
            # on PostgreSQL), and the later ones find it done.
            if sqlite:
                conn.exec_driver_sql("SELECT 1")
            else:
                conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
            if revision == "head" and _revision(conn) == newest_revision() is not None:
                return
            _migrate(conn, revision)
            if sqlite and (broken := conn.exec_driver_sql("PRAGMA foreign_key_check").all()):
                raise Conflict("migration_refused", f"migrating to {revision} would leave {len(broken)} rows "
                               f"referring to rows that are gone (first: {tuple(broken[0])}); nothing was changed")
            conn.commit()
        finally:
            if sqlite:
                conn.rollback()
                sqlite_driver(conn).execute("PRAGMA foreign_keys = ON")


def _migrate(conn: Connection, revision: str) -> None:
    # alembic's plugins announce themselves at INFO as it is imported, seven lines of every first start (the upgrades
    # it runs still say what they do)
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    from alembic import command
    from alembic.script import ScriptDirectory
    from alembic.script.revision import RevisionError
    from alembic.util import CommandError

    config = _alembic_config(conn)
    script = ScriptDirectory.from_config(config)
    current = _revision(conn)
    try:
        if current is not None:
            script.get_revision(current)
    except (CommandError, RevisionError):
        raise Conflict("schema_too_new", f"the database is at revision {current}, which this version of wakeful "
                       "does not know: a newer version migrated it (to go back to this one, run the newer "
                       f"version's `wakeful migrate --to {newest_revision()}` first)") from None
    try:
        if revision not in ("head", "base"):
            found = script.get_revision(revision) if revision.strip() else None
            if found is None:
                raise CommandError("it is empty")
            revision = found.revision
    except (CommandError, RevisionError) as exc:  # what alembic raises for a revision it cannot resolve
        raise BadRequest("unknown_revision", f"no migration has the revision {revision!r} ({exc}); the "
                         f"revisions run from 0001 to {newest_revision()}, or `base` for none") from None
    undo = _undo(script, revision, current)
    if not undo:
        command.upgrade(config, revision)
    for step, before in undo:  # one at a time, to name the one that fails; all in the one transaction
        try:
            command.downgrade(config, before)
        except (DBAPIError, Irreversible) as exc:
            why = exc.orig if isinstance(exc, DBAPIError) else exc
            raise Conflict("downgrade_refused", f"revision {step} cannot be undone on this database, nothing was "
                           f"changed (it stays at {current}): {why}".rstrip()) from None


def _undo(script: Any, target: str, current: str | None) -> list[tuple[str, str]]:
    """The revisions to undo, newest first, each with the one before it (`base` before the first), to go from
    `current` back to `target`; none when `target` is not older (the history is one line)."""
    steps: list[tuple[str, str]] = []
    at = current
    while at is not None and at != target and target != "head":
        before = script.get_revision(at).down_revision or "base"
        steps.append((at, before))
        at = None if before == "base" else before
        if before == target:
            return steps
    return []


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return _revision(conn)


def _revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
