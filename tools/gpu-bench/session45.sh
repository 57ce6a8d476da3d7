#!/usr/bin/env bash
# Session 45: where a draft training step's time goes on the GPU (DFLASH_PROFILE=1 section
# times after device syncs), at the demo's batch and at larger ones. After stage.sh and
# stage_data.sh (the staged sequences in /root/work/t-staged). Env: PROFILE (1: wall times after
# syncs; gpu: CUDA events, the kernels' own time), STEPS (30 a run), RUNS
# ("BATCH_BLOCKS:BLOCKS_PER_SEQ[:exact] ...", exact: --exact-f32, no TF32), BUDGET_GB (taps held, 2: a short fill); SEQS, DEVICE;
# TRAIN_EXTRA (more `dflash train` flags, e.g. --pack-scores N) with TAG (appended to the log names).
set -uo pipefail
. "$(dirname "$0")/demo-env.sh"
seqs=${SEQS:-/root/work/t-staged/sequences.jsonl}
[ -f "$seqs" ] || { echo "!! stage the data first (stage_data.sh)"; exit 1; }
for run in ${RUNS:-128:16 128:16:exact 512:16 512:64 1024:64}; do
  IFS=: read -r bb bps exact <<< "$run"
  extra=(); [ "$exact" = exact ] && extra=(--exact-f32)
  T0=$SECONDS
  DFLASH_PROFILE=${PROFILE:-1} timeout 150 "$BIN" train --target "$GGUF" --device "${DEVICE:-cuda}" --max-seq 768 --sequences "$seqs" \
    --draft-layers 4 --block-size 16 --steps "${STEPS:-30}" --batch-blocks "$bb" --blocks-per-seq "$bps" \
    --lr 6e-4 --warmup 10 --save-every 0 --seed 0 --example-budget-gb "${BUDGET_GB:-2}" \
    "${extra[@]}" ${TRAIN_EXTRA:-} --out "/root/work/prof-$bb-$bps$exact" > "$R/prof-$bb-$bps$exact${TAG:-}-${PROFILE:-1}.log" 2>&1 ||
    echo "!! $run: $(tail -2 "$R/prof-$bb-$bps$exact${TAG:-}-${PROFILE:-1}.log")"
  echo "== batch $bb blocks, $bps a sequence${exact:+, exact f32}${TRAIN_EXTRA:+, $TRAIN_EXTRA}, profile ${PROFILE:-1} ($((SECONDS - T0)) s in all)"
  python3 - "$R/prof-$bb-$bps$exact${TAG:-}-${PROFILE:-1}.log" <<'PY'
import re, statistics, sys
secs = {}
for line in open(sys.argv[1]):
    last = re.match(r"step +(\d+)/(\d+)", line)
    if last and last[1] == last[2]:
        break  # the held-out loss's forwards follow
    m = re.match(r"profile (train step|draft segments): total ([\d.]+) ms = (.*)", line)
    if not m:
        continue
    d = secs.setdefault(m[1], [])
    d.append({"total": float(m[2]), **{k: float(v) for k, v in (p.rsplit(" ", 1) for p in m[3].split(", "))}})
for what, rows in secs.items():
    rows = rows[5:] or rows  # past the first steps (allocator warm-up)
    keys = list(rows[0])
    print(f"  {what} ({len(rows)} calls, medians ms): " + ", ".join(f"{k} {statistics.median(r.get(k, 0) for r in rows):.1f}" for k in keys))
PY
  grep -E "^step .*/" "$R/prof-$bb-$bps$exact${TAG:-}-${PROFILE:-1}.log" | tail -1
done
