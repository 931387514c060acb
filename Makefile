# hostdevd: the two commands a newcomer needs, plus the pieces they are made of.
#   make demo   run the agent on a simulated host
#   make test   the whole test suite (what CI runs)
#   make bench  the performance harness (writes BENCHMARKS.md)
#   make profile  where the agent's CPU goes per call, claims against echoes (perf)
#   make package  the .deb and .rpm, into target/packages/
#   make fuzz     every cargo-fuzz target for FUZZ_SECONDS (25) each
#   make deny     cargo deny: licences, bans, sources (advisories where reachable)
.PHONY: demo test deps test-deps fmt clippy unit python doc bench profile package packaging vm torture fuzz fuzz-bounded deny

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

# The real-kernel suite: Debian's 6.1 kernel, then a 6.12 kernel built from Debian's source
# with the iommufd interface, under QEMU (TCG) with an emulated SR-IOV NVMe controller and
# a virtual IOMMU (root; CI runs as root).
vm:
	./tests/vm/run.sh

test: test-deps fmt clippy unit doc python vm packaging fuzz-bounded deny
	@echo "make test: all suites passed"

# The long crash torture (SIGKILL under concurrent clients, 500 rounds); `make test`
# runs a bounded version of it.
torture:
	HOSTDEVD_TORTURE_ROUNDS=500 cargo test --release --test crash_torture -- --nocapture

# The performance harness: end-to-end ratios (writes BENCHMARKS.md), then the criterion
# micro-benchmarks.
bench:
	./scripts/deps.sh --dev
	cargo bench --bench e2e
	cargo bench --bench micro

# Where the agent's CPU goes per call under 64 clients, claims and releases against bare
# echoes (`perf record` on the agent; see benches/README.md). Prints its rows only.
profile:
	./scripts/deps.sh --dev --profile
	HOSTDEVD_BENCH_ROWS=profile cargo bench --bench e2e

# Every fuzz target for a bounded time; fails on a crash (see fuzz/run.sh).
FUZZ_SECONDS ?= 25
fuzz: deps
	FUZZ_SECONDS=$(FUZZ_SECONDS) ./fuzz/run.sh

# What `make test` runs: every fuzz target from its committed corpus for a bounded time.
FUZZ_TEST_SECONDS ?= 10
fuzz-bounded: deps
	FUZZ_SECONDS=$(FUZZ_TEST_SECONDS) ./fuzz/run.sh

# Licences, bans and sources always. The advisory database is fetched from github.com,
# which this project's machines cannot reach; HOSTDEVD_DENY_ADVISORIES=1 adds the
# advisories check where it can be fetched.
deny:
	./scripts/deps.sh --deny
	PATH="$(CURDIR)/target/tools/bin:$$PATH" cargo deny check licenses bans sources
	if [ "$${HOSTDEVD_DENY_ADVISORIES:-0}" = 1 ]; then \
		PATH="$(CURDIR)/target/tools/bin:$$PATH" cargo deny check advisories; \
	fi
