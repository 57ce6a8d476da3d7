#!/usr/bin/env bash
# Session 38 (issues 21, 23), first call with this session's binaries:
# (1) tests/fused_cuda.rs: the affine-expert test with its corrected bound (the tensor cores'
#     rounding, not bit equality), and the MoE checkpoint tests over affine stacks;
# (2) issue 23 on today's build (graphs, merged attention splits, f32 head logits since the
#     last measurement in session 21): Qwen3-8B shape, controlled-acceptance draft, T = 1,
#     c = 1 / 8 / 32, plain and DFlash (block 8, block 16, the adaptive policy);
# (3) where a c = 32 DFlash cycle goes: `DFLASH_PROFILE=1` (wall per section, device synced)
#     and `DFLASH_PROFILE=gpu` (kernel time per section) over the batch steps.
#   run(command="bash tools/gpu-bench/session38a.sh", carry=[".device/fused_cuda.xz", ".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda concurrency
R=${OUT:-/tmp}/s38a
mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=/root/s20-models
mkdir -p $M
ensure_models "$M" &
mk=$!
fused_tests tests ${TEST_LIMIT:-150} ${TESTS:-affine_experts int4_moe mlx_moe}
wait $mk || { echo "models failed"; tail -5 "$M.log"; }
echo "### tests + models in $((SECONDS - T0)) s"
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0 --max-tokens 128"
timeout 150 $C --block 8 --concurrency 1,8,32 --modes plain,dflash > "$R/block8.md" 2> "$R/block8.err"
echo "### block 8 in $((SECONDS - T0)) s"; grep -E '^\| (plain|dflash)' "$R/block8.md"
timeout 90 $C --block 16 --concurrency 1,8,32 --modes dflash > "$R/block16.md" 2> "$R/block16.err"
echo "### block 16 in $((SECONDS - T0)) s"; grep -E '^\| dflash' "$R/block16.md"
timeout 90 $C --concurrency 1,8,32 --modes dflash > "$R/adaptive.md" 2> "$R/adaptive.err"
echo "### adaptive in $((SECONDS - T0)) s"; grep -E '^\| dflash' "$R/adaptive.md"
for p in 1 gpu; do
  DFLASH_PROFILE=$p timeout 60 $C --block 8 --concurrency 32 --modes dflash > "$R/prof-$p.md" 2> "$R/prof-$p.err"
  echo "### DFLASH_PROFILE=$p, c=32 block 8 (mean ms per batch step over steps with a verify)"
  grep "profile batch step" "$R/prof-$p.err" | $PY -c '
import sys, re, collections
acc = collections.defaultdict(float); n = 0
for line in sys.stdin:
    parts = dict((m.group(1).strip(), float(m.group(2))) for m in re.finditer(r"([a-z ]+) ([0-9.]+)", line.split("=", 1)[1]))
    if parts.get("verify forward", 0) <= 0: continue
    n += 1
    for k, v in parts.items(): acc[k] += v
print(f"{n} steps: " + ", ".join(f"{k} {v / max(n, 1):.3f}" for k, v in acc.items()))'
done
echo "### done in $((SECONDS - T0)) s"
