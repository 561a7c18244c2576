"""wakeful's server (`wakeful.server`), in rooms that follow one wake from the outside in:

    store      tables, database, migrations, IDs, users                         imports: errors
    observe    health, readiness, metrics, log lines: what an operator watches  + store, wakeful.vm (libvirt's answer)
    audit      the verifiable ledger: chain, seal, signed checkpoints, verify     + store
    core       inbox, sessions, waits, timers, control, outbox, worker, sweeper  + store, observe, settings
    memory     what the agent learnt about its user: records, rules, recall      + store (never read to authorize)
    acting     objects, actions, admission, approvals, policy, connectors, ledger  + core, wakeful.proxy.contract
    computers  the tool-computer pool and the handoff state                      + store, observe, wakeful.vm
    egress     dispatch, connector requests through the proxy, grants, the proxy + acting, computers, wakeful.proxy
    tools      the agent's tools (implements core's `Tools`)                     + egress
    harness    context, model, the run (implements core's `RunHandler`), replay  + tools
    runtime    the one place that wires them into a running server               + harness
    evals      scenarios against the sims through the HTTP app, pass^k           + runtime, sims
    faces      HTTP, MCP, the command line, the demo                             + evals, sims

    sims       simulated merchant, airline, hotel, mail: the demo's, evals' and tests' outside world  imports nothing

A room imports only from the rooms above it (`tests/unit/test_layers.py` holds it to this table); `errors`,
`settings` and the one clock (`wakeful.proxy.clock`: the proxy is the lowest package) are shared by all. The front
door below is what an embedding program needs.
"""

from wakeful.proxy.clock import Clock, FakeClock, SystemClock
from wakeful.server.core.worker import RunContext, RunHandler
from wakeful.server.errors import WakefulError
from wakeful.server.runtime import Runtime
from wakeful.server.settings import Settings, load_settings

__all__ = ["Clock", "FakeClock", "RunContext", "RunHandler", "Runtime", "Settings", "SystemClock", "WakefulError",
           "load_settings"]
