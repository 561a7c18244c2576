"""user time zone

Revision ID: 0010
Revises: 0009

Each user lives in one IANA time zone: recurring checks given as cron, quiet hours and the daily attention budget
are read in it. Users made before this revision live in UTC until they say otherwise.
"""

import sqlalchemy as sa
from alembic import op

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.add_column(sa.Column('timezone', sa.String(length=64), nullable=False, server_default='UTC'))


def downgrade() -> None:
    with op.batch_alter_table('users', schema=None) as batch_op:
        batch_op.drop_column('timezone')
