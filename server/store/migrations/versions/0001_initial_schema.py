"""initial schema

Revision ID: 0001
Revises: (none)
"""

import sqlalchemy as sa
from alembic import op

from wakeful.server.store.tables import append_only_ddl

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('users',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=100), nullable=False),
    sa.Column('token_digest', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_users')),
    sa.UniqueConstraint('name', name=op.f('uq_users_name')),
    sa.UniqueConstraint('token_digest', name=op.f('uq_users_token_digest'))
    )
    op.create_table('outbox',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=True),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('body', sa.Text(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('next_attempt_at', sa.DateTime(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('sent_at', sa.DateTime(), nullable=True),
    sa.CheckConstraint("kind IN ('user_message', 'dispatch')", name=op.f('ck_outbox_kind_valid')),
    sa.CheckConstraint("state IN ('pending', 'sent', 'failed')", name=op.f('ck_outbox_state_valid')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_outbox_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_outbox'))
    )
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_outbox_state_next_attempt_at'), ['state', 'next_attempt_at'], unique=False)

    op.create_table('sessions',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('fencing_token', sa.BigInteger(), nullable=False),
    sa.Column('lease_owner', sa.String(length=80), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_sessions_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_sessions'))
    )
    op.create_table('usage_daily',
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('day', sa.String(length=10), nullable=False),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_usage_daily_user_id_users')),
    sa.PrimaryKeyConstraint('user_id', 'day', name=op.f('pk_usage_daily'))
    )
    op.create_table('events',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('source', sa.String(length=100), nullable=False),
    sa.Column('source_id', sa.String(length=300), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('corr_key', sa.String(length=200), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('trust', sa.String(length=32), nullable=False),
    sa.Column('preempt', sa.Boolean(), nullable=False),
    sa.Column('payload', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('received_at', sa.DateTime(), nullable=False),
    sa.Column('settled_at', sa.DateTime(), nullable=True),
    sa.CheckConstraint("kind IN ('webhook', 'timer', 'wait_timeout', 'control')", name=op.f('ck_events_kind_valid')),
    sa.CheckConstraint("status IN ('pending', 'processed', 'failed', 'late')", name=op.f('ck_events_status_valid')),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_events_session_id_sessions')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_events_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_events')),
    sa.UniqueConstraint('source', 'source_id', name=op.f('uq_events_source_source_id'))
    )
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_events_session_id_status'), ['session_id', 'status'], unique=False)
        batch_op.create_index(batch_op.f('ix_events_user_id_corr_key'), ['user_id', 'corr_key'], unique=False)

    op.create_table('runs',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('fencing_token', sa.BigInteger(), nullable=False),
    sa.Column('worker', sa.String(length=80), nullable=False),
    sa.Column('outcome', sa.String(length=20), nullable=False),
    sa.Column('steps', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(), nullable=False),
    sa.Column('ended_at', sa.DateTime(), nullable=True),
    sa.CheckConstraint("outcome IN ('running', 'completed', 'interrupted', 'budget_exhausted', 'failed', 'abandoned', 'stale')", name=op.f('ck_runs_outcome_valid')),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_runs_session_id_sessions')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_runs_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runs'))
    )
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runs_session_id_outcome'), ['session_id', 'outcome'], unique=False)

    op.create_table('session_keys',
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('key', sa.String(length=200), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_session_keys_session_id_sessions')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_session_keys_user_id_users')),
    sa.PrimaryKeyConstraint('user_id', 'key', name=op.f('pk_session_keys'))
    )
    op.create_table('tasks',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('title', sa.Text(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('closed_at', sa.DateTime(), nullable=True),
    sa.CheckConstraint("state IN ('active', 'paused', 'closed')", name=op.f('ck_tasks_state_valid')),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_tasks_session_id_sessions')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_tasks_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tasks'))
    )
    op.create_table('todos',
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('version', sa.BigInteger(), nullable=False),
    sa.Column('due_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_todos_session_id_sessions')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_todos_user_id_users')),
    sa.PrimaryKeyConstraint('session_id', name=op.f('pk_todos'))
    )
    with op.batch_alter_table('todos', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_todos_due_at'), ['due_at'], unique=False)

    op.create_table('control',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=True),
    sa.Column('task_id', sa.String(length=40), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('actor', sa.String(length=100), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.CheckConstraint("kind IN ('stop', 'start', 'pause', 'resume', 'close')", name=op.f('ck_control_kind_valid')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_control_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_control_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_control'))
    )
    with op.batch_alter_table('control', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_control_user_id_task_id_created_at'), ['user_id', 'task_id', 'created_at'], unique=False)

    op.create_table('timers',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('due_at', sa.DateTime(), nullable=False),
    sa.Column('anchor', sa.DateTime(), nullable=False),
    sa.Column('interval_seconds', sa.BigInteger(), nullable=True),
    sa.Column('cron', sa.String(length=120), nullable=True),
    sa.Column('misfire', sa.String(length=16), nullable=False),
    sa.Column('note', sa.Text(), nullable=False),
    sa.Column('fire_count', sa.Integer(), nullable=False),
    sa.Column('last_slot', sa.DateTime(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.CheckConstraint("kind IN ('followup', 'schedule')", name=op.f('ck_timers_kind_valid')),
    sa.CheckConstraint("misfire IN ('skip', 'catch_up_once')", name=op.f('ck_timers_misfire_valid')),
    sa.CheckConstraint("state IN ('active', 'done', 'cancelled')", name=op.f('ck_timers_state_valid')),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_timers_session_id_sessions')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_timers_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_timers_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_timers'))
    )
    with op.batch_alter_table('timers', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_timers_state_due_at'), ['state', 'due_at'], unique=False)

    op.create_table('waits',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=True),
    sa.Column('match_key', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('deadline', sa.DateTime(), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('resolved_at', sa.DateTime(), nullable=True),
    sa.Column('resolved_event_id', sa.String(length=40), nullable=True),
    sa.CheckConstraint("state IN ('pending', 'satisfied', 'timed_out', 'cancelled')", name=op.f('ck_waits_state_valid')),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_waits_session_id_sessions')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_waits_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_waits_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_waits')),
    sa.UniqueConstraint('user_id', 'match_key', name=op.f('uq_waits_user_id_match_key'))
    )
    with op.batch_alter_table('waits', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_waits_state_deadline'), ['state', 'deadline'], unique=False)

    # History tables refuse UPDATE and DELETE (the same DDL `metadata.create_all` attaches).
    dialect = op.get_bind().dialect.name
    for table in ("control",):
        for statement in append_only_ddl(table, dialect):
            op.execute(statement)


def downgrade() -> None:
    with op.batch_alter_table('waits', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_waits_state_deadline'))

    op.drop_table('waits')
    with op.batch_alter_table('timers', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_timers_state_due_at'))

    op.drop_table('timers')
    with op.batch_alter_table('control', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_control_user_id_task_id_created_at'))

    op.drop_table('control')
    with op.batch_alter_table('todos', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_todos_due_at'))

    op.drop_table('todos')
    op.drop_table('tasks')
    op.drop_table('session_keys')
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runs_session_id_outcome'))

    op.drop_table('runs')
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_events_user_id_corr_key'))
        batch_op.drop_index(batch_op.f('ix_events_session_id_status'))

    op.drop_table('events')
    op.drop_table('usage_daily')
    op.drop_table('sessions')
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_outbox_state_next_attempt_at'))

    op.drop_table('outbox')
    op.drop_table('users')
