# moorage: every target does its own set-up (host packages, .venv, protobuf
# stubs), so `make demo` and `make test` work on a fresh clone as root.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PROTOS := $(wildcard csi/proto/*.proto backend/proto/*.proto)
STUBS := $(PROTOS:.proto=_pb2.py)

# Tools built from Go modules, each pinned here and only here, built once into
# a cache outside the tree (kept across clones; rebuilt only when missing).
TOOLS_DIR ?= $(HOME)/.cache/moorage/tools
GO ?= $(shell command -v go || echo /usr/local/go/bin/go)
CSI_SANITY_VERSION := v5.4.0
CSI_SANITY := $(TOOLS_DIR)/csi-sanity-$(CSI_SANITY_VERSION)/csi-sanity
export MOORAGE_CSI_SANITY := $(CSI_SANITY)

.PHONY: all demo test lint typecheck unit bench host proto tools clean

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

$(CSI_SANITY):
	@test -x "$(GO)" || { echo "make: Go is needed to build csi-sanity (not found)"; exit 1; }
	GOBIN=$(dir $@) GOFLAGS=-buildvcs=false $(GO) install \
		github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity@$(CSI_SANITY_VERSION)

tools: $(CSI_SANITY)

demo: host proto
	$(VENV)/bin/moorage demo

lint: proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: proto
	$(VENV)/bin/mypy

unit: proto tools
	$(PY) -m pytest -q

test: host proto tools
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q

bench: host proto tools
	$(PY) -m pytest -q -p no:randomly tests/bench -o addopts="" -s

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
	find . -name '*_pb2*.py' -o -name '*_pb2.pyi' | xargs -r rm -f
