"""The tool layer: the agent's tools (connector reads and writes, the tool computer), and the only way a
proposal reaches the world. It implements `server.core.worker.Tools`.

Modules: `specs` (every tool declared once: name, description, argument model, hints; the MCP server and the
harness render it), `layer` (`ToolLayer`), `computer` (observe, act, hand off).
May import: `wakeful.vm`, `server.store`, `server.core`, `server.acting`, `server.computers`, `server.egress`,
`server.errors`, `server.settings`.
"""
