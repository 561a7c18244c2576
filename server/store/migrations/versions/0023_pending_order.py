"""a session's pending events in the order a run takes them

Revision ID: 0023
Revises: 0022

A run takes at most `run_max_events` of its session's pending events, the oldest first, while holding the write
lock: the index on (session, status) gains the order, so a burst of thousands waiting is not sorted at every claim.
"""

from alembic import op

revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f('ix_events_session_id_status_received_at_id'), 'events',
                    ['session_id', 'status', 'received_at', 'id'], unique=False)
    op.drop_index(op.f('ix_events_session_id_status'), table_name='events')


def downgrade() -> None:
    op.create_index(op.f('ix_events_session_id_status'), 'events', ['session_id', 'status'], unique=False)
    op.drop_index(op.f('ix_events_session_id_status_received_at_id'), table_name='events')
