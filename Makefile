.PHONY: install lint typecheck test bench serve

install:
	./scripts/install --all

lint:
	.venv/bin/ruff check server vm proxy tests bench

typecheck:  # the repository's server/, vm/ and proxy/ are wakeful.* when installed: mypy reads them through links
	mkdir -p build/typecheck/wakeful
	for d in server vm proxy; do ln -sfn ../../../$$d build/typecheck/wakeful/$$d; done
	MYPYPATH=build/typecheck .venv/bin/mypy -p wakeful.server -p wakeful.vm -p wakeful.proxy

test:
	.venv/bin/python -m pytest

bench:
	.venv/bin/python bench/run_all.py

serve:
	.venv/bin/wakeful serve
