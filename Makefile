.PHONY: install lint typecheck test bench serve

install:
	./scripts/install --all

lint:
	.venv/bin/ruff check server vm proxy tests bench

typecheck:
	.venv/bin/mypy

test:
	.venv/bin/python -m pytest

bench:
	.venv/bin/python bench/run_all.py

serve:
	.venv/bin/wakeful serve
