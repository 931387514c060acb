# hostdevd: the two commands a newcomer needs, plus the pieces they are made of.
#   make demo   run the agent on a simulated host
#   make test   the whole test suite (what CI runs)
.PHONY: demo test deps test-deps fmt clippy unit python doc

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
	cargo test --all-targets

doc:
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --quiet

python:
	./tests/python/run.sh

test: test-deps fmt clippy unit doc python
	@echo "make test: all suites passed"
