"""steer proposals

Revision ID: 0007
Revises: 0006

A steer from the agent that would widen its task (a higher limit, another goal, other completion conditions) is
recorded as a proposal; it becomes a task version only when the user confirms it on the control channel.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('steer_proposals',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('base_version', sa.Integer(), nullable=False),
    sa.Column('goal', sa.Text(), nullable=False),
    sa.Column('constraints', sa.Text(), nullable=False),
    sa.Column('completion', sa.Text(), nullable=False),
    sa.Column('widens', sa.Text(), nullable=False),
    sa.Column('proposed_by', sa.String(length=120), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('decided_by', sa.String(length=120), nullable=True),
    sa.Column('created_at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.Column('decided_at', wakeful.server.store.tables.UTCDateTime(), nullable=True),
    sa.CheckConstraint("state IN ('awaiting_user', 'confirmed', 'rejected', 'superseded')",
                       name=op.f('ck_steer_proposals_state_valid')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_steer_proposals_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_steer_proposals_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_steer_proposals'))
    )
    with op.batch_alter_table('steer_proposals', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_steer_proposals_task_id_state'), ['task_id', 'state'], unique=False)


def downgrade() -> None:
    op.drop_table('steer_proposals')
