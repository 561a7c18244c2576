"""grant use

Revision ID: 0006
Revises: 0005

A connector grant is used once: the one request the proxy lets through under its token is recorded, and the
schema (a primary key on the grant) refuses a second.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables
from wakeful.server.store.tables import append_only_ddl

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('egress_grant_uses',
    sa.Column('grant_id', sa.String(length=40), nullable=False),
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('used_at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.ForeignKeyConstraint(['grant_id'], ['egress_grants.id'], name=op.f('fk_egress_grant_uses_grant_id_egress_grants')),
    sa.PrimaryKeyConstraint('grant_id', name=op.f('pk_egress_grant_uses'))
    )
    for statement in append_only_ddl('egress_grant_uses', op.get_bind().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    op.drop_table('egress_grant_uses')
