# moorage: every target does its own set-up (host packages, .venv, protobuf
# stubs), so `make demo` and `make test` work on a fresh clone as root.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PROTOS := $(wildcard csi/proto/*.proto backend/proto/*.proto)
STUBS := $(PROTOS:.proto=_pb2.py)

.PHONY: all demo test lint typecheck unit bench host proto clean

all: test

host:
	@bash deploy/host/install-deps.sh

$(INSTALLED): pyproject.toml | host
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,fuse]'
	touch $@

# Stubs are generated, never committed, never edited by hand.
%_pb2.py: %.proto $(INSTALLED)
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $<

proto: $(INSTALLED) $(STUBS)

demo: host proto
	$(VENV)/bin/moorage demo

lint: proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: proto
	$(VENV)/bin/mypy

unit: proto
	$(PY) -m pytest -q

test: host proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

bench: host proto
	$(PY) -m pytest -q -p no:randomly tests/bench -o addopts="" -s

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
	find . -name '*_pb2*.py' -o -name '*_pb2.pyi' | xargs -r rm -f
