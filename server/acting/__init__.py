"""From a proposal to a recorded verdict: server-issued objects, immutable actions, admission, approvals, policy,
connector declarations and the ledger that reads it all back.

Modules: `objects`, `actions`, `admission` (the pure decision), `verdicts` (gather the facts, admit, record),
`approvals`, `policy`, `connectors`, `ledger`.
May import: `server.store`, `server.core`, `server.errors`, `server.settings`.
"""
