# hostdevd: the two commands a newcomer needs, plus the pieces they are made of.
#   make demo   run the agent on a simulated host
#   make test   the whole test suite (what CI runs)
#   make bench  the performance harness (writes BENCHMARKS.md)
#   make package  the .deb and .rpm, into target/packages/
.PHONY: demo test deps test-deps fmt clippy unit python doc bench package packaging vm torture

demo: deps
	cargo run --quiet --bin hostdevd -- demo

deps:
	./scripts/deps.sh

test-deps:
	./scripts/deps.sh --tests

fmt:
	cargo fmt --all -- --check

clippy:
	cargo clippy --all-targets -- -D warnings

unit:
	cargo test --lib --bins --tests

doc:
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet

python:
	./tests/python/run.sh

# The .deb and .rpm, into target/packages/ (see packaging/README.md).
package: deps
	./scripts/package.sh

# Build, inspect, lint, install, upgrade and purge the packages (root; CI runs as root).
packaging:
	./tests/packaging/run.sh

# The real-kernel suite: Debian's 6.1 kernel under QEMU (TCG) with an emulated SR-IOV
# NVMe controller and a virtual IOMMU (root; CI runs as root).
vm:
	./tests/vm/run.sh

test: test-deps fmt clippy unit doc python vm packaging
	@echo "make test: all suites passed"

# The long crash torture (SIGKILL under concurrent clients, 500 rounds); `make test`
# runs a bounded version of it.
torture:
	HOSTDEVD_TORTURE_ROUNDS=500 cargo test --release --test crash_torture -- --nocapture

# The performance harness: end-to-end ratios (writes BENCHMARKS.md), then the criterion
# micro-benchmarks.
bench: deps
	cargo bench --bench e2e
	cargo bench --bench micro
