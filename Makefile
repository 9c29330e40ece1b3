# gpu-ckpt: build, test, demo and benchmarks.
#
#   make demo    install what is missing, run a container on this runtime, show it working
#   make test    every test: lint, unit tests, and integration tests against a private containerd
#
# The test stack (containerd 2.x, runc, CRIU, registry, checkpointctl) lives in $(STACK),
# installed by test-containers/stack/install.sh; nothing goes into a system containerd.

STACK ?= $(CURDIR)/.stack
export GPU_CKPT_STACK := $(STACK)
CARGO ?= cargo
HOST_TARGET := x86_64-unknown-linux-gnu
WORKLOADS_DIR := $(CURDIR)/target/$(HOST_TARGET)/release
GPU_WORKLOADS_DIR := $(CURDIR)/target/debug
IMAGES_DIR := $(STACK)/images

.PHONY: all deps build release release-tools workloads images lint unit-test integration-test test demo bench bench-image-format fuzz clean-stack

all: build

deps:
	test-containers/stack/install.sh

build:
	$(CARGO) build --workspace --all-targets

release:
	$(CARGO) build --release -p gpu-ckpt-shim

# The shim, the gpu-ckpt command and the demo/benchmark drivers, optimised, with the simulated
# driver's libcuda.so and libnvidia_ml.so and the simulated NCCL's libnccl.so (cdylibs, which
# `--bins` leaves out) for the demo.
release-tools:
	$(CARGO) build --release --workspace --bins
	$(CARGO) build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl

# Test workloads are fully static so that images need no libc.
workloads:
	RUSTFLAGS="-C target-feature=+crt-static" $(CARGO) build --release -p gpu-ckpt-workloads --target $(HOST_TARGET)

# The test images, by the image tool (gpu-ckpt-images) of a workspace build, so that no second
# feature set of the dependencies is compiled. The GPU workloads image takes gpu-train,
# gpu-fill and nccl-train from that build (dynamically linked: they dlopen libcuda.so.1), the C
# program nccl_allreduce (built by c/build.sh into the same directory, against the stack's NCCL
# wheel) and the host's glibc.
# `images` uses the debug build the tests run; `release-images` the release build that the demo
# and the benchmarks run anyway, so that they compile no debug build of every test target.
build-images = test-containers/gpu-workloads/c/build.sh $(1) && \
	$(1)/gpu-ckpt-images --workloads-dir $(WORKLOADS_DIR) --gpu-workloads-dir $(1) --out $(IMAGES_DIR)

images: workloads build
	$(call build-images,$(GPU_WORKLOADS_DIR))

.PHONY: release-images
release-images: workloads release-tools
	$(call build-images,$(CURDIR)/target/release)

# The shipped binaries (shim, gpu-ckpt, gpu-ckpt-hook, gpu-ckpt-node-installer) and the NCCL layer
# (libgpu-ckpt-nccl.so) for glibc 2.28 and later, built by cargo-zigbuild with zig as the linker into target/payload/ (never the workspace's
# own target directories), and the stack's CRIU with its libraries and glibc's loader:
# target/payload/payload is the installer image's /payload (runtime-class/installer/payload.sh;
# tests/integration/payload_glibc.rs checks every ELF of it against the floor).
.PHONY: payload
payload: deps
	GPU_CKPT_STACK=$(STACK) CARGO="$(CARGO)" runtime-class/installer/payload.sh build

# The node installer's image (runtime-class/installer/README.md): the payload above, as
# $(IMAGES_DIR)/gpu-ckpt-node-installer-<version>.tar, the Helm chart's default image (not in
# images.json: the tests do not import it).
.PHONY: installer-image
installer-image: payload
	$(CARGO) build -p gpu-ckpt-test-containers --bin gpu-ckpt-images
	target/debug/gpu-ckpt-images --node-installer-bins target/payload/installer --payload target/payload/payload --out $(IMAGES_DIR)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

unit-test:
	$(CARGO) test --workspace --lib --bins

# Integration tests start their own containerd nodes; the registry is started around them.
integration-test: deps build images payload
	test-containers/stack/test.sh

# One build from scratch: incremental compilation's caches would only double target/'s size.
test: export CARGO_INCREMENTAL = 0
test: deps lint build images payload
	test-containers/stack/test.sh

demo: deps release-images
	test-containers/stack/demo.sh

bench: deps release-images
	test-containers/stack/bench.sh

# 1 GiB of device memory through the simulated driver's lock, checkpoint, restore and unlock,
# next to a pipe carrying the same bytes out and back (docs/benchmarks.md). `--bins` leaves out
# the simulated libcuda.so, libnvidia_ml.so and libnccl.so (cdylibs), so they are built here.
.PHONY: bench-gpu
bench-gpu: deps release-tools
	$(CARGO) build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl
	target/release/gpu-ckpt-bench gpu --gib 1 --rounds 12

# gpu-ckpt's synced host-memory checkpoint of 1 GiB against runc-v2's, and the restore of the
# same images through each, read from the disk, with a control pair (docs/benchmarks.md).
.PHONY: bench-host-memory
bench-host-memory: deps release-images
	GPU_CKPT_SHIM_DIR=$(CURDIR)/target/release target/release/gpu-ckpt-bench host-memory --mib 1024 --runs 10

# A container holding 1 GiB of simulated device memory (gpu-fill) against one holding 1 GiB of host
# memory (memhog), through the release shim: checkpoint, restore and the CRI freeze, next to
# runc-v2's freeze (docs/benchmarks.md). The simulated libcuda.so, libnvidia_ml.so and libnccl.so (cdylibs)
# are built here as for bench-gpu.
.PHONY: bench-gpu-container
bench-gpu-container: deps images release-tools
	$(CARGO) build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl
	GPU_CKPT_SHIM_DIR=$(CURDIR)/target/release target/release/gpu-ckpt-bench device-container --gib 1 --runs 3

# The CRI freeze of a GPU pod holding 1 GiB of simulated device memory with
# `gpu-ckpt.io/resume-after-dump: "true"` and without it, each over the sum of its device steps
# and CRIU's dump from the manifest's timings, as ratios (docs/benchmarks.md).
.PHONY: bench-freeze-resume
bench-freeze-resume: deps images release-tools
	$(CARGO) build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl
	GPU_CKPT_SHIM_DIR=$(CURDIR)/target/release target/release/gpu-ckpt-bench freeze-resume --mib 1024 --runs 3

# Device checkpoint and restore through the release shim at 1, 4 and 8 GiB and of 1, 2 and 4 GPU
# processes in one container, by custom storage (simulated CUDA 13.5) and by the staged path
# (13.0), against the same bytes written and read with O_DIRECT in the same directory
# (docs/benchmarks.md). STORAGE_ARGS overrides the sizes (e.g. `--gib 1,4 --procs 1,4`).
.PHONY: bench-gpu-storage
bench-gpu-storage: deps images release-tools
	$(CARGO) build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl
	GPU_CKPT_SHIM_DIR=$(CURDIR)/target/release target/release/gpu-ckpt-bench device-storage $(STORAGE_ARGS)

# What the NCCL communicator layer's steps add to the checkpoint and restore of 4 ranks
# (nccl_allreduce on 4 simulated GPUs, one container) through the release shim: quiesce and
# release against the device lock and checkpoint, the rebuild against the device restore, as
# ratios from one run (docs/benchmarks.md). The layer (a cdylib) is built here with the
# simulated libraries.
.PHONY: bench-nccl
bench-nccl: deps images release-tools
	$(CARGO) build --release -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl -p gpu-ckpt-nccl-layer
	GPU_CKPT_SHIM_DIR=$(CURDIR)/target/release target/release/gpu-ckpt-bench nccl --runs 5

# Real-GPU check: one folder, target/gpu-check, that runs on an NVIDIA machine with nothing but the
# driver (see test-containers/gpu-workloads/README.md); without a GPU it says why and exits 0.
.PHONY: gpu-check gpu-check-bundle
gpu-check-bundle:
	CARGO="$(CARGO)" test-containers/gpu-workloads/gpu-check/bundle.sh $(CURDIR)/target/gpu-check

gpu-check: gpu-check-bundle
	target/gpu-check/run.sh

# The shim on a real GPU: one folder, target/gpu-check-shim (a private containerd, runc, CRIU,
# the release shim, the CRI client gpu-ckpt-cri, the gpu-workloads and pause images, the
# containerd drop-ins), whose shim-run.sh runs a GPU container through checkpoint and restore
# on an NVIDIA machine with nothing but the driver: with ctr, then as a pod through CRI,
# restored on a second containerd through the restore RuntimeClass's handler.
.PHONY: gpu-check-shim gpu-check-shim-bundle gpu-check-shim-sim
gpu-check-shim-bundle: deps images release
	$(CARGO) build --release -p gpu-ckpt-test-containers --bin gpu-ckpt-cri
	test-containers/gpu-workloads/gpu-check/shim-bundle.sh $(CURDIR)/target/gpu-check-shim

gpu-check-shim: gpu-check-shim-bundle
	target/gpu-check-shim/shim-run.sh

# The same folder on this machine without a GPU: against the simulated driver, whose node
# directory (`gpu-ckpt-simgpu serve`) gives shim-run.sh the driver's libraries (DRIVER_LIB) and
# the GPUs' CDI spec (CDI_SPEC).
gpu-check-shim-sim: gpu-check-shim-bundle
	$(CARGO) build --release -p gpu-ckpt-simgpu -p gpu-ckpt-simcuda -p gpu-ckpt-simnvml -p gpu-ckpt-simnccl
	d=$$(mktemp -d /tmp/gpu-ckpt-sim.XXXXXX); \
	target/release/gpu-ckpt-simgpu serve --dir $$d/node --cdi-dir $$d/node/cdi >$$d/serve.log 2>&1 & sim=$$!; \
	for _ in $$(seq 200); do [ -S $$d/node/simgpu.sock ] && ls $$d/node/cdi/*.json >/dev/null 2>&1 && break; sleep 0.1; done; \
	DRIVER_LIB=$$d/node/lib CDI_SPEC=$$(ls $$d/node/cdi/*.json) target/gpu-check-shim/shim-run.sh; rc=$$?; \
	kill $$sim; { wait $$sim; } 2>/dev/null; rm -rf $$d; exit $$rc

# The node agent's cost (docs/benchmarks.md, "The node agent"): CPU (utime+stime from /proc) and
# memory (VmRSS, VmHWM) of the release gpu-ckpt-agent at idle and scraped once a second, with
# AGENT_RECORDS records counted from its journal, next to a trivial exporter (Python's
# http.server serving the same /metrics body) measured the same way; AGENT_SECONDS per phase.
AGENT_SECONDS ?= 30
AGENT_RECORDS ?= 10000
.PHONY: bench-agent
bench-agent:
	$(CARGO) build --release -p gpu-ckpt-agent --bins
	target/release/gpu-ckpt-agent-bench target/release/gpu-ckpt-agent --seconds $(AGENT_SECONDS) --records $(AGENT_RECORDS)

# gpu-ckpt build and verify throughput on a 4 GiB archive, next to sha256sum and tar.
bench-image-format:
	$(MAKE) -C image-format bench SIZE_GIB=4

# Push and pull of a 1 GiB checkpoint image through the stack's TLS registry (HTTPS, login), by
# gpu-ckpt and by skopeo on the same image and registry, as ratios (docs/benchmarks.md).
.PHONY: bench-registry
bench-registry: deps
	$(CARGO) build --release -p gpu-ckpt-cli --bin gpu-ckpt
	test-containers/stack/bench-registry.sh

# The plain manifests (runtime-class/manifests/*.yaml) rendered again from the Helm chart
# (runtime-class/chart/gpu-ckpt) with its default values, by Helm's engine in the stack's Python
# venv (`make deps`); tests/integration/k8s_manifests.rs fails while they differ from that rendering.
.PHONY: manifests
manifests:
	@test -x $(STACK)/py/bin/python || { echo "make manifests: $(STACK)/py/bin/python is missing; run 'make deps'" >&2; exit 1; }
	$(STACK)/py/bin/python runtime-class/tools/chart.py manifests runtime-class/chart/gpu-ckpt runtime-class/manifests

# The full soak (docs/benchmarks.md, "Soak"): a counter checkpointed and restored 100 times in a
# row under one shim, and 20 pods checkpointed at once, 5 times; the shims' fds and RSS with their
# slopes (the debug shim, as the test command runs it). The tests start the plain registry if it
# is not running. The test command runs a short soak (test-containers/tests/integration/soak.rs).
.PHONY: soak
soak: deps images
	$(CARGO) build -p gpu-ckpt-shim
	GPU_CKPT_SHIM_DIR=$(CURDIR)/target/debug GPU_CKPT_SOAK_CYCLES=100 GPU_CKPT_SOAK_PODS=20 \
	  GPU_CKPT_SOAK_ROUNDS=5 $(CARGO) test -p gpu-ckpt-test-containers --test integration \
	  -- --test-threads=1 --nocapture soak::

# Longer fuzzing of the archive reader and manifest parser than the test command's bounded run.
fuzz:
	$(MAKE) -C image-format fuzz-long

clean-stack:
	test-containers/stack/registry.sh stop || true
	rm -rf $(STACK)/nodes $(STACK)/registry-data
