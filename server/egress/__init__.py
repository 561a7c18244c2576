"""Where admitted work leaves the server: the action dispatcher and reconciler, connector requests through the
egress proxy, the grants the proxy asks about (the decider side), and the proxy's place in a deployment.

Modules: `dispatch`, `outbound`, `grants`, `proxyctl`.
May import: `wakeful.proxy`, `wakeful.vm`, `server.store`, `server.core`, `server.acting`, `server.computers`,
`server.errors`, `server.settings`.
"""
