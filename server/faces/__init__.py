"""What people and clients talk to: the HTTP app (webhooks, the user's control channel, the live view, the console
at `/`), the MCP server, the `wakeful` command line (with `wakeful sim` and `wakeful eval`) and the demo.

Modules: `http`, `auth`, `routes`, `liveview`, `console/` (the console's pages, a package of its own), `schemas`
and `openapi` (the answers' shapes and the OpenAPI document), `mcpserver`, `cli` (with `cli_common`, `cli_egress`,
`cli_eval`, `cli_image`, `cli_sim`), `demo`.
May import: anything in `server`, `wakeful.vm`, `wakeful.proxy`; nothing imports it but `server.__main__`.
"""
