"""Tool computers inside the server: the per-user VM pool the tools and the dispatcher use, and the handoff
state behind the live view (one-time links, live sessions, control leases).

Modules: `pool` (the `Computers` protocol, the libvirt-backed pool built on first use), `handoff` (`LiveViews`),
`remote` (the computers of one process served to another over a Unix socket: the API holds them, the worker asks),
`fakes` (computers on the vm layer's in-memory fakes, for tests of whole processes).
May import: `wakeful.vm`, `server.store`, `server.errors`, `server.settings`.
"""
