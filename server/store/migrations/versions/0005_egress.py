"""egress

Revision ID: 0005
Revises: 0004

The egress proxy's records: a grant per connector request the server sends, the proxy credentials of tool
computers, and the audit of every request the proxy saw.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables
from wakeful.server.store.tables import append_only_ddl

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('egress_audit',
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=True),
    sa.Column('client', sa.String(length=16), nullable=False),
    sa.Column('grant_id', sa.String(length=128), nullable=True),
    sa.Column('action_id', sa.String(length=128), nullable=True),
    sa.Column('method', sa.String(length=16), nullable=False),
    sa.Column('scheme', sa.String(length=8), nullable=False),
    sa.Column('host', sa.String(length=255), nullable=False),
    sa.Column('port', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('verdict', sa.String(length=8), nullable=False),
    sa.Column('code', sa.String(length=40), nullable=True),
    sa.Column('rule', sa.Text(), nullable=False),
    sa.Column('credential', sa.String(length=64), nullable=True),
    sa.Column('bytes_up', sa.BigInteger(), nullable=False),
    sa.Column('bytes_down', sa.BigInteger(), nullable=False),
    sa.Column('upstream_status', sa.Integer(), nullable=True),
    sa.Column('latency_ms', sa.Float(), nullable=False),
    sa.Column('recorded_at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.CheckConstraint("verdict IN ('allow', 'refuse')", name=op.f('ck_egress_audit_verdict_valid')),
    sa.PrimaryKeyConstraint('request_id', name=op.f('pk_egress_audit'))
    )
    with op.batch_alter_table('egress_audit', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_egress_audit_at'), ['at'], unique=False)
        batch_op.create_index(batch_op.f('ix_egress_audit_user_id_at'), ['user_id', 'at'], unique=False)

    op.create_table('egress_clients',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('label', sa.String(length=100), nullable=False),
    sa.Column('token_sha256', sa.String(length=64), nullable=False),
    sa.Column('created_at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.Column('revoked_at', wakeful.server.store.tables.UTCDateTime(), nullable=True),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_egress_clients_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_egress_clients')),
    sa.UniqueConstraint('token_sha256', name=op.f('uq_egress_clients_token_sha256'))
    )
    op.create_table('egress_grants',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('token_sha256', sa.String(length=64), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('purpose', sa.String(length=16), nullable=False),
    sa.Column('action_id', sa.String(length=40), nullable=True),
    sa.Column('attempt_id', sa.String(length=40), nullable=True),
    sa.Column('tool', sa.String(length=130), nullable=False),
    sa.Column('method', sa.String(length=16), nullable=False),
    sa.Column('scheme', sa.String(length=8), nullable=False),
    sa.Column('host', sa.String(length=255), nullable=False),
    sa.Column('port', sa.Integer(), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('query', sa.Text(), nullable=False),
    sa.Column('body_sha256', sa.String(length=64), nullable=False),
    sa.Column('credential', sa.String(length=64), nullable=True),
    sa.Column('created_at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.Column('expires_at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.CheckConstraint("purpose <> 'write' OR (action_id IS NOT NULL AND attempt_id IS NOT NULL)", name=op.f('ck_egress_grants_write_names_attempt')),
    sa.CheckConstraint("purpose IN ('read', 'write', 'reconcile', 'verify')", name=op.f('ck_egress_grants_purpose_valid')),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_egress_grants_action_id_actions')),
    sa.ForeignKeyConstraint(['attempt_id'], ['attempts.id'], name=op.f('fk_egress_grants_attempt_id_attempts')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_egress_grants_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_egress_grants_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_egress_grants')),
    sa.UniqueConstraint('token_sha256', name=op.f('uq_egress_grants_token_sha256'))
    )
    for table in ("egress_grants", "egress_audit"):
        for statement in append_only_ddl(table, op.get_bind().dialect.name):
            op.execute(statement)


def downgrade() -> None:
    op.drop_table('egress_grants')
    op.drop_table('egress_clients')
    with op.batch_alter_table('egress_audit', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_egress_audit_user_id_at'))
        batch_op.drop_index(batch_op.f('ix_egress_audit_at'))

    op.drop_table('egress_audit')
