#!/usr/bin/env bash
# Session 37 (issue 21), first call:
# (1) tests/fused_cuda.rs: the expert-kernel, MXFP4, MLX-MoE and integer-checkpoint tests no
#     GPU has run yet (sessions 34-37), and the MLX / tiny-dense ones their loader changes touch;
# (2) gpt-oss-120b's published layout at its full 36 layers (128 experts, MXFP4 kept as
#     stored; ~65 GB made in /dev/shm, shards past its free space spilled to the disk), loaded
#     and timed by `dflash bench --micro` (context 128) with the GPU memory the process held.
#   run(command="bash tools/gpu-bench/session37a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s37a
mkdir -p "$R"
free -g | head -2; df -h /dev/shm / | tail -2
fused_tests tests ${TEST_LIMIT:-200} ${TESTS:-mxfp4 affine mlx_moe gpt_oss int_checkpoint int4_moe tiny_dense mlx_checkpoint moe_matches}
echo "### tests done in $((SECONDS - T0)) s"
M=/dev/shm/m
export SPILL_DIR=/root/spill
mkdir -p $M
timeout ${MAKE_LIMIT:-260} $PY "$here/make_gpt_oss_mxfp4.py" $M/oss120 --published 120b > "$R/make120.log" 2>&1 \
  || { echo "make 120b failed rc $?"; tail -3 "$R/make120.log"; }
tail -1 "$R/make120.log"; du -shL $M/oss120 2>/dev/null; ls -la $M/oss120 | grep -c -- '->' ; free -g | sed -n 2p
echo "### 120b made in $((SECONDS - T0)) s"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$R/oss120.mem" &
smi=$!
timeout $((585 - (SECONDS - T0))) /tmp/stash/dflash bench --micro --model $M/oss120 --device cuda --dtype bf16 \
  --micro-context 128 --micro-q 1,4,8,16 --micro-iters 10 --out "$R/oss120" > "$R/oss120.out" 2> "$R/oss120.err" \
  || { echo "bench rc $?"; tail -5 "$R/oss120.err"; }
kill $smi 2>/dev/null
echo "### oss120 (peak GPU memory $(sort -n "$R/oss120.mem" | tail -1) MiB)"
grep -iE "quantiz|kept|mxfp4" "$R/oss120.err" | head -4
grep -E '^\| verify forward|^target weights held|^\| prefill|floor' "$R/oss120.out" | head -8
rm -rf $M $SPILL_DIR
echo "done in $((SECONDS - T0)) s"
