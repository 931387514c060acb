#!/usr/bin/env bash
# Runs every cargo-fuzz target of hostdevd for a bounded time and fails on a crash
# (what `make fuzz` runs).
#
#   fuzz/run.sh                     every target, FUZZ_SECONDS (default 25) each
#   fuzz/run.sh ids config          only these targets
#   fuzz/run.sh --merge [targets]   afterwards, add to the committed corpus up to
#                                   FUZZ_MERGE_MAX (20) found inputs that reach new
#                                   coverage (libFuzzer -merge=1)
#
# Environment: FUZZ_SECONDS (per target), FUZZ_SANITIZER (none, the default, or
# address), FUZZ_JOBS (libFuzzer workers per target, default 1).
#
# The toolchain is stable. Without a sanitizer (the default) every flag cargo-fuzz passes
# is a stable codegen option (-Cpasses=sancov-module, -Cllvm-args=-sanitizer-coverage-*)
# and RUSTC_BOOTSTRAP is not needed; FUZZ_SANITIZER=address adds -Zsanitizer=address,
# which stable rustc takes only with RUSTC_BOOTSTRAP=1. It is set in both cases, with
# CARGO_CACHE_RUSTC_INFO=0: cargo's cached target probe (target/.rustc_info.json) would
# otherwise replay a "-Z is only accepted on the nightly compiler" failure from a run
# made without RUSTC_BOOTSTRAP. hostdevd's only unsafe code is two allocator settings
# (src/memory.rs) that no target reaches, so the default is no sanitizer
# (coverage-guided, debug assertions on): ASan would only watch the C libraries
# (SQLite, libvirt), which no target reaches either.
#
# The committed seeds live in fuzz/corpus/<target>/ and are only read; the fuzzer's own
# corpus grows in fuzz/target/corpus/<target>/ (ignored by git). A crash leaves its input
# in fuzz/artifacts/<target>/ and makes this script exit 1 after naming it.
set -euo pipefail
cd "$(dirname "$0")"

# A C++ compiler for libFuzzer, libvirt's headers for hostdevd, and cargo-fuzz (pinned,
# into target/tools/).
../scripts/deps.sh --fuzz
export PATH="$PWD/../target/tools/bin:$PATH"
export RUSTC_BOOTSTRAP=1 CARGO_CACHE_RUSTC_INFO=0

merge=0
if [ "${1:-}" = "--merge" ]; then
  merge=1
  shift
fi
secs=${FUZZ_SECONDS:-25}
san=${FUZZ_SANITIZER:-none}
jobs=${FUZZ_JOBS:-1}
if [ $# -gt 0 ]; then
  targets=("$@")
else
  mapfile -t targets < <(cargo fuzz list)
fi

cargo fuzz build --sanitizer "$san"

# libFuzzer's -jobs writes fuzz-N.log files into the current directory: only when asked.
parallel=()
if [ "$jobs" -gt 1 ]; then
  parallel=(-jobs="$jobs" -workers="$jobs")
fi
mkdir -p target/logs
failed=()
summary=()
for t in "${targets[@]}"; do
  work=target/corpus/$t
  mkdir -p "$work" "corpus/$t"
  log=target/logs/$t.log
  echo "fuzz: $t for ${secs}s" >&2
  set +e
  cargo fuzz run --sanitizer "$san" "$t" "$work" "corpus/$t" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    "${parallel[@]}" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' |
    awk '{s+=$1} END {print s+0}')
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || true)
  files=$(find "$work" -type f | wc -l)
  if [ "$rc" -ne 0 ]; then
    failed+=("$t")
    echo "fuzz: $t FAILED (exit $rc); the end of $log:" >&2
    tail -n 40 "$log" >&2
    ls -l "artifacts/$t" 2>/dev/null >&2 || true
  fi
  summary+=("$(printf '%-12s %10s executions  %7s exec/s  coverage %6s  corpus %5s  %s' \
    "$t" "$execs" "${rate:-?}" "${cov:-?}" "$files" "$([ "$rc" -eq 0 ] && echo ok || echo CRASH)")")
  if [ "$merge" = 1 ] && [ "$rc" -eq 0 ]; then
    # The found inputs that reach coverage the committed corpus does not (libFuzzer
    # -merge=1 into a copy of it); the smallest FUZZ_MERGE_MAX (default 20) of them are
    # added, so the committed corpus stays small.
    fresh=target/merge/$t
    rm -rf "$fresh"
    mkdir -p "$fresh"
    cp "corpus/$t"/* "$fresh"/
    cargo fuzz run --sanitizer "$san" "$t" "$fresh" "$work" -- -merge=1 \
      >"target/logs/$t.merge.log" 2>&1
    added=0
    while read -r f; do
      [ "$added" -lt "${FUZZ_MERGE_MAX:-20}" ] || break
      [ -e "corpus/$t/$(basename "$f")" ] && continue
      cp "$f" "corpus/$t/"
      added=$((added + 1))
    done < <(find "$fresh" -type f ! -name 'seed-*' -printf '%s %p\n' | sort -n | cut -d' ' -f2-)
    echo "fuzz: $t: $added found inputs added, corpus/$t has $(find "corpus/$t" -type f | wc -l) files" >&2
  fi
done

echo "fuzz: ${secs}s per target, sanitizer $san"
printf '%s\n' "${summary[@]}"
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzz: crashes in ${failed[*]} (inputs under fuzz/artifacts/)" >&2
  exit 1
fi
