#!/usr/bin/env bash
# Issue 26, one call and no staging: where a draft training step's time goes at the demo's
# training shape (4-layer draft, 512 blocks a step, 64 a sequence) on a random target of
# SmolLM2-135M's widths (models.py --shape smollm2-135m) and random sequences of the demo
# data's lengths (session 50's 44,960: 346 ids on average, the response from about a third).
# Section medians with syncs (PROFILE=1) at PACKS (`--pack-scores`: the packed forward puts
# a step's 8 sequences in one forward whose scores cover every row over the joint context of
# all 8, ~207 M a layer at 9 heads; one sequence a forward, ~27 M, 7.7x fewer but 8x the
# launches; 2^24 / 2^26: about 2 / 4 sequences a forward), by CUDA events (gpu) at the
# default, then ncu over steps 6-7 at the default (session46b.sh). Session 50's runs:
# 0.167-0.179 s a step (~42k block tokens/s), ~20x what the step's arithmetic needs.
#   run(command="bash tools/gpu-bench/session51a.sh", carry=[".device/dflash.xz", "tools/goldens/wheels"])
# Session 51 ran it with PACKS="default 1" OOM_BEFORE=0 (docs/perf.md). With FUSED (below):
#   run(command="FUSED=training_ops_match_the_cpu FUSED_ONLY=1 bash tools/gpu-bench/session51a.sh",
#       carry=[".device/fused_cuda.xz"]), then at once the profile with carry .device/dflash.xz.
set -uo pipefail
T0=$SECONDS
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh" dflash
# FUSED=<filter>: tests/fused_cuda.rs (carry .device/fused_cuda.xz) on that filter first, e.g.
# FUSED=training_ops_match_the_cpu (session 51's block attention op against the CPU)
if [ -n "${FUSED:-}" ]; then
  xz -dc "$here/../../.device/fused_cuda.xz" > /tmp/stash/fused_cuda && chmod +x /tmp/stash/fused_cuda
  timeout 150 /tmp/stash/fused_cuda --test-threads=1 --nocapture $FUSED > /tmp/fused.txt 2>&1
  echo "### fused_cuda $FUSED: rc $?"
  grep -E "^test |test result" /tmp/fused.txt | head -8
  grep -A8 panicked /tmp/fused.txt | head -16
  # FUSED_ONLY=1: the tests alone (fused_cuda.xz and dflash.xz together with the tree pass
  # the 64 MiB a call carries; carried files stay on a warm machine for the next call)
  [ -n "${FUSED_ONLY:-}" ] && exit 0
fi
smol_session s51a
seqs=/root/rand-seqs.jsonl
$PY - "$seqs" <<'PY'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(4000):
        n = max(64, min(768, int(rng.gauss(346, 150))))
        ids = [rng.randrange(49152) for _ in range(n)]
        f.write(json.dumps({"ids": ids, "response_start": n // 3}) + "\n")
PY
export GGUF=$S/target BIN=/tmp/stash/dflash SEQS=$seqs RUNS=${RUNS:-512:64}
ncu_out=${OUT:-/tmp}; export OUT=/tmp/s51-logs; mkdir -p $OUT
for pack in ${PACKS:-default 1 16777216 67108864 default}; do
  [ $((SECONDS - T0)) -gt 400 ] && { echo "pack $pack: skipped (time)"; continue; }
  extra=""; [ "$pack" = default ] || extra="--pack-scores $pack"
  TRAIN_EXTRA=$extra TAG=-p$pack bash "$here/session45.sh"
done
PROFILE=gpu bash "$here/session45.sh"
OUT=$ncu_out NCU_ONLY=1 NCU_SHAPE=${NCU_SHAPE:-512:64} bash "$here/session46b.sh"
# A budget the card cannot hold beside a 512 : 64 step (session 50's 46 GB on an H100 ran out
# of memory at step 18): `dflash train` now holds a quarter fewer taps and tries the step
# again. 26,000 random sequences make ~52 GB of taps; skipped when time is short.
if [ $((SECONDS - T0)) -lt ${OOM_BEFORE:-430} ]; then
  $PY - /root/rand-big.jsonl <<'PY'
import json, random, sys
rng = random.Random(1)
with open(sys.argv[1], "w") as f:
    for _ in range(26000):
        n = max(64, min(768, int(rng.gauss(346, 150))))
        f.write(json.dumps({"ids": [rng.randrange(49152) for _ in range(n)], "response_start": n // 3}) + "\n")
PY
  timeout 150 $BIN train --target $S/target --device cuda --max-seq 768 --sequences /root/rand-big.jsonl \
    --draft-layers 4 --block-size 16 --steps 40 --batch-blocks 512 --blocks-per-seq 64 --lr 6e-4 --warmup 10 \
    --save-every 0 --seed 0 --example-budget-gb ${OOM_GB:-70} --out /root/work/oom > /tmp/oom.log 2>&1
  echo "### budget ${OOM_GB:-70} GB: rc $?"
  grep -E "fit --example|ran out of memory|^step +40/" /tmp/oom.log | cut -c1-220
fi
echo "### done in $((SECONDS - T0)) s"
