#!/usr/bin/env bash
# Run every fuzz target (or the ones named) for N seconds each, one after another, each a
# single libFuzzer process on one core. Needs a nightly toolchain and cargo-fuzz:
#   rustup toolchain install nightly && cargo install cargo-fuzz
# usage: [RUNS=n] tools/fuzz-smoke.sh [seconds=60] [target ...]
#   RUNS stops a target after n executions if that comes before the time limit
#   (the long runs: RUNS=1000000 tools/fuzz-smoke.sh 1200).
# The grown corpus goes to fuzz/corpus/<target> (git-ignored), crashes to
# fuzz/artifacts/<target>/; the exit status is non-zero if any target crashed.
set -uo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
shift || true
if [ "$#" -gt 0 ]; then targets=("$@"); else mapfile -t targets < <(cargo +nightly fuzz list); fi

max_len() {
  case "$1" in
    gguf|tokenizer_json) echo 65536 ;;
    *) echo 8192 ;;
  esac
}

cargo +nightly fuzz build -O || exit 1
# One core: candle's CPU thread pool follows RAYON_NUM_THREADS.
export RAYON_NUM_THREADS=1
status=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  log="fuzz/corpus/$t.log"
  echo "== $t (${secs}s${RUNS:+ or $RUNS runs})"
  start=$SECONDS
  cargo +nightly fuzz run -O "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
    -max_total_time="$secs" -runs="${RUNS:--1}" -max_len="$(max_len "$t")" -timeout=30 -rss_limit_mb=2048 -detect_leaks=0 \
    -print_final_stats=1 >"$log" 2>&1
  rc=$?
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$log" | tr -s ' \n' ' '
  echo "wall_s: $((SECONDS - start))"
  if [ $rc -ne 0 ]; then
    status=1
    echo "!! $t failed (exit $rc); see $log and fuzz/artifacts/$t/"
    grep -E "^==[0-9]+==|panicked|SUMMARY|ERROR" "$log" | head -5
  fi
done
exit $status
