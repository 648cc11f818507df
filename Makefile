# kvcentric: `make up` runs the whole system on this box, `make test` runs the whole suite, `make lint` checks the code.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LINTED := $(VENV)/.lint-installed
ARGS   ?=

.PHONY: up test unit pure integration compose-check lint proto bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,test]'
	touch $(STAMP)

up: $(STAMP)
	$(BIN)/kvcentric up $(ARGS)

# The suite in two parts: tests/unit (the cores, no servers, no clocks) on TEST_WORKERS pytest-xdist workers, a
# test file each at a time; then the rest in one process, nothing beside it, since those tests judge live clusters'
# timings (admission against SLOs, recovery after a fault, cores lent while idle), which a neighbour's load moves:
# run beside each other they failed one test in three runs of four (docs/performance-notebook.md, "The test
# suite's time"). TEST_WORKERS=0: the unit tests in one process too. Both parts run; the target fails if either did.
TEST_WORKERS ?= 2

test: $(STAMP)
	status=0; \
	$(BIN)/python -m pytest -q -ra --durations=10 -n $(TEST_WORKERS) --dist loadfile tests/unit || status=1; \
	$(BIN)/python -m pytest -q -ra --durations=20 --ignore=tests/unit tests || status=1; \
	exit $$status

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

pure: $(STAMP)
	PYTHONPATH=tests $(BIN)/python -m pytest -q -p torchless $$($(BIN)/python -c \
	    "import sys; sys.path.insert(0, 'tests/unit'); import test_pure_cores_without_torch as t; \
	    print(' '.join(str(p) for p in t.pure_core_tests()))")

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

# docker-compose.yml for real (tests/deploy): build, up, requests, a killed decode restarted, decode scaled to 2,
# down; then secured (docker-compose.secure.yml) and the two PrfaaS datacenters secured (docker-compose.prfaas.secure.yml),
# each from its block of docs/operations.md; needs a Docker daemon with the compose plugin (minutes; measurements
# land in build/compose-check.json, build/compose-secure-check.json, build/compose-prfaas-secure-check.json).
# Pinned images can be pointed elsewhere: PYTHON_IMAGE=... NATS_IMAGE=... REDIS_IMAGE=... TORCH_INDEX_URL=...
compose-check: $(STAMP)
	KVC_COMPOSE_CHECK=1 $(BIN)/python -m pytest -q -ra -p no:cacheprovider tests/deploy

$(LINTED): $(STAMP)
	$(BIN)/pip install -q -e '.[lint]'
	touch $(LINTED)

# ruff (defects, no formatting), mypy (the library and the services, which import as kvc_<name>: linked under
# build/typecheck), import-linter (layers and forbidden imports, pyproject.toml) and a check for import cycles.
# Every check runs, so one report shows all findings; it fails if any check failed.
lint: $(LINTED)
	mkdir -p build/typecheck
	for dir in services/*; do ln -sfn ../../$$dir build/typecheck/kvc_$$(basename $$dir | tr - _); done
	status=0; \
	$(BIN)/ruff check || status=1; \
	$(BIN)/mypy > build/mypy.txt || status=1; \
	sed -e 's#build/typecheck/kvc_kvs_meta/#services/kvs-meta/#' -e 's#build/typecheck/kvc_\([a-z]*\)/#services/\1/#' \
	    build/mypy.txt; \
	$(BIN)/lint-imports --no-logo --cache-dir build/import-linter || status=1; \
	$(BIN)/python .ci/import_cycles.py || status=1; \
	exit $$status

proto: $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m grpc_tools.protoc -I libs --python_out=libs --grpc_python_out=libs libs/kvcentric/proto/kv.proto

clean:
	rm -rf $(VENV) build *.egg-info
