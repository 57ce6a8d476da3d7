#!/usr/bin/env bash
# The demo draft on this machine's CPU, every figure from `dflash bench` (baseline and DFlash
# alternating per repeat, medians), for issues 9 and 10:
#   - the trained demo draft (models/smollm2-135m-dflash) on held-out HumanEval and MT-Bench
#     first turns, T = 0 at fixed block sizes 2/4/8/16 and adaptive, T = 1 at block 16 and
#     adaptive: tau, acceptance, tok/s, speedup;
#   - a random (useless) draft of the same shape, adaptive, against plain decoding.
# From the repo root, after `cargo build --release`:
#   tools/eval-demo/run.sh            # ~25 min on 2 cores; then the table (summary.py)
# Env: BIN, MODEL, DRAFT, OUT, LIMIT (prompts per set, 5), MAXTOK (128), REPEAT (2),
#      SETS ("humaneval mtbench"), BLOCKS ("2 4 8 16"), SKIP_T1=1, SKIP_RANDOM=1.
# Nothing else should run on the machine meanwhile (candle's thread pool spins).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
BIN=${BIN:-target/release/dflash}
MODEL=${MODEL:-$HOME/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf}
DRAFT=${DRAFT:-models/smollm2-135m-dflash}
OUT=${OUT:-bench-results/eval-demo}
LIMIT=${LIMIT:-5}
MAXTOK=${MAXTOK:-128}
REPEAT=${REPEAT:-2}
SETS=${SETS:-humaneval mtbench}
BLOCKS=${BLOCKS-2 4 8 16}   # BLOCKS="" runs no fixed-block rows
mkdir -p "$OUT"
common=(--model "$MODEL" --limit "$LIMIT" --max-tokens "$MAXTOK" --repeat "$REPEAT" --cooldown 1 --warmup 1 --quiet)
run() { # name, extra args...
  local name=$1; shift
  echo "== $name: $*" >&2
  "$BIN" bench "${common[@]}" "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1 || echo "!! $name failed (see $OUT/$name.log)" >&2
}
if [ "${SKIP_RANDOM:-0}" != 1 ]; then
  [ -d "$OUT/random-draft" ] || cargo run --release -q --example random_draft -p dflash -- "$OUT/random-draft" 576 49152 30 1 16
  for ds in $SETS; do
    run "random-$ds-adaptive" --draft "$OUT/random-draft" --dataset "$ds"
  done
fi
for ds in $SETS; do
  for b in $BLOCKS; do
    run "t0-$ds-b$b" --draft "$DRAFT" --dataset "$ds" --block-size "$b"
  done
  run "t0-$ds-adaptive" --draft "$DRAFT" --dataset "$ds"
  if [ "${SKIP_T1:-0}" != 1 ]; then
    run "t1-$ds-b16" --draft "$DRAFT" --dataset "$ds" --block-size 16 --temperature 1 --seed 1
    run "t1-$ds-adaptive" --draft "$DRAFT" --dataset "$ds" --temperature 1 --seed 1
  fi
done
python3 "$root/tools/eval-demo/summary.py" "$OUT"
