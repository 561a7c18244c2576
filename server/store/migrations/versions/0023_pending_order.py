"""a session's pending events in the order a run takes them

Revision ID: 0023
Revises: 0022

A run takes its session's preempting pending events and at most `run_max_events` of the others, the oldest first,
while holding the write lock: the index on (session, status) gains `preempt` and the order, so that a claim reads
what it takes and not the thousands a burst left waiting.
"""

from alembic import op

revision = '0023'
down_revision = '0022'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f('ix_events_session_id_status_preempt_received_at_id'), 'events',
                    ['session_id', 'status', 'preempt', 'received_at', 'id'], unique=False)
    op.drop_index(op.f('ix_events_session_id_status'), table_name='events')


def downgrade() -> None:
    op.create_index(op.f('ix_events_session_id_status'), 'events', ['session_id', 'status'], unique=False)
    op.drop_index(op.f('ix_events_session_id_status_preempt_received_at_id'), table_name='events')
