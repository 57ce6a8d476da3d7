#!/usr/bin/env bash
# Session 36 (issue 21): MLX MoE checkpoints (mlx-lm's `switch_mlp` expert stacks) with the
# experts kept as stored on CUDA (`ExpertMatrix::Affine`, the `moe_*_mma_af` kernels).
# (1) tests/fused_cuda.rs: the two new tests, and the MoE / MLX / affine / every-family tests
#     the shared kernels/affine.cuh and the MoE source hook touch;
# (2) a Qwen3.5-122B-A10B-shaped MLX 4-bit checkpoint (make_mlx_moe.py, random words; all 48
#     layers, ~68 GB, in /dev/shm): loaded and timed by `dflash bench --micro` (context 128),
#     with the GPU memory the process held (nvidia-smi) and the load report.
#   run(command="bash tools/gpu-bench/session36a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s36a
mkdir -p "$R"
free -g | head -2; df -h /dev/shm / | tail -2
fused_tests tests ${TEST_LIMIT:-200} ${TESTS:-affine_experts mlx_moe mxfp4_experts moe_matches affine_kernels mlx_checkpoint every_family}
echo "### tests done in $((SECONDS - T0)) s"
M=/dev/shm/m
export SPILL_DIR=/root/spill
mkdir -p $M
LAYERS=${LAYERS:-0}
timeout ${MAKE_LIMIT:-240} $PY "$here/make_mlx_moe.py" $M/q122 --published ${PUBLISHED:-122b} --layers $LAYERS \
  > "$R/make122.log" 2>&1 || { echo "make failed rc $?"; tail -5 "$R/make122.log"; }
tail -1 "$R/make122.log"; du -sh $M/q122 2>/dev/null; free -g | sed -n 2p
echo "### made in $((SECONDS - T0)) s"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$R/q122.mem" &
smi=$!
timeout $((590 - (SECONDS - T0))) /tmp/stash/dflash bench --micro --model $M/q122 --device cuda --dtype bf16 \
  --micro-context 128 --micro-q 1,4,8,16 --micro-iters 10 --out "$R/q122" > "$R/q122.out" 2> "$R/q122.err" \
  || { echo "bench rc $?"; tail -5 "$R/q122.err"; }
kill $smi 2>/dev/null
echo "### q122 (peak GPU memory $(sort -n "$R/q122.mem" | tail -1) MiB)"
grep -iE "quantiz|kept|loaded" "$R/q122.err" | head -5
grep -E '^\| verify forward|^target weights held|^\| prefill|floor' "$R/q122.out" | head -8
rm -rf $M $SPILL_DIR
echo "done in $((SECONDS - T0)) s"
