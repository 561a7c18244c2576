"""wait authority

Revision ID: 0009
Revises: 0008

Who may satisfy a wait, and who sent an event (`server.core.authority`): `user`, `system` or `source:<name>` (a wait
may also take `any_source`). A session key binds a session for the authority that bound it, so the key is part of
the primary key with it. What was recorded before gets the authority it had in fact: approvals and control events
the user's, timers, timeouts and dispatch results the system's, webhooks their source's; approval waits the user's,
reconcile waits the system's, and what a run waited for any source's, as before.
"""

import sqlalchemy as sa
from alembic import op

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

_SENDER = "authority IN ('user', 'agent', 'system') OR authority LIKE 'source:%'"


def upgrade() -> None:
    for table in ('events', 'waits', 'session_keys'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column('authority', sa.String(length=120), nullable=True))
    op.execute("UPDATE events SET authority = CASE WHEN trust IN ('system', 'agent') THEN trust "
               "WHEN kind = 'control' THEN 'user' ELSE 'source:' || source END")
    op.execute("UPDATE waits SET authority = CASE kind WHEN 'approval' THEN 'user' WHEN 'reconcile' THEN 'system' "
               "ELSE 'any_source' END")
    # The sender of the first event the key routed; a key nothing shows the sender of is out of every source's reach.
    op.execute("UPDATE session_keys SET authority = COALESCE((SELECT e.authority FROM events e "
               "WHERE e.user_id = session_keys.user_id AND e.corr_key = session_keys.key "
               "AND e.session_id = session_keys.session_id ORDER BY e.received_at LIMIT 1), 'system')")
    with op.batch_alter_table('events', schema=None) as batch_op:
        batch_op.alter_column('authority', existing_type=sa.String(length=120), nullable=False)
        batch_op.create_check_constraint('authority_valid', _SENDER)
    with op.batch_alter_table('waits', schema=None) as batch_op:
        batch_op.alter_column('authority', existing_type=sa.String(length=120), nullable=False)
        batch_op.create_check_constraint(
            'authority_valid', "authority IN ('user', 'system', 'any_source') OR authority LIKE 'source:%'")
    with op.batch_alter_table('session_keys', schema=None) as batch_op:
        batch_op.alter_column('authority', existing_type=sa.String(length=120), nullable=False)
        batch_op.drop_constraint(op.f('pk_session_keys'), type_='primary')
        batch_op.create_primary_key(op.f('pk_session_keys'), ['user_id', 'authority', 'key'])
        batch_op.create_check_constraint('authority_valid', _SENDER)


def downgrade() -> None:
    # Keys two authorities bound alike cannot share the old primary key: the first binding stays.
    op.execute("DELETE FROM session_keys WHERE EXISTS (SELECT 1 FROM session_keys older "
               "WHERE older.user_id = session_keys.user_id AND older.key = session_keys.key "
               "AND older.authority < session_keys.authority)")
    with op.batch_alter_table('session_keys', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_session_keys_authority_valid'), type_='check')
        batch_op.drop_constraint(op.f('pk_session_keys'), type_='primary')
        batch_op.create_primary_key(op.f('pk_session_keys'), ['user_id', 'key'])
        batch_op.drop_column('authority')
    for table in ('waits', 'events'):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(f'ck_{table}_authority_valid'), type_='check')
            batch_op.drop_column('authority')
