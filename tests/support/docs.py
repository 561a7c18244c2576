"""The commands a doc shows, so the tests that run them run exactly those (and a doc cannot drift from them)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

__all__ = ["DOCS", "doc_commands"]

DOCS = Path(__file__).resolve().parents[2] / "docs"


def doc_commands(doc: str, program: str) -> list[list[str]]:
    """The arguments of each `wakeful PROGRAM ...` line in the doc's bash blocks, in order (environment
    assignments before `wakeful` left out)."""
    blocks = re.findall(r"```bash\n(.*?)```", (DOCS / doc).read_text(), re.S)
    commands = [shlex.split(line) for block in blocks for line in block.splitlines() if line.strip()]
    return [c[c.index("wakeful") + 2:] for c in commands if "wakeful" in c and c[c.index("wakeful") + 1] == program]
