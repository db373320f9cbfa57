# The README's two commands: `make demo` and `make test`. Each bootstraps a fresh machine by itself.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV_FILE := .rollbus/venv-path

.PHONY: help bootstrap demo test lint bench broker-start broker-stop clean

help:
	@echo "make demo   - run the end-to-end slice on embedded defaults (broker, engine, adapter, Claude Code)"
	@echo "make test   - bootstrap, lint and run the whole test suite against a real Kafka broker"
	@echo "make bench  - run the benchmarks in bench/"

bootstrap:
	@mkdir -p .rollbus
	@scripts/bootstrap.sh | tail -n 1 > $(VENV_FILE)

demo: bootstrap
	@"$$(cat $(VENV_FILE))/bin/python" -m rollbus demo

test: bootstrap
	@v="$$(cat $(VENV_FILE))"; \
	"$$v/bin/ruff" check rollbus services trainer tests bench examples && \
	"$$v/bin/python" -m pytest -p no:cacheprovider -ra $(PYTEST_ARGS)

lint: bootstrap
	@"$$(cat $(VENV_FILE))/bin/ruff" check rollbus services trainer tests bench examples

bench: bootstrap
	@v="$$(cat $(VENV_FILE))"; for b in bench/*.py; do echo "== $$b"; "$$v/bin/python" "$$b" || exit 1; done

clean:
	rm -rf .rollbus
