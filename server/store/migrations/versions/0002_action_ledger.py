"""action ledger

Revision ID: 0002
Revises: 0001

Responsibilities get versions; actions, verdicts, approvals, attempts and evidence form the ledger.
"""

import sqlalchemy as sa
from alembic import op

from wakeful.server.store.tables import append_only_ddl, attempts_guard_ddl

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('refusals',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=True),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('tool', sa.String(length=130), nullable=False),
    sa.Column('code', sa.String(length=40), nullable=False),
    sa.Column('detail', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_refusals_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_refusals'))
    )
    op.create_table('actions',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('task_version', sa.Integer(), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=True),
    sa.Column('decision_id', sa.String(length=40), nullable=True),
    sa.Column('tool', sa.String(length=130), nullable=False),
    sa.Column('content', sa.Text(), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('risk', sa.String(length=8), nullable=False),
    sa.Column('amount_cents', sa.BigInteger(), nullable=True),
    sa.Column('currency', sa.String(length=8), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.CheckConstraint("risk IN ('auto', 'ask', 'deny')", name=op.f('ck_actions_risk_valid')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_actions_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_actions_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_actions')),
    sa.UniqueConstraint('decision_id', name=op.f('uq_actions_decision_id'))
    )
    with op.batch_alter_table('actions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_actions_task_id_created_at'), ['task_id', 'created_at'], unique=False)

    op.create_table('decisions',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('run_id', sa.String(length=40), nullable=False),
    sa.Column('session_id', sa.String(length=40), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('proposal', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_decisions_run_id_runs')),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], name=op.f('fk_decisions_session_id_sessions')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_decisions')),
    sa.UniqueConstraint('run_id', 'step', name=op.f('uq_decisions_run_id_step'))
    )
    op.create_table('objects',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('user_id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('task_version', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('connector', sa.String(length=64), nullable=False),
    sa.Column('ref', sa.String(length=500), nullable=False),
    sa.Column('operation', sa.String(length=130), nullable=False),
    sa.Column('snapshot', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('expires_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_objects_task_id_tasks')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_objects_user_id_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_objects'))
    )
    op.create_table('task_versions',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('goal', sa.Text(), nullable=False),
    sa.Column('constraints', sa.Text(), nullable=False),
    sa.Column('completion', sa.Text(), nullable=False),
    sa.Column('created_by', sa.String(length=100), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_task_versions_task_id_tasks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_task_versions')),
    sa.UniqueConstraint('task_id', 'version', name=op.f('uq_task_versions_task_id_version'))
    )
    op.create_table('approvals',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('action_id', sa.String(length=40), nullable=False),
    sa.Column('content_hash', sa.String(length=64), nullable=False),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('task_version', sa.Integer(), nullable=False),
    sa.Column('decision', sa.String(length=16), nullable=False),
    sa.Column('approver', sa.String(length=120), nullable=False),
    sa.Column('amount_ceiling_cents', sa.BigInteger(), nullable=True),
    sa.Column('valid_until', sa.DateTime(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.CheckConstraint("decision IN ('approved', 'denied')", name=op.f('ck_approvals_decision_valid')),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_approvals_action_id_actions')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_approvals_task_id_tasks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_approvals'))
    )
    with op.batch_alter_table('approvals', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_approvals_action_id'), ['action_id'], unique=False)

    op.create_table('attempts',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('action_id', sa.String(length=40), nullable=False),
    sa.Column('seq', sa.Integer(), nullable=False),
    sa.Column('request', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.Column('outcome', sa.String(length=16), nullable=True),
    sa.Column('outcome_at', sa.DateTime(), nullable=True),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('external_ref', sa.String(length=500), nullable=True),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.CheckConstraint("outcome IS NULL OR outcome IN ('accepted', 'blocked', 'unknown')", name=op.f('ck_attempts_outcome_valid')),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_attempts_action_id_actions')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attempts')),
    sa.UniqueConstraint('action_id', 'seq', name=op.f('uq_attempts_action_id_seq'))
    )
    op.create_table('verdicts',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('action_id', sa.String(length=40), nullable=False),
    sa.Column('verdict', sa.String(length=16), nullable=False),
    sa.Column('code', sa.String(length=40), nullable=False),
    sa.Column('reasons', sa.Text(), nullable=False),
    sa.Column('approver', sa.String(length=120), nullable=True),
    sa.Column('approval_id', sa.String(length=40), nullable=True),
    sa.Column('created_at', sa.DateTime(), nullable=False),
    sa.CheckConstraint("verdict IN ('admitted', 'needs_approval', 'refused')", name=op.f('ck_verdicts_verdict_valid')),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_verdicts_action_id_actions')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_verdicts'))
    )
    with op.batch_alter_table('verdicts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_verdicts_action_id_created_at'), ['action_id', 'created_at'], unique=False)

    op.create_table('approval_uses',
    sa.Column('approval_id', sa.String(length=40), nullable=False),
    sa.Column('action_id', sa.String(length=40), nullable=False),
    sa.Column('used_at', sa.DateTime(), nullable=False),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_approval_uses_action_id_actions')),
    sa.ForeignKeyConstraint(['approval_id'], ['approvals.id'], name=op.f('fk_approval_uses_approval_id_approvals')),
    sa.PrimaryKeyConstraint('approval_id', name=op.f('pk_approval_uses'))
    )
    op.create_table('evidence',
    sa.Column('id', sa.String(length=40), nullable=False),
    sa.Column('action_id', sa.String(length=40), nullable=True),
    sa.Column('attempt_id', sa.String(length=40), nullable=True),
    sa.Column('task_id', sa.String(length=40), nullable=False),
    sa.Column('source', sa.String(length=32), nullable=False),
    sa.Column('verdict', sa.String(length=16), nullable=False),
    sa.Column('observed', sa.Text(), nullable=False),
    sa.Column('checked_at', sa.DateTime(), nullable=False),
    sa.CheckConstraint("verdict IN ('accepted', 'blocked', 'unknown')", name=op.f('ck_evidence_verdict_valid')),
    sa.ForeignKeyConstraint(['action_id'], ['actions.id'], name=op.f('fk_evidence_action_id_actions')),
    sa.ForeignKeyConstraint(['attempt_id'], ['attempts.id'], name=op.f('fk_evidence_attempt_id_attempts')),
    sa.ForeignKeyConstraint(['task_id'], ['tasks.id'], name=op.f('fk_evidence_task_id_tasks')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_evidence'))
    )
    with op.batch_alter_table('evidence', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_evidence_task_id_checked_at'), ['task_id', 'checked_at'], unique=False)

    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('current_version', sa.Integer(), server_default='1', nullable=False))
        batch_op.drop_constraint(op.f('ck_tasks_state_valid'), type_='check')
        batch_op.create_check_constraint('state_valid', "state IN ('active', 'paused', 'revoked', 'closed')")
    with op.batch_alter_table('control', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_control_kind_valid'), type_='check')
        batch_op.create_check_constraint(
            'kind_valid', "kind IN ('stop', 'start', 'pause', 'resume', 'revoke', 'close', 'reopen', 'steer', "
            "'approve', 'deny')")
    # Every task so far gets its version 1, so a task always has the version its row points at.
    op.execute("INSERT INTO task_versions (id, task_id, version, goal, constraints, completion, created_by, created_at) "
               "SELECT 'tv_' || id, id, 1, title, '{}', '[]', 'migration', created_at FROM tasks")
    dialect = op.get_bind().dialect.name
    # SQLite rebuilt `control` above, which drops its triggers: put them back, and guard the new history tables.
    tables = ("control", "task_versions", "decisions", "objects", "actions", "verdicts", "approvals",
              "approval_uses", "evidence", "refusals") if dialect == "sqlite" else (
              "task_versions", "decisions", "objects", "actions", "verdicts", "approvals", "approval_uses",
              "evidence", "refusals")
    for table in tables:
        for statement in append_only_ddl(table, dialect):
            op.execute(statement)
    for statement in attempts_guard_ddl(dialect):
        op.execute(statement)



def downgrade() -> None:
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_column('current_version')

    with op.batch_alter_table('evidence', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_evidence_task_id_checked_at'))

    op.drop_table('evidence')
    op.drop_table('approval_uses')
    with op.batch_alter_table('verdicts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_verdicts_action_id_created_at'))

    op.drop_table('verdicts')
    op.drop_table('attempts')
    with op.batch_alter_table('approvals', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_approvals_action_id'))

    op.drop_table('approvals')
    op.drop_table('task_versions')
    op.drop_table('objects')
    op.drop_table('decisions')
    with op.batch_alter_table('actions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_actions_task_id_created_at'))

    op.drop_table('actions')
    op.drop_table('refusals')
