"""speaking: quiet hours, the attention budget, held messages, the message sequence

Revision ID: 0013
Revises: 0012

What the user set about being spoken to lives on their row (`core.speaking`), beside the last sequence number given
to one of their messages. A message the gate held waits in the outbox as `held` until its summary goes out, and is
then `batched` into it; every message the user is shown carries `seq`, the order `GET /v1/messages?after=` reads.
Messages queued before this revision get their sequence in the order they were written.
"""

import sqlalchemy as sa
from alembic import op

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

_STATES = "state IN ('pending', 'sent', 'failed', 'held', 'batched')"


def upgrade() -> None:
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.add_column(sa.Column('quiet_start', sa.String(length=5), nullable=True))
        batch_op.add_column(sa.Column('quiet_end', sa.String(length=5), nullable=True))
        batch_op.add_column(sa.Column('attention_budget', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('message_seq', sa.BigInteger(), nullable=False, server_default='0'))
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.add_column(sa.Column('seq', sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column('gate', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('held_until', sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column('summary_id', sa.String(length=40), nullable=True))
        batch_op.drop_constraint(op.f('ck_outbox_state_valid'), type_='check')
        batch_op.create_check_constraint('state_valid', _STATES)
    op.execute("UPDATE outbox SET seq = (SELECT COUNT(*) FROM outbox AS earlier WHERE earlier.user_id = outbox.user_id "
               "AND earlier.kind = 'user_message' AND (earlier.created_at < outbox.created_at OR "
               "(earlier.created_at = outbox.created_at AND earlier.id <= outbox.id))) WHERE kind = 'user_message'")
    op.execute("UPDATE users SET message_seq = (SELECT COALESCE(MAX(seq), 0) FROM outbox "
               "WHERE outbox.user_id = users.id)")
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_outbox_user_id_seq'), ['user_id', 'seq'], unique=True)


def downgrade() -> None:
    op.execute("UPDATE outbox SET state = 'pending' WHERE state = 'held'")
    op.execute("UPDATE outbox SET state = 'sent' WHERE state = 'batched'")
    with op.batch_alter_table('outbox', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_outbox_user_id_seq'))
        batch_op.drop_constraint(op.f('ck_outbox_state_valid'), type_='check')
        batch_op.create_check_constraint('state_valid', "state IN ('pending', 'sent', 'failed')")
        for column in ('summary_id', 'held_until', 'gate', 'seq'):
            batch_op.drop_column(column)
    with op.batch_alter_table('users', schema=None) as batch_op:
        for column in ('message_seq', 'attention_budget', 'quiet_end', 'quiet_start'):
            batch_op.drop_column(column)
