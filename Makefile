# kvcentric: `make up` runs the whole system on this box, `make test` runs the whole suite.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: up test unit integration proto bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[engine,test]'
	touch $(STAMP)

up: $(STAMP)
	$(BIN)/kvcentric up $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra tests

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

proto: $(STAMP)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/python -m grpc_tools.protoc -I libs --python_out=libs --grpc_python_out=libs libs/kvcentric/proto/kv.proto

clean:
	rm -rf $(VENV) build *.egg-info
