"""memory recall indexes

Revision ID: 0018
Revises: 0017

Recall (`server.memory.recall`) reads, besides the records on the wake's topics, the records of this task or run and
the user's standing instructions: an index for each, so a user with many records is not scanned whole every wake.
"""

from alembic import op

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('memories', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_memories_user_id_scope_scope_ref'), ['user_id', 'scope', 'scope_ref'],
                              unique=False)
        batch_op.create_index(batch_op.f('ix_memories_user_id_form_scope'), ['user_id', 'form', 'scope'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('memories', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_memories_user_id_form_scope'))
        batch_op.drop_index(batch_op.f('ix_memories_user_id_scope_scope_ref'))
