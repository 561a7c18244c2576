"""run records

Revision ID: 0003
Revises: 0002

What each run was given and what its tools returned, so `wakeful replay` can re-run it from records.
"""

import sqlalchemy as sa
from alembic import op

from wakeful.server.store.tables import append_only_ddl

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('run_contexts',
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('prefix_sha256', sa.String(length=64), nullable=False),
    sa.Column('prefix', sa.Text(), nullable=False),
    sa.Column('tail', sa.Text(), nullable=False),
    sa.Column('model', sa.String(length=100), nullable=False),
    sa.Column('harness_version', sa.String(length=20), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_contexts_run_id_runs')),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_run_contexts'))
    )
    op.create_table('tool_results',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('call_id', sa.String(length=100), nullable=False),
    sa.Column('tool', sa.String(length=130), nullable=False),
    sa.Column('args', sa.Text(), nullable=False),
    sa.Column('result', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_tool_results_run_id_runs')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tool_results')),
    sa.UniqueConstraint('run_id', 'step', 'call_id', name=op.f('uq_tool_results_run_id_step_call_id'))
    )
    for table in ("run_contexts", "tool_results"):
        for statement in append_only_ddl(table, op.get_bind().dialect.name):
            op.execute(statement)


def downgrade() -> None:
    op.drop_table('tool_results')
    op.drop_table('run_contexts')
