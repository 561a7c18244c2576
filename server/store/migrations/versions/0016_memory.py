"""memory

Revision ID: 0016
Revises: 0015

Knowledge (`server.memory`): memory records, each version a row (bi-temporal: valid from/until in the world,
recorded/retired in the system), what each is recalled for (topics), the evidence and lineage it came from (links),
which runs recalled it (uses), evidence the user disowned, and every change (the memory part of the ledger). The
links, uses, disowned evidence and changes are append-only.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables
from wakeful.server.store.tables import append_only_ddl

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None

_UTC = wakeful.server.store.tables.UTCDateTime
_APPEND_ONLY = ('memory_links', 'memory_uses', 'memory_disowned', 'memory_changes')


def upgrade() -> None:
    op.create_table('memories',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('lineage_id', sa.String(length=40), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('supersedes', sa.String(length=40), nullable=True),
    sa.Column('form', sa.String(length=16), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('subject', sa.String(length=80), nullable=False),
    sa.Column('relation', sa.String(length=80), nullable=False),
    sa.Column('value', sa.Text(), nullable=False),
    sa.Column('text', sa.Text(), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('scope_ref', sa.String(length=200), nullable=True),
    sa.Column('speaker', sa.String(length=16), nullable=False),
    sa.Column('speaker_name', sa.String(length=120), nullable=False),
    sa.Column('confidence', sa.Float(), nullable=True),
    sa.Column('review', sa.Boolean(), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('task_id', sa.String(length=40), nullable=True),
    sa.Column('confirmed_by', sa.String(length=120), nullable=True),
    sa.Column('confirmed_at', _UTC(), nullable=True),
    sa.Column('valid_from', _UTC(), nullable=False),
    sa.Column('valid_until', _UTC(), nullable=True),
    sa.Column('recorded_at', _UTC(), nullable=False),
    sa.Column('retired_at', _UTC(), nullable=True),
    sa.Column('retire_reason', sa.String(length=16), nullable=True),
    sa.Column('retired_by', sa.String(length=16), nullable=True),
    sa.CheckConstraint("form IN ('instruction', 'preference', 'fact', 'hypothesis', 'statement', 'episode', "
                       "'sourced_fact', 'skill')", name=op.f('ck_memories_form_valid')),
    sa.CheckConstraint("state IN ('pending', 'active', 'retired')", name=op.f('ck_memories_state_valid')),
    sa.CheckConstraint("scope IN ('run', 'task', 'project', 'always')", name=op.f('ck_memories_scope_valid')),
    sa.CheckConstraint("speaker IN ('user', 'agent', 'third_party')", name=op.f('ck_memories_speaker_valid')),
    sa.CheckConstraint("retire_reason IS NULL OR retire_reason IN ('superseded', 'contradicted', 'corrected', "
                       "'forgotten', 'expired', 'rejected', 'invalidated')",
                       name=op.f('ck_memories_retire_reason_valid')),
    sa.CheckConstraint("retired_by IS NULL OR retired_by IN ('user', 'agent', 'system')",
                       name=op.f('ck_memories_retired_by_valid')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_memories_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_memories_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_memories')),
    sa.UniqueConstraint('lineage_id', 'version', name=op.f('uq_memories_lineage_id_version'))
    )
    with op.batch_alter_table('memories', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_memories_user_id_state_scope'), ['user_id', 'state', 'scope'],
                              unique=False)
        batch_op.create_index(batch_op.f('ix_memories_user_id_subject_relation'), ['user_id', 'subject', 'relation'],
                              unique=False)
    op.create_table('memory_topics',
    sa.Column('memory_id', sa.String(length=40), nullable=False),
    sa.Column('topic', sa.String(length=80), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.ForeignKeyConstraint(['memory_id'], ['memories.id'], name=op.f('fk_memory_topics_memory_id_memories')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_memory_topics_user_id_users')),
    sa.PrimaryKeyConstraint('memory_id', 'topic', name=op.f('pk_memory_topics'))
    )
    with op.batch_alter_table('memory_topics', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_memory_topics_user_id_topic'), ['user_id', 'topic'], unique=False)
    op.create_table('memory_links',
    sa.Column('memory_id', sa.String(length=40), nullable=False),
    sa.Column('ref_type', sa.String(length=16), nullable=False),
    sa.Column('ref_id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.ForeignKeyConstraint(['memory_id'], ['memories.id'], name=op.f('fk_memory_links_memory_id_memories')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_memory_links_user_id_users')),
    sa.PrimaryKeyConstraint('memory_id', 'ref_type', 'ref_id', name=op.f('pk_memory_links'))
    )
    with op.batch_alter_table('memory_links', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_memory_links_ref_type_ref_id'), ['ref_type', 'ref_id'], unique=False)
    op.create_table('memory_uses',
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('memory_id', sa.String(length=40), nullable=False),
    sa.ForeignKeyConstraint(['memory_id'], ['memories.id'], name=op.f('fk_memory_uses_memory_id_memories')),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_memory_uses_run_id_runs')),
    sa.PrimaryKeyConstraint('run_id', 'memory_id', name=op.f('pk_memory_uses'))
    )
    with op.batch_alter_table('memory_uses', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_memory_uses_memory_id'), ['memory_id'], unique=False)
    op.create_table('memory_disowned',
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('ref_type', sa.String(length=16), nullable=False),
    sa.Column('ref_id', sa.String(length=40), nullable=False),
    sa.Column('memory_id', sa.String(length=40), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('created_at', _UTC(), nullable=False),
    sa.ForeignKeyConstraint(['memory_id'], ['memories.id'], name=op.f('fk_memory_disowned_memory_id_memories')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_memory_disowned_user_id_users')),
    sa.PrimaryKeyConstraint('user_id', 'ref_type', 'ref_id', name=op.f('pk_memory_disowned'))
    )
    op.create_table('memory_changes',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('memory_id', sa.String(length=40), nullable=True),
    sa.Column('change', sa.String(length=16), nullable=False),
    sa.Column('actor', sa.String(length=16), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('task_id', sa.String(length=40), nullable=True),
    sa.Column('code', sa.String(length=40), nullable=True),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('at', _UTC(), nullable=False),
    sa.CheckConstraint("change IN ('committed', 'refused', 'confirmed', 'rejected', 'edited', 'corrected', "
                       "'forgotten', 'retired', 'invalidated', 'expired', 'reviewed')",
                       name=op.f('ck_memory_changes_change_valid')),
    sa.CheckConstraint("actor IN ('user', 'agent', 'system')", name=op.f('ck_memory_changes_actor_valid')),
    sa.ForeignKeyConstraint(['memory_id'], ['memories.id'], name=op.f('fk_memory_changes_memory_id_memories')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_memory_changes_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_memory_changes'))
    )
    with op.batch_alter_table('memory_changes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_memory_changes_user_id_at'), ['user_id', 'at'], unique=False)
        batch_op.create_index(batch_op.f('ix_memory_changes_memory_id'), ['memory_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_memory_changes_task_id'), ['task_id'], unique=False)
    for table in _APPEND_ONLY:
        for statement in append_only_ddl(table, op.get_bind().dialect.name):
            op.execute(statement)


def downgrade() -> None:
    for table in ('memory_changes', 'memory_disowned', 'memory_uses', 'memory_links', 'memory_topics', 'memories'):
        op.drop_table(table)
