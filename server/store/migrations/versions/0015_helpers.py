"""helper tasks

Revision ID: 0015
Revises: 0014

A helper task is a read-only sub-task (a comparison, some research) the agent hands to a run of its own: its own
session, started from a handoff (goal, constraints, the task version it is based on, the output form), its result
returned as an event into the task's session. Objects a helper's reads mint carry its ID: only that helper resolves
them, so the main run reads again before it acts.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('helpers',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('task_version', sa.Integer(), nullable=False),
    sa.Column('parent_session_id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('goal', sa.Text(), nullable=False),
    sa.Column('constraints', sa.Text(), nullable=False),
    sa.Column('output_form', sa.Text(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('max_steps', sa.Integer(), nullable=False),
    sa.Column('deadline', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.Column('created_at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.Column('finished_at', wakeful.server.store.tables.UTCDateTime(), nullable=True),
    sa.CheckConstraint("state IN ('running', 'returned', 'failed', 'stopped')",
                       name=op.f('ck_helpers_state_valid')),
    sa.ForeignKeyConstraint(['parent_session_id'], ['sessions.id'],
                            name=op.f('fk_helpers_parent_session_id_sessions')),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_helpers_session_id_sessions')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_helpers_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_helpers_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_helpers')),
    sa.UniqueConstraint('session_id', name=op.f('uq_helpers_session_id'))
    )
    with op.batch_alter_table('helpers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_helpers_task_id_state'), ['task_id', 'state'], unique=False)
    with op.batch_alter_table('objects', schema=None) as batch_op:
        batch_op.add_column(sa.Column('helper_id', sa.String(length=40), nullable=True))


def downgrade() -> None:
    # Never a copy of the table: a copy would leave the append-only triggers behind (SQLite drops the column itself).
    with op.batch_alter_table('objects', schema=None, recreate='never') as batch_op:
        batch_op.drop_column('helper_id')
    op.drop_table('helpers')
