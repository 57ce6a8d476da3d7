#!/usr/bin/env bash
# The demo model on the H200 (issue 9): train a draft (TRAIN=1) and/or time drafts with
# `dflash bench` (BENCH=1) on held-out HumanEval and MT-Bench first turns. The GPU machine has no
# network, so the target GGUF comes along in parts (see docs/training.md, "On an H200") and the
# prompt sets from data/. From the repo root on the GPU machine:
#   GGUF=/root/stash/SmolLM2-135M-Instruct.Q4_1.gguf BIN=/root/stash/dflash TRAIN=1 tools/eval-demo/gpu.sh
#   GGUF=... BIN=... BENCH=1 DRAFTS="models/smollm2-135m-dflash $OUT/new-draft" tools/eval-demo/gpu.sh
# Env: OUT (results), LIMIT (prompts per set, 10), MAXTOK (128), REPEAT (2), TRAIN_SECS (360),
#      ROWS (bench rows: t0-bN, t1-bN, t0-adaptive, t1-adaptive),
#      TRAIN_DATA (prompt files), BATCH (blocks per step, 128), STEPS (20000, cut to TRAIN_SECS).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
BIN=${BIN:-.device/dflash}
GGUF=${GGUF:?GGUF=path of SmolLM2-135M-Instruct.Q4_1.gguf}
OUT=${OUT:-/tmp/eval-gpu}
LIMIT=${LIMIT:-10}
MAXTOK=${MAXTOK:-128}
REPEAT=${REPEAT:-2}
mkdir -p "$OUT"
gunzip -c data/eval/HumanEval.jsonl.gz > "$OUT/humaneval.jsonl"
gunzip -c data/eval/mt_bench_question.jsonl.gz > "$OUT/mtbench.jsonl"

if [ "${TRAIN:-0}" = 1 ]; then
  TRAIN_DATA=${TRAIN_DATA:-data/train/sharegpt-train-3k.jsonl.gz}
  echo "== train ($TRAIN_DATA)" >&2
  # shellcheck disable=SC2086
  "$BIN" train --target "$GGUF" --device "${DEVICE:-cuda}" --prompts $TRAIN_DATA --data relabel \
    --max-prompts 20000 --max-seq 768 --data-time-limit 120 --draft-layers 2 --block-size 16 \
    --steps "${STEPS:-20000}" --batch-blocks "${BATCH:-128}" --blocks-per-seq 16 \
    --lr "${LR:-8e-4}" --warmup 200 --time-limit "${TRAIN_SECS:-360}" --save-every 0 --seed 0 \
    --out "$OUT/new-draft" \
    --eval-prompts data/eval/HumanEval.jsonl.gz data/eval/mt_bench_question.jsonl.gz \
    --eval-n 10 --eval-max-tokens 128 2>&1 | tail -n 40 | tee "$OUT/train.log" >&2
fi

if [ "${BENCH:-0}" = 1 ]; then
  # the table is this run's rows only: an earlier run's rows in OUT (other ROWS, an older
  # draft) would be summarized beside them (session 47's second eval showed stale ones)
  rm -rf "$OUT"/*-t0-* "$OUT"/*-t1-*
  for d in ${DRAFTS:-models/smollm2-135m-dflash}; do
    tag=$(basename "$d")
    for ds in humaneval mtbench; do
      common=(--model "$GGUF" --draft "$d" --prompts "$OUT/$ds.jsonl" --limit "$LIMIT"
        --max-tokens "$MAXTOK" --repeat "$REPEAT" --cooldown 0 --warmup 1 --quiet --device "${DEVICE:-cuda}")
      for row in ${ROWS:-t0-b16 t0-b4 t0-adaptive t1-b16 t1-adaptive}; do
        case $row in
          t0-b*) spec="--block-size ${row#t0-b}" ;;
          t1-b*) spec="--block-size ${row#t1-b} --temperature 1 --seed 1" ;;
          t0-adaptive) spec="" ;;
          t1-adaptive) spec="--temperature 1 --seed 1" ;;
          *) echo "!! unknown row $row" >&2; continue ;;
        esac
        name="$tag-$row-$ds"
        echo "== $name" >&2
        # shellcheck disable=SC2086
        "$BIN" bench "${common[@]}" $spec --out "$OUT/$name" > "$OUT/$name.log" 2>&1 ||
          echo "!! $name failed: $(tail -n 3 "$OUT/$name.log")" >&2
      done
    done
  done
  python3 tools/eval-demo/summary.py "$OUT"
fi
