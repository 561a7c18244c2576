"""From a proposal to a recorded verdict: server-issued objects, immutable actions, admission, approvals, policy,
connector declarations and the ledger that reads it all back.

Modules: `objects`, `actions`, `leave` (the pure "may this leave now?"), `admission` (the pure decision),
`verdicts` (gather the facts, admit, record), `approvals`, `policy`, `connectors`, `ledger`.
May import: `server.store`, `server.core`, `server.errors`, `server.settings`, and `wakeful.proxy.contract` (a
connector request is built as the proxy contract's `EgressRequest`, the one shape it keeps up to the proxy).
"""
