"""console

Revision ID: 0020
Revises: 0019

The console (`server.faces.console`): signed-in browser sessions (a digest of the session ID, its CSRF token and
expiry) and the one-time approval links sent in approval requests (a digest of the token, bound to the action's
content hash). Indexes for the console's newest-first pages of a user's tasks, events, runs, timers and outbox rows,
and a task's messages.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None

_UTC = wakeful.server.store.tables.UTCDateTime
_INDEXES = (('tasks', ('user_id', 'created_at')), ('events', ('user_id', 'received_at')),
            ('runs', ('user_id', 'started_at')), ('timers', ('user_id', 'created_at')),
            ('outbox', ('user_id', 'created_at')), ('outbox', ('session_id', 'created_at')))


def upgrade() -> None:
    op.create_table('console_sessions',
    sa.Column('id_digest', sa.String(length=64), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('csrf_token', sa.String(length=64), nullable=False),
    sa.Column('created_at', _UTC(), nullable=False),
    sa.Column('expires_at', _UTC(), nullable=False),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_console_sessions_user_id_users')),
    sa.PrimaryKeyConstraint('id_digest', name=op.f('pk_console_sessions'))
    )
    op.create_index(op.f('ix_console_sessions_user_id'), 'console_sessions', ['user_id'], unique=False)
    op.create_table('approval_links',
    sa.Column('token_digest', sa.String(length=64), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('action_id', sa.String(length=40), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', _UTC(), nullable=False),
    sa.Column('expires_at', _UTC(), nullable=False),
    sa.Column('used_at', _UTC(), nullable=True),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_approval_links_action_id_actions')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_approval_links_user_id_users')),
    sa.PrimaryKeyConstraint('token_digest', name=op.f('pk_approval_links'))
    )
    op.create_index(op.f('ix_approval_links_action_id'), 'approval_links', ['action_id'], unique=False)
    for table, columns in _INDEXES:
        op.create_index(op.f(f"ix_{table}_{'_'.join(columns)}"), table, list(columns), unique=False)


def downgrade() -> None:
    for table, columns in _INDEXES:
        op.drop_index(op.f(f"ix_{table}_{'_'.join(columns)}"), table_name=table)
    op.drop_index(op.f('ix_approval_links_action_id'), table_name='approval_links')
    op.drop_table('approval_links')
    op.drop_index(op.f('ix_console_sessions_user_id'), table_name='console_sessions')
    op.drop_table('console_sessions')
