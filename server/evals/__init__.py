"""Evaluations: scenarios run against the simulators and a runtime serving the real HTTP app, judged by the
simulators' records and the task's ledger, never by call counts (`wakeful eval`, docs/evaluation.md).

Modules: `world` (one scenario's world: fresh data directory, simulators, runtime, HTTP, one clock), `agents` (the
scripted models' playbooks), `scenario` (what a scenario and a check are), `cancellation`, `paired`, `hongkong`
(the scenarios; the trip's days in `hongkong`, `waiting` and `typhoon`, what they share in `trip`; memory's cases in
`memory`, `memory_sources` and `memory_repair`, what they share in `memory_play`), `catalog` (all
of them by name), `passk` (τ-bench's pass^k), `runner` (trials, report, table).
May import: anything in `server` below `faces`, and `sims`; `faces` imports it (and hands it the HTTP app's
factory, so the app under test is the one `wakeful serve` runs).
"""
