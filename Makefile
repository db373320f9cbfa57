# The README's two commands: `make demo` and `make test`. Each bootstraps a fresh machine by itself.
# $(VENV_FILE) names this clone's venv (scripts/clone_venv.sh): the shared heavy venv plus this clone's code.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV_FILE := .rollbus/venv-path

.PHONY: help bootstrap bootstrap-test demo test test-compose test-faults lint bench broker-start broker-stop clean

help:
	@echo "make demo   - the closed loop on embedded defaults: roll out, grade, segment, train, serve the new policy"
	@echo "make test   - bootstrap, lint and run the whole test suite against a real Kafka broker"
	@echo "make test-faults - only the whole-pipeline fault test (every part SIGKILLed once under rollbus up; ~10 min)"
	@echo "make bench  - run the benchmarks in bench/ (BENCH_ARGS=--quick: a smoke run of each)"
	@echo "make lint   - ruff over the code, mypy over the product code (rollbus/, services/, trainer/)"
	@echo "make broker-start / broker-stop - the embedded Kafka broker of .rollbus (any free port if 9092 is taken)"
	@echo "make clean  - remove .rollbus (broker data, the clone's venv layer)"

# bootstrap: what the demo runs on; bootstrap-test: that and the test suite's own packages
bootstrap:
	@mkdir -p .rollbus
	@set -o pipefail; scripts/bootstrap.sh | tail -n 1 > $(VENV_FILE)

bootstrap-test:
	@mkdir -p .rollbus
	@set -o pipefail; scripts/bootstrap.sh --test | tail -n 1 > $(VENV_FILE)

demo: bootstrap
	@"$$(cat $(VENV_FILE))/bin/python" -m rollbus demo

# A share of the broker tests runs again on testcontainers' KafkaContainer (the Kafka image built here, on the
# project's own Docker engine), so that path is proven in every run; the embedded broker serves the rest.
DOCKER_BROKER_SHARE := tests/test_local_images.py tests/test_regrade.py tests/test_sandbox_runner_delivery.py \
	tests/test_trainer_service.py::test_trains_publishes_and_the_engine_serves_each_version

# The suite runs on $(TEST_WORKERS) pytest-xdist workers, a file to a worker (module rigs start once), in the order
# tests/conftest.py's LONGEST_FIRST gives, its ONE_AT_A_TIME whole-stack files one after another on one worker:
# most of a test's wall time is waiting on brokers, CLIs, engines and containers, so three overlap well even on
# two cores. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 3
XDIST = $(if $(filter 0,$(TEST_WORKERS)),-p no:xdist,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: bootstrap-test
	@v="$$(cat $(VENV_FILE))"; \
	"$$v/bin/ruff" check rollbus services trainer tests bench examples scripts setup.py && \
	"$$v/bin/python" scripts/typecheck.py && \
	"$$v/bin/python" -m pytest -p no:cacheprovider -ra --durations=30 $(XDIST) $(PYTEST_ARGS) && \
	{ [ -n "$(PYTEST_ARGS)" ] || \
	  ROLLBUS_TEST_BROKER=docker "$$v/bin/python" -m pytest -p no:cacheprovider -ra $(DOCKER_BROKER_SHARE); }

test-compose: bootstrap-test
	@"$$(cat $(VENV_FILE))/bin/python" -m pytest -p no:cacheprovider -ra -m compose tests/test_compose_up.py

test-faults: bootstrap-test
	@"$$(cat $(VENV_FILE))/bin/python" -m pytest -p no:cacheprovider -ra -m faults tests/integration/test_pipeline_faults.py

# mypy (a dev dependency of the lock, so `make bootstrap` has it too) through scripts/typecheck.py, which names
# services/ and trainer/ rollbus.services / rollbus.trainer; its cache is .rollbus/mypy-cache ([tool.mypy])
lint: bootstrap
	@v="$$(cat $(VENV_FILE))"; \
	"$$v/bin/ruff" check rollbus services trainer tests bench examples scripts setup.py && \
	"$$v/bin/python" scripts/typecheck.py

bench: bootstrap
	@v="$$(cat $(VENV_FILE))"; for b in $$(grep -l __main__ bench/*.py); do \
	echo "== $$b $(BENCH_ARGS)"; "$$v/bin/python" "$$b" $(BENCH_ARGS) || exit 1; done

broker-start: bootstrap
	@"$$(cat $(VENV_FILE))/bin/rollbus" broker start

broker-stop: bootstrap
	@"$$(cat $(VENV_FILE))/bin/rollbus" broker stop

clean:
	rm -rf .rollbus
