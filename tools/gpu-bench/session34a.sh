#!/usr/bin/env bash
# Session 34's first call (session 33's did not land): session 32's untested work and the MXFP4
# experts' tests on one build. (1) tests/fused_cuda.rs: FP8 (incl. the trial
# fp8_block_scale), affine / MLX / GGUF, every family, verify == decode steps, the MoE tests and
# the two MXFP4 tests; the ignored tiny_dense test of session 32's portable-attention fix.
# (2) The Qwen3-8B-shape FP8 target against bf16: the default FP8 kernel, the trial, bf16,
# `dflash bench --micro` (context 128), one round.
#   run(command="bash tools/gpu-bench/session34a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s34a
M=/root/s20-models
mkdir -p "$R" "$M"
fused_tests tests 240 fp8 affine mlx_checkpoint gguf_ every_family verify_rows moe_matches mxfp4
fused_tests ignored 60 --ignored tiny_dense
echo "### tests done in $((SECONDS - T0)) s"
ensure_models "$M"
[ -d "$M/target-fp8" ] || timeout 200 $PY "$here/make_fp8.py" "$M/target" "$M/target-fp8" > "$R/make_fp8.log" 2>&1
echo "### models done in $((SECONDS - T0)) s"
run_micro() {  # NAME MODEL [VAR=VALUE]
  local name=$1 model=$2; shift 2
  [ $((SECONDS - T0)) -gt ${DEADLINE:-540} ] && { echo "$name: skipped (deadline)"; return; }
  env "$@" timeout 100 /tmp/stash/dflash bench --micro --model "$M/$model" --draft "$M/draft-agree" --device cuda \
    --dtype bf16 --micro-context 128 --micro-q 1,4,8,16 --micro-iters 20 > "$R/$name.out" 2> "$R/$name.err" || tail -3 "$R/$name.err"
  echo "### $name"; grep -E '^\| verify forward|^target weights held' "$R/$name.out" | head -5
}
run_micro fp8 target-fp8
run_micro fp8bs target-fp8 DFLASH_TRY=fp8_block_scale
run_micro bf16 target
run_micro fp8-2 target-fp8
run_micro fp8bs-2 target-fp8 DFLASH_TRY=fp8_block_scale
echo "done in $((SECONDS - T0)) s"
