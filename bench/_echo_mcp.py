"""The baseline for bench/mcp_roundtrip.py: a bare `MCPServer` with one echo tool and nothing of wakeful.

    python bench/_echo_mcp.py stdio          serve over stdio
    python bench/_echo_mcp.py http PORT      serve streamable HTTP at http://127.0.0.1:PORT/mcp
"""

from __future__ import annotations

import sys

import uvicorn
from mcp.server import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("echo")


@server.tool(annotations=ToolAnnotations(readOnlyHint=True))
def echo(text: str) -> dict[str, str]:
    """Return the text."""
    return {"text": text}


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        server.run()
    else:
        app = server.streamable_http_app(streamable_http_path="/mcp", host="127.0.0.1")
        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
