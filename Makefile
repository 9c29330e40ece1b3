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
IMAGES_DIR := $(STACK)/images

.PHONY: all deps build release workloads images lint unit-test integration-test test demo bench clean-stack

all: build

deps:
	test-containers/stack/install.sh

build:
	$(CARGO) build --workspace --all-targets

release:
	$(CARGO) build --release -p gpu-ckpt-shim

# Test workloads are fully static so that images need no libc.
workloads:
	RUSTFLAGS="-C target-feature=+crt-static" $(CARGO) build --release -p gpu-ckpt-workloads --target $(HOST_TARGET)

images: workloads
	$(CARGO) run -q -p gpu-ckpt-test-containers --bin gpu-ckpt-images -- --workloads-dir $(WORKLOADS_DIR) --out $(IMAGES_DIR)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

unit-test:
	$(CARGO) test --workspace --lib --bins

# Integration tests start their own containerd nodes; the registry is started around them.
integration-test: deps build images
	test-containers/stack/test.sh

test: deps lint build images
	test-containers/stack/test.sh

demo: deps images release
	test-containers/stack/demo.sh

bench: deps images release
	test-containers/stack/bench.sh

clean-stack:
	test-containers/stack/registry.sh stop || true
	rm -rf $(STACK)/nodes $(STACK)/registry-data
