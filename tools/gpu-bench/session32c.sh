#!/usr/bin/env bash
# Session 32, issue 21: FP8 block-scaled weights kept as stored on CUDA (kernels/fp8.cu,
# nn::Fp8Weight). (1) tests/fused_cuda.rs: the FP8 kernels bit for bit the bf16 kernel's
# products on the dequantized weights at every blocking, an FP8 checkpoint's logits == its
# dequantized twin's, verify == decode steps, greedy DFlash == plain; the affine / MLX / GGUF
# tests and every family's fused path again (the Linear door gained a variant); (2) the
# Qwen3-8B-shape random target made FP8 (make_fp8.py, 128x128 blocks, LM head bf16) against its
# bf16 original, `dflash bench --micro` (context 128, q 1/4/8/16), alternating.
#   run(command="bash tools/gpu-bench/session32c.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s32c
M=/root/s20-models
mkdir -p "$R" "$M"
fused_tests tests 200 fp8 affine mlx_checkpoint gguf_ every_family
echo "### tests done in $((SECONDS - T0)) s"
ensure_models "$M"
[ -d "$M/target-fp8" ] || timeout 200 $PY "$here/make_fp8.py" "$M/target" "$M/target-fp8" > "$R/make_fp8.log" 2>&1
tail -1 "$R/make_fp8.log"
echo "### models done in $((SECONDS - T0)) s"
for t in target-fp8 target target-fp8 target; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-530} ] && { echo "$t: skipped (deadline)"; continue; }
  timeout 120 /tmp/stash/dflash bench --micro --model "$M/$t" --draft "$M/draft-agree" --device cuda --dtype bf16 \
    --micro-context 128 --micro-q 1,4,8,16 --micro-iters 20 > "$R/$t.out" 2> "$R/$t.err" || tail -3 "$R/$t.err"
  echo "### $t"; grep -E '^\| (verify forward|draft forward)' "$R/$t.out" | head -6
  grep -iE "fp8|weights" "$R/$t.err" | head -2 | cut -c1-200
done
du -sh "$M/target" "$M/target-fp8"
echo "done in $((SECONDS - T0)) s"
