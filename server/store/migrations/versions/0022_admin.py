"""admin users, the events-by-status index, and expiry indexes for the sweeper

Revision ID: 0022
Revises: 0021

A user may be an admin: besides their own STOP / START, an admin records the deployment-wide one from the console.
The owner `wakeful serve` creates is one; an owner that exists already is made one here, so a deployment upgraded
keeps someone who can lift a STOP over everything without the command line. The console's events filtered by
status get an index of their own (user, status, newest first). The sweeper deletes expired console sessions and
long-expired approval links by `expires_at`.
"""

import sqlalchemy as sa
from alembic import op

revision = '0022'
down_revision = '0021'
branch_labels = None
depends_on = None

_EXPIRING = ('console_sessions', 'approval_links')


def upgrade() -> None:
    # A plain ADD COLUMN, not a batch copy: SQLite cannot drop `users` while other tables refer to it.
    op.add_column('users', sa.Column('admin', sa.Boolean(), nullable=False, server_default=sa.false()))
    users = sa.table('users', sa.column('name', sa.String), sa.column('admin', sa.Boolean))
    op.execute(users.update().where(users.c.name == 'owner').values(admin=True))
    op.create_index(op.f('ix_events_user_id_status_received_at'), 'events', ['user_id', 'status', 'received_at'],
                    unique=False)
    for table in _EXPIRING:
        op.create_index(op.f(f'ix_{table}_expires_at'), table, ['expires_at'], unique=False)


def downgrade() -> None:
    for table in _EXPIRING:
        op.drop_index(op.f(f'ix_{table}_expires_at'), table_name=table)
    op.drop_index(op.f('ix_events_user_id_status_received_at'), table_name='events')
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.drop_column('admin')
