"""The commands a doc shows, so the tests that run them run exactly those (and a doc cannot drift from them)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

__all__ = ["DOCS", "doc_commands", "fenced", "section"]

DOCS = Path(__file__).resolve().parents[2] / "docs"


def doc_commands(doc: str, program: str) -> list[list[str]]:
    """The arguments of each `wakeful PROGRAM ...` line in the doc's bash blocks, in order (environment
    assignments before `wakeful` left out)."""
    blocks = re.findall(r"```bash\n(.*?)```", (DOCS / doc).read_text(), re.S)
    commands = [shlex.split(line) for block in blocks for line in block.splitlines() if line.strip()]
    return [c[c.index("wakeful") + 2:] for c in commands if "wakeful" in c and c[c.index("wakeful") + 1] == program]


def section(text: str, heading: str) -> str:
    """What a markdown text says under the heading line `heading` (such as "## Routes"), up to the next heading of
    its level or above; a `#` line inside a fenced block is not a heading."""
    level = len(heading) - len(heading.lstrip("#"))
    under: list[str] | None = None
    in_block = False
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            in_block = not in_block
        elif not in_block and re.match(r"#+ ", line):
            if under is None and line.rstrip("\n") == heading:
                under = []
                continue
            if under is not None and len(line) - len(line.lstrip("#")) <= level:
                break
        if under is not None:
            under.append(line)
    assert under is not None, f"no heading {heading!r}"
    return "".join(under)


def fenced(text: str, language: str) -> str:
    """The body of the first ```LANGUAGE block in `text`."""
    block = re.search(rf"```{language}\n(.*?)```", text, re.S)
    assert block is not None, f"no {language} block"
    return block.group(1)
