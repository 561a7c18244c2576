"""`python -m server …` is `wakeful …` (how `wakeful serve` starts its egress proxy child)."""

from server.cli import app

app(prog_name="wakeful")
