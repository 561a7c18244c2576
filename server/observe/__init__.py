"""What an operator watches: liveness and readiness (`health`), Prometheus metrics (`metrics`), log lines (`logs`).

Modules: `health` (the readiness checks and the drain after SIGTERM), `metrics` (what is counted, where it is kept
across processes, the exposition `GET /metrics` serves), `logs` (text or JSON lines, secrets redacted).
Lower rooms call one function of `metrics` at each point they observe; nothing here decides anything for them.
May import: `server.store`, `wakeful.vm` (only to ask libvirt whether it answers), `server.errors`,
`server.settings`.
"""
