"""user chat holds

Revision ID: 0014
Revises: 0013

The user's own message about a task (`core.holds`): an event of kind `message`; a task `held` until the run that
reads it confirms a pause or ends without one; control rows `hold` and `release`, each naming the message's event
and, for a release or an agent's confirmed pause, the run.
"""

import sqlalchemy as sa
from alembic import op

from wakeful.server.store.tables import append_only_ddl

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None

_CONTROL_KINDS = ("'stop', 'start', 'pause', 'resume', 'revoke', 'close', 'reopen', 'steer', 'approve', 'deny'")


def _checks(*, held: bool) -> None:
    extra = (", 'held'", ", 'message'", ", 'hold', 'release'") if held else ("", "", "")
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_tasks_state_valid'), type_='check')
        batch_op.create_check_constraint('state_valid', f"state IN ('active', 'paused', 'revoked', 'closed'{extra[0]})")
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_events_kind_valid'), type_='check')
        batch_op.create_check_constraint(
            'kind_valid', f"kind IN ('webhook', 'timer', 'wait_timeout', 'control'{extra[1]})")
    with op.batch_alter_table('control', schema=None) as batch_op:
        if held:
            batch_op.add_column(sa.Column('event_id', sa.String(length=40), nullable=True))
            batch_op.add_column(sa.Column('run_id', sa.String(length=40), nullable=True))
        else:
            batch_op.drop_column('run_id')
            batch_op.drop_column('event_id')
        batch_op.drop_constraint(op.f('ck_control_kind_valid'), type_='check')
        batch_op.create_check_constraint('kind_valid', f"kind IN ({_CONTROL_KINDS}{extra[2]})")
    if op.get_bind().dialect.name == "sqlite":  # SQLite rebuilt `control` above, which drops its triggers
        for statement in append_only_ddl('control', 'sqlite'):
            op.execute(statement)


def upgrade() -> None:
    _checks(held=True)


def downgrade() -> None:
    # What only this revision could record goes first: held tasks are paused (over-pause, never a silent release).
    # Hold and release rows are history (append-only): a database that has any cannot go back, and says so.
    op.execute("UPDATE tasks SET state = 'paused' WHERE state = 'held'")
    op.execute("UPDATE events SET kind = 'control' WHERE kind = 'message'")
    _checks(held=False)
