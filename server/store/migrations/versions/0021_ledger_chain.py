"""ledger chain

Revision ID: 0021
Revises: 0020

The verifiable ledger (`server.audit`): every row of the history tables and of attempts gets an entry in
`ledger_chain` from a trigger on insert (an attempt's outcome, when written, a second one); the sealer hashes them
in order into one SHA-256 chain and signs checkpoints of it (`ledger_checkpoints`). Rows already there are given
entries here, table by table in key order (their true order across tables was never recorded); the first seal
chains them.
"""

import sqlalchemy as sa
from alembic import op

import wakeful.server.store.tables
from wakeful.server.store.db import Irreversible
from wakeful.server.store.tables import CHAIN_KEY_SEPARATOR, append_only_ddl, chain_ddl, chain_guard_ddl, metadata

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None

_CHAINED = ('control', 'task_versions', 'decisions', 'objects', 'actions', 'verdicts', 'approvals', 'approval_uses',
            'evidence', 'refusals', 'run_contexts', 'tool_results', 'egress_grants', 'egress_grant_uses',
            'egress_audit', 'event_attachments', 'memory_links', 'memory_uses', 'memory_disowned', 'memory_changes',
            'attempts')


def upgrade() -> None:
    op.create_table('ledger_chain',
    sa.Column('seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('tbl', sa.String(length=40), nullable=False),
    sa.Column('row_key', sa.String(length=400), nullable=False),
    sa.Column('part', sa.String(length=16), nullable=False),
    sa.Column('pos', sa.BigInteger(), nullable=True),
    sa.Column('row_hash', sa.String(length=64), nullable=True),
    sa.Column('chain_hash', sa.String(length=64), nullable=True),
    sa.CheckConstraint("part IN ('row', 'outcome')", name=op.f('ck_ledger_chain_part_valid')),
    sa.PrimaryKeyConstraint('seq', name=op.f('pk_ledger_chain'))
    )
    with op.batch_alter_table('ledger_chain', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ledger_chain_pos'), ['pos'], unique=True)
    op.create_table('ledger_checkpoints',
    sa.Column('pos', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('chain_hash', sa.String(length=64), nullable=False),
    sa.Column('signed_at', wakeful.server.store.tables.UTCDateTime(), nullable=False),
    sa.Column('key_id', sa.String(length=32), nullable=False),
    sa.Column('signature', sa.String(length=128), nullable=False),
    sa.PrimaryKeyConstraint('pos', name=op.f('pk_ledger_checkpoints'))
    )
    dialect = op.get_bind().dialect.name
    separator = "char(31)" if dialect == "sqlite" else "chr(31)"
    assert CHAIN_KEY_SEPARATOR == "\x1f"
    for table in _CHAINED:
        columns = [column.name for column in metadata.tables[table].primary_key]
        key = f" || {separator} || ".join(columns)
        order = ", ".join(columns)
        op.execute(f"INSERT INTO ledger_chain (tbl, row_key, part) SELECT '{table}', {key}, 'row' FROM {table} "
                   f"ORDER BY {order}")
        if table == 'attempts':
            op.execute(f"INSERT INTO ledger_chain (tbl, row_key, part) SELECT '{table}', {key}, 'outcome' "
                       f"FROM {table} WHERE outcome IS NOT NULL ORDER BY {order}")
        for statement in chain_ddl(table, dialect):
            op.execute(statement)
    for statement in chain_guard_ddl(dialect) + append_only_ddl('ledger_checkpoints', dialect):
        op.execute(statement)


def downgrade() -> None:
    # A sealed chain is what an auditor's kept export is checked against: dropped and made again by the upgrade, it
    # would be chained anew, indistinguishable from a rewritten past. Only a ledger never sealed can go.
    sealed = op.get_bind().exec_driver_sql("SELECT count(*) FROM ledger_checkpoints").scalar()
    if sealed:
        raise Irreversible(f"the ledger has been sealed ({sealed} signed checkpoints), and the older schema has no "
                           "place for its chain")
    dialect = op.get_bind().dialect.name
    for table in _CHAINED:
        for trigger in ('chain', 'chain_outcome', 'chain_outcome_set') if table == 'attempts' else ('chain',):
            if dialect == 'sqlite':
                op.execute(f"DROP TRIGGER IF EXISTS {table}_{trigger}")
            else:
                op.execute(f"DROP TRIGGER IF EXISTS {table}_{trigger} ON {table}")
        if dialect != 'sqlite':
            op.execute(f"DROP FUNCTION IF EXISTS wakeful_chain_{table}()")
    op.drop_table('ledger_checkpoints')
    op.drop_table('ledger_chain')
    if dialect != 'sqlite':
        op.execute("DROP FUNCTION IF EXISTS wakeful_chain_sealed_once()")
