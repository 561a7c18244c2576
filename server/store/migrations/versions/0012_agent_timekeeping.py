"""agent timekeeping

Revision ID: 0012
Revises: 0011

The agent keeps time (`server.core.agenda`): a reply wait it sets says what happens at its deadline (`on_timeout`:
follow_up, tell_user or close) and what it awaits (`note`); a recurring check given as cron is read in the user's
time zone as it was when the check was set (`tz`); a timer that ends says when and why (`ended_at`, `end_reason`),
so the ledger shows it. Rows made before this revision keep their behaviour: no `on_timeout` wakes the session, no
`tz` reads cron in UTC.
"""

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('waits', schema=None) as batch_op:
        batch_op.add_column(sa.Column('on_timeout', sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column('note', sa.Text(), nullable=True))
        batch_op.create_check_constraint('on_timeout_valid', "on_timeout IN ('follow_up', 'tell_user', 'close')")
    with op.batch_alter_table('timers', schema=None) as batch_op:
        batch_op.add_column(sa.Column('tz', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('ended_at', sa.DateTime(), nullable=True))
        batch_op.add_column(sa.Column('end_reason', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('timers', schema=None) as batch_op:
        batch_op.drop_column('end_reason')
        batch_op.drop_column('ended_at')
        batch_op.drop_column('tz')
    with op.batch_alter_table('waits', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_waits_on_timeout_valid'), type_='check')
        batch_op.drop_column('note')
        batch_op.drop_column('on_timeout')
