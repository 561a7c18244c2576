"""task keys and the triage session

Revision ID: 0011
Revises: 0010

A correlation key belongs to a task (`task_keys`: a PNR, an order number, a mail thread ID, bound by the user at
delegation or by the agent while the task is open, released when it closes): a delivery carrying it wakes the task's
session. A delivery that matches no wait and no key goes to its user's one triage session (`triage_sessions`), where
the agent may attach it to a task as information (`event_attachments`, append-only).

`session_keys` is gone: a key no longer opens a session of its own. The sessions its keys led to stay as they were
(their events and runs are kept); later deliveries with those keys go to triage. Downgrading brings the table back
empty.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables
from wakeful.server.store.tables import append_only_ddl

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None

_UTC = wakeful.server.store.tables.UTCDateTime


def upgrade() -> None:
    op.create_table('task_keys',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('key', sa.String(length=200), nullable=False),
    sa.Column('bound_by', sa.String(length=120), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('bound_at', _UTC(), nullable=False),
    sa.Column('released_at', _UTC(), nullable=True),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_task_keys_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_task_keys_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_task_keys'))
    )
    with op.batch_alter_table('task_keys', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_task_keys_task_id'), ['task_id'], unique=False)
        batch_op.create_index('uq_task_keys_user_id_key_bound', ['user_id', 'key'], unique=True,
                              sqlite_where=sa.text('released_at IS NULL'),
                              postgresql_where=sa.text('released_at IS NULL'))
    op.create_table('triage_sessions',
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('created_at', _UTC(), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_triage_sessions_session_id_sessions')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_triage_sessions_user_id_users')),
    sa.PrimaryKeyConstraint('user_id', name=op.f('pk_triage_sessions')),
    sa.UniqueConstraint('session_id', name=op.f('uq_triage_sessions_session_id'))
    )
    op.create_table('event_attachments',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('event_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('attached_event_id', sa.String(length=40), nullable=False),
    sa.Column('actor', sa.String(length=120), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_at', _UTC(), nullable=False),
    sa.ForeignKeyConstraint(['attached_event_id'], ['events.id'],
                            name=op.f('fk_event_attachments_attached_event_id_events')),
    sa.ForeignKeyConstraint(['event_id'], ['events.id'], name=op.f('fk_event_attachments_event_id_events')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_event_attachments_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_event_attachments_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_event_attachments')),
    sa.UniqueConstraint('event_id', 'task_id', name=op.f('uq_event_attachments_event_id_task_id'))
    )
    with op.batch_alter_table('event_attachments', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_event_attachments_task_id'), ['task_id'], unique=False)
    for statement in append_only_ddl('event_attachments', op.get_bind().dialect.name):
        op.execute(statement)
    op.drop_table('session_keys')


def downgrade() -> None:
    op.create_table('session_keys',
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('key', sa.String(length=200), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('authority', sa.String(length=120), nullable=False),
    sa.CheckConstraint("authority IN ('user', 'agent', 'system') OR authority LIKE 'source:%'",
                       name=op.f('ck_session_keys_authority_valid')),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_session_keys_session_id_sessions')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_session_keys_user_id_users')),
    sa.PrimaryKeyConstraint('user_id', 'authority', 'key', name=op.f('pk_session_keys'))
    )
    op.drop_table('event_attachments')  # its triggers go with it
    op.drop_table('triage_sessions')
    op.drop_table('task_keys')
