#!/usr/bin/env bash
# Session 32, issue 21: MLX 4-bit weights through kernels/affine.cu's new dequantizing path
# (DEQ: bf16(s q + b) in registers, the bf16 kernel's mma straight into the accumulators).
# (1) the affine lab (tools/gpu-bench/skinny/affine_lab.cu: old / new kernels, candidates,
# bf16 at the Qwen3-8B shapes); (2) tests/fused_cuda.rs on every affine test (kernels vs the
# dequantized weights at every blocking, MLX and GGUF checkpoints through the fused path:
# verify == decode steps, greedy DFlash == plain); (3) the Qwen3-8B-shape random target
# quantized to MLX 4-bit g64 against its bf16 original, `dflash bench --micro` (context 128,
# q 1/4/8/16), alternating.
#   run(command="bash tools/gpu-bench/session32b.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", ".device/lab/affine_lab.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda lab/affine_lab
R=${OUT:-/tmp}/s32b
M=/root/s20-models
mkdir -p "$R" "$M"
/tmp/stash/affine_lab 30 > "$R/lab.txt" 2>&1 || echo "!! affine_lab rc $?"
fused_tests tests 150 affine mlx_checkpoint gguf_
echo "### tests done in $((SECONDS - T0)) s"
ensure_models "$M"
[ -d "$M/target-mlx4" ] || timeout 200 $PY "$here/make_mlx.py" "$M/target" "$M/target-mlx4" --bits 4 --group 64 > "$R/make_mlx.log" 2>&1
echo "### models done in $((SECONDS - T0)) s"
for t in target-mlx4 target target-mlx4 target; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-520} ] && { echo "$t: skipped (deadline)"; continue; }
  timeout 120 /tmp/stash/dflash bench --micro --model "$M/$t" --draft "$M/draft-agree" --device cuda --dtype bf16 \
    --micro-context 128 --micro-q 1,4,8,16 --micro-iters 20 > "$R/$t.out" 2> "$R/$t.err" || tail -3 "$R/$t.err"
  echo "### $t"; grep -E '^\| (verify forward|draft forward)' "$R/$t.out" | head -6
  grep -iE "affine|weights" "$R/$t.err" | head -2 | cut -c1-200
done
du -sh "$M/target" "$M/target-mlx4"
echo "### lab"; sed -n '/^| shape/,$p' "$R/lab.txt"
echo "done in $((SECONDS - T0)) s"
