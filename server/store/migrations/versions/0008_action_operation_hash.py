"""action operation hash

Revision ID: 0008
Revises: 0007

The same operation twice is one action: each action records the hash of the operation it asks of the world (the
connector, the tool, and the request without its headers; see `acting.actions`), indexed per task version so a
proposal finds the action that stands for it. Actions made before this revision have none and stand for nothing.
"""

import sqlalchemy as sa
from alembic import op

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('actions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('operation_hash', sa.String(length=64), nullable=True))
        batch_op.create_index(batch_op.f('ix_actions_task_id_task_version_operation_hash'),
                              ['task_id', 'task_version', 'operation_hash'], unique=False)


def downgrade() -> None:
    # Never a copy of the table: a copy would leave the append-only triggers behind (SQLite drops the column itself).
    with op.batch_alter_table('actions', schema=None, recreate='never') as batch_op:
        batch_op.drop_index(batch_op.f('ix_actions_task_id_task_version_operation_hash'))
        batch_op.drop_column('operation_hash')
