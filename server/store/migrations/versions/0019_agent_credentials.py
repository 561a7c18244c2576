"""agent credentials

Revision ID: 0019
Revises: 0018

An agent credential (`agent_credentials`) is one MCP client's: named by its user, listed, revocable. It reaches the
agent's tools and nothing else; the user's own token (`users.token_digest`) stays the only way to control state.
Only a credential's digest is stored. A name is unique among a user's live credentials; revoked ones stay as history.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None

_UTC = wakeful.server.store.tables.UTCDateTime


def upgrade() -> None:
    op.create_table('agent_credentials',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('name', sa.String(length=40), nullable=False),
    sa.Column('token_digest', sa.String(length=64), nullable=False),
    sa.Column('created_at', _UTC(), nullable=False),
    sa.Column('revoked_at', _UTC(), nullable=True),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_agent_credentials_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_agent_credentials')),
    sa.UniqueConstraint('token_digest', name=op.f('uq_agent_credentials_token_digest'))
    )
    with op.batch_alter_table('agent_credentials', schema=None) as batch_op:
        batch_op.create_index('uq_agent_credentials_user_id_name_live', ['user_id', 'name'], unique=True,
                              sqlite_where=sa.text('revoked_at IS NULL'),
                              postgresql_where=sa.text('revoked_at IS NULL'))


def downgrade() -> None:
    with op.batch_alter_table('agent_credentials', schema=None) as batch_op:
        batch_op.drop_index('uq_agent_credentials_user_id_name_live')
    op.drop_table('agent_credentials')
