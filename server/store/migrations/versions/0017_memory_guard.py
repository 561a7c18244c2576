"""memory guard

Revision ID: 0017
Revises: 0016

A memory version's content is written once: only its state, retirement (retired_at, retire_reason, retired_by) and
review flag may change, and no version is ever deleted (`tables.memory_guard_ddl`).
"""

from alembic import op

from wakeful.server.store.tables import memory_guard_ddl

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    for statement in memory_guard_ddl(op.get_bind().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS memories_content_fixed" +
               ("" if op.get_bind().dialect.name == "sqlite" else " ON memories"))
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS memories_no_delete")
    else:
        op.execute("DROP FUNCTION IF EXISTS wakeful_memory_fixed()")
