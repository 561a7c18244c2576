"""`python -m server …` is `wakeful …` (how `wakeful serve` starts its egress proxy child)."""

from wakeful.server.faces.cli import app

app(prog_name="wakeful")
