"""A migrated SQLite database to copy: tests that need a fresh database each pay a file copy, not the migrations.

`conftest.py`'s session fixture `sqlite_template` makes it once (`make_template`); a test or fixture that opens a
database of its own copies it with `copy_template(template, path)` before opening it. A copy is the migrated file
byte for byte; test_migrations.py still migrates databases of its own, from nothing and from older revisions.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from wakeful.server.store.db import make_engine, migrate

__all__ = ["copy_template", "make_template", "migrate_url"]


def migrate_url(url: str) -> None:
    """Migrate the database at `url` to the head, and leave no connection to it open."""
    engine = make_engine(url)
    migrate(engine)
    engine.dispose()


def make_template(path: Path) -> Path:
    """Migrate a new SQLite file at `path`, closed (its write-ahead log folded into it) so that it can be copied."""
    migrate_url(f"sqlite:///{path}")
    assert not path.with_name(f"{path.name}-wal").exists(), "the template's log was not folded into it"
    return path


def copy_template(template: Path, target: Path | str) -> None:
    """Put a copy of `template` at `target` (a path, or a `sqlite:///` URL), where no database is yet."""
    path = Path(str(target).removeprefix("sqlite:///"))
    assert not path.exists(), f"{path} is a database already"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, path)
