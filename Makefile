# moorage: every target does its own set-up (host packages, .venv, protobuf
# stubs), so `make demo` and `make test` work on a fresh clone as root.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
PROTOS := $(wildcard csi/proto/*.proto backend/api/proto/*.proto)
STUBS := $(PROTOS:.proto=_pb2.py)

# Tools built from Go modules, each pinned here and only here, built once into
# a cache outside the tree (kept across clones; rebuilt only when missing).
TOOLS_DIR ?= $(HOME)/.cache/moorage/tools
GO ?= $(shell command -v go || echo /usr/local/go/bin/go)
CSI_SANITY_VERSION := v5.4.0
CSI_SANITY := $(TOOLS_DIR)/csi-sanity-$(CSI_SANITY_VERSION)/csi-sanity
export MOORAGE_CSI_SANITY := $(CSI_SANITY)
HELM_VERSION := v3.19.0
HELM := $(TOOLS_DIR)/helm-$(HELM_VERSION)/helm
export MOORAGE_HELM := $(HELM)
export MOORAGE_GO := $(GO)
# Kubernetes for the e2e cluster, from its own Go module (1.34: the last
# release that runs on cgroup v1 without an opt-out).
KUBERNETES_VERSION := v1.34.4
KUBE_BIN := $(TOOLS_DIR)/kubernetes-$(KUBERNETES_VERSION)
KUBE_COMMANDS := kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl
export MOORAGE_KUBE_BIN := $(KUBE_BIN)
# etcd for the API server: 3.6, the minor Kubernetes v1.34.4 names (3.6.5 in its
# build/dependencies.yaml and kubeadm's default), at a later patch release.
ETCD_VERSION := v3.6.16
ETCD_DIR := $(TOOLS_DIR)/etcd-$(ETCD_VERSION)
export MOORAGE_ETCD := $(ETCD_DIR)/etcd
export MOORAGE_ETCDCTL := $(ETCD_DIR)/etcdctl
# The cluster's other images (pause, busybox, the CSI sidecars) and the
# snapshot CRDs and controller, named by the image versions the chart pins,
# the Kubernetes release and the scripts that build them (deploy/e2e/build-images.sh).
E2E_IMAGES_KEY := $(shell { sed -n '/^images:/,/^[^ ]/{/^ /p}' deploy/helm/moorage/values.yaml; \
	echo $(KUBERNETES_VERSION); cat deploy/e2e/build-images.sh deploy/e2e/image-lib.sh \
	deploy/image/oci.py; } 2>/dev/null \
	| sha256sum | cut -c1-16)
E2E_IMAGES := $(TOOLS_DIR)/e2e-images-$(E2E_IMAGES_KEY)
# Release sources of the sidecars the Go module proxy refuses (vendored tarballs,
# built offline): the node-driver-registrar and the livenessprobe.
THIRD_PARTY ?= $(abspath $(CURDIR)/../shared/third-party)
export MOORAGE_E2E_IMAGES := $(E2E_IMAGES)
# Kubernetes' External Storage suite (docs/e2e.md, "Conformance"): e2e.test,
# ginkgo and agnhost from the same release, and the images its pods run.
CONFORMANCE_KEY := $(shell cat deploy/e2e/build-conformance.sh 2>/dev/null | sha256sum | cut -c1-16)
CONFORMANCE_BIN := $(TOOLS_DIR)/conformance-$(KUBERNETES_VERSION)-$(CONFORMANCE_KEY)
CONFORMANCE_COMMANDS := e2e.test ginkgo agnhost
export MOORAGE_CONFORMANCE_BIN := $(CONFORMANCE_BIN)
SUITE_IMAGES_KEY := $(shell { echo $(KUBERNETES_VERSION); cat deploy/e2e/build-suite-images.sh \
	deploy/e2e/build-conformance.sh deploy/e2e/image-lib.sh deploy/image/oci.py; } 2>/dev/null \
	| sha256sum | cut -c1-16)
SUITE_IMAGES := $(TOOLS_DIR)/suite-images-$(SUITE_IMAGES_KEY)
export MOORAGE_SUITE_IMAGES := $(SUITE_IMAGES)
# CNI plugins: Debian's containernetworking-plugins (deploy/host/install-deps.sh)
export MOORAGE_CNI_BIN := /usr/lib/cni
# The container image, kept outside the tree and named by a digest of what
# goes into it, so it is rebuilt only when that changes.
IMAGE_REF := moorage:0.1.0
IMAGE_INPUTS := $(shell git ls-files -s hostio nbd fuse backend csi moorage pyproject.toml deploy/image 2>/dev/null | sha256sum | cut -c1-16)
IMAGE := $(HOME)/.cache/moorage/image/moorage-$(IMAGE_INPUTS).tar
# how many image archives stay in the cache (the newest)
IMAGES_KEPT := 4
export MOORAGE_IMAGE := $(IMAGE)
export MOORAGE_IMAGE_REF := $(IMAGE_REF)
# The kernel lane's guest (docs/kernel-lane.md): Debian's cloud kernel and a
# root filesystem, named by a digest of the scripts that make it.
GUEST_KEY := $(shell cat deploy/kernel-lane/build-guest.sh deploy/kernel-lane/init 2>/dev/null \
	| sha256sum | cut -c1-16)
GUEST := $(HOME)/.cache/moorage/kernel-lane/guest-$(GUEST_KEY)
export MOORAGE_GUEST := $(GUEST)
# The namespace the plain manifests in deploy/kubernetes are rendered for.
MANIFESTS_NAMESPACE := moorage-system

.PHONY: all demo test lint typecheck unit bench host proto tools manifests image e2e-images e2e-tools \
	guest test-kernel kernel-shell e2e conformance conformance-tools cluster-up cluster-status cluster-down clean

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

$(HELM):
	@test -x "$(GO)" || { echo "make: Go is needed to build helm (not found)"; exit 1; }
	GOBIN=$(dir $@) GOFLAGS=-buildvcs=false $(GO) install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)

tools: $(CSI_SANITY) $(HELM)

$(IMAGE): | proto
	mkdir -p $(dir $@)
	bash deploy/image/build.sh $@ $(IMAGE_REF) $(PY)
	# the newest few stay: other checkouts (worktrees, a fresh clone) share this cache
	ls -t $(dir $@)moorage-*.tar | tail -n +$$(( $(IMAGES_KEPT) + 1 )) | xargs -r rm -f --

image: host proto $(IMAGE)

$(GUEST): | host
	mkdir -p $(dir $@)
	bash deploy/kernel-lane/build-guest.sh $@
	find $(dir $@) -maxdepth 1 -name 'guest-*' ! -name $(notdir $@) -exec rm -rf {} +

guest: host $(GUEST)

# The kernel paths (kernel nbd, the kernel NFS client) in a QEMU guest with
# Debian's cloud kernel: this host's kernel has neither (docs/kernel-lane.md).
KERNEL_ARGS ?= tests/kernel
test-kernel: host proto tools $(GUEST)
	$(PY) -m pytest -o addopts="" -p no:randomly -p no:cacheprovider -rA --timeout=900 \
		$(KERNEL_ARGS)

# A shell on the guest's console (the tree under test in it); exit powers it off.
kernel-shell: host proto tools $(GUEST)
	$(PY) -m tests.kernel.guest shell

# One build for all of them: any one missing rebuilds the set.
$(addprefix $(KUBE_BIN)/,$(KUBE_COMMANDS)) &:
	@test -x "$(GO)" || { echo "make: Go is needed to build Kubernetes (not found)"; exit 1; }
	bash deploy/e2e/build-kubernetes.sh $(KUBERNETES_VERSION) $(KUBE_BIN).partial $(GO)
	rm -rf $(KUBE_BIN) && mv $(KUBE_BIN).partial $(KUBE_BIN)

$(MOORAGE_ETCD) $(MOORAGE_ETCDCTL) &:
	@test -x "$(GO)" || { echo "make: Go is needed to build etcd (not found)"; exit 1; }
	bash deploy/e2e/build-etcd.sh $(ETCD_VERSION) $(ETCD_DIR).partial $(GO)
	rm -rf $(ETCD_DIR) && mv $(ETCD_DIR).partial $(ETCD_DIR)

# The script builds only the images that are missing from $(E2E_IMAGES).
e2e-images: host
	@test -x "$(GO)" || { echo "make: Go is needed to build the e2e images (not found)"; exit 1; }
	bash deploy/e2e/build-images.sh deploy/helm/moorage/values.yaml $(KUBERNETES_VERSION) \
		$(E2E_IMAGES) $(THIRD_PARTY) $(GO) $(PYTHON)
	find $(TOOLS_DIR) -maxdepth 1 -name 'e2e-images-*' ! -name $(notdir $(E2E_IMAGES)) \
		-exec rm -rf {} +

$(addprefix $(CONFORMANCE_BIN)/,$(CONFORMANCE_COMMANDS)) &:
	@test -x "$(GO)" || { echo "make: Go is needed to build e2e.test (not found)"; exit 1; }
	bash deploy/e2e/build-conformance.sh $(KUBERNETES_VERSION) $(CONFORMANCE_BIN).partial $(GO)
	rm -rf $(CONFORMANCE_BIN) && mv $(CONFORMANCE_BIN).partial $(CONFORMANCE_BIN)
	find $(TOOLS_DIR) -maxdepth 1 -name 'conformance-*' ! -name $(notdir $(CONFORMANCE_BIN)) \
		-exec rm -rf {} +

$(SUITE_IMAGES)/images.txt: $(CONFORMANCE_BIN)/agnhost | host
	bash deploy/e2e/build-suite-images.sh $(KUBERNETES_VERSION) $(CONFORMANCE_BIN)/agnhost \
		$(SUITE_IMAGES) $(GO) $(PYTHON)
	find $(TOOLS_DIR) -maxdepth 1 -name 'suite-images-*' ! -name $(notdir $(SUITE_IMAGES)) \
		-exec rm -rf {} +

conformance-tools: $(addprefix $(CONFORMANCE_BIN)/,$(CONFORMANCE_COMMANDS)) $(SUITE_IMAGES)/images.txt

# The e2e cluster's tools.
e2e-tools: $(addprefix $(KUBE_BIN)/,$(KUBE_COMMANDS)) $(MOORAGE_ETCD) $(MOORAGE_ETCDCTL) e2e-images $(HELM)

# The seed scenarios on a real Kubernetes on this machine (docs/e2e.md).  The
# cluster comes up for the run and goes down after it, unless one started by
# `make cluster-up` is running (then it is used and left up).
E2E_ARGS ?= tests/e2e
e2e: host proto e2e-tools $(IMAGE)
	$(PY) -m pytest -o addopts="" -p no:randomly -p no:cacheprovider -rA -s \
		--timeout=1200 $(E2E_ARGS)

# Kubernetes' External Storage suite against the chart's block and NFS classes
# (docs/e2e.md, "Conformance"); the cluster comes and goes as for `make e2e`.
CONFORMANCE_ARGS ?=
conformance: host proto e2e-tools conformance-tools $(IMAGE)
	$(VENV)/bin/moorage dev conformance $(CONFORMANCE_ARGS)

cluster-up: host proto e2e-tools $(IMAGE)
	$(VENV)/bin/moorage dev cluster up

cluster-status: $(INSTALLED)
	$(VENV)/bin/moorage dev cluster status

cluster-down: $(INSTALLED)
	$(VENV)/bin/moorage dev cluster down

# The plain manifests are the chart rendered with its default values; a test
# fails when they and the chart disagree.
manifests: $(HELM)
	{ echo "# Generated by 'make manifests' from deploy/helm/moorage (default values)."; \
	  echo "# Do not edit: change the chart and run 'make manifests'."; \
	  $(HELM) template moorage deploy/helm/moorage --namespace $(MANIFESTS_NAMESPACE) \
	    --kube-version 1.34.0; } > deploy/kubernetes/moorage.yaml

demo: host proto
	$(VENV)/bin/moorage demo

lint: proto
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/deptry .

typecheck: proto
	$(VENV)/bin/mypy

# pytest runs the tests in a new random order each time (pytest-randomly) and prints
# its seed at the end; PYTEST_ARGS=--randomly-seed=N runs an earlier run's order again,
# PYTEST_ARGS=tests/integration/test_x.py one file (README.md, "Two commands").
PYTEST_ARGS ?=
unit: proto tools
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: host proto tools $(IMAGE)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/deptry .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: host proto tools
	$(PY) -m pytest -q -p no:randomly tests/bench -o addopts="" -s

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
	find . -name '*_pb2*.py' -o -name '*_pb2.pyi' | xargs -r rm -f
