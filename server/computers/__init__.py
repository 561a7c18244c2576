"""Tool computers inside the server: the per-user VM pool the tools and the dispatcher use, and the handoff
state behind the live view (one-time links, live sessions, control leases).

Modules: `pool` (the `Computers` protocol, the libvirt-backed pool built on first use), `handoff` (`LiveViews`).
May import: `wakeful.vm`, `server.store`, `server.errors`, `server.settings`.
"""
