#!/usr/bin/env bash
# Session 34, gpt-oss's MXFP4 experts kept as stored on the H200 (issue 21):
# (1) tests/fused_cuda.rs: mxfp4_experts_match_the_dequantized_experts,
#     gpt_oss_mxfp4_checkpoint_on_the_gpu_runs_as_stored, and the MoE / every-family tests the
#     refactor of the expert GEMMs (a weight-source template) touches;
# (2) the gpt-oss-20b layout at 8 of 24 layers (32 experts), MXFP4 against its bf16 twin,
#     `dflash bench --micro` (context 128), alternating, two rounds;
# (3) the gpt-oss-120b layout at its full 36 layers (128 experts, ~65 GB: made in /dev/shm),
#     loaded and timed the same way, with the GPU memory the process held (nvidia-smi).
#   run(command="bash tools/gpu-bench/session34b.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s34b
mkdir -p "$R"
free -g | head -2; df -h /dev/shm / | tail -2
fused_tests tests ${TEST_LIMIT:-100} ${TESTS:-gpt_oss_mxfp4 tiny_dense}
echo "### tests done in $((SECONDS - T0)) s"
M=/dev/shm/m
mkdir -p $M
timeout 150 $PY "$here/make_gpt_oss_mxfp4.py" $M/oss20-mx --published 20b --layers 8 --twin $M/oss20-bf16 \
  > "$R/make20.log" 2>&1 || { echo "make 20b failed"; tail -5 "$R/make20.log"; }
tail -2 "$R/make20.log"
echo "### 20b models done in $((SECONDS - T0)) s"
run_micro() {  # NAME MODEL
  local name=$1 model=$2
  [ $((SECONDS - T0)) -gt ${DEADLINE:-540} ] && { echo "$name: skipped (deadline)"; return; }
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$R/$name.mem" &
  local smi=$!
  timeout 200 /tmp/stash/dflash bench --micro --model "$model" --device cuda --dtype bf16 \
    --micro-context 128 --micro-q 1,4,8,16 --micro-iters 10 --out "$R/$name" > "$R/$name.out" 2> "$R/$name.err" \
    || { echo "$name rc $?"; tail -3 "$R/$name.err"; }
  kill $smi 2>/dev/null
  echo "### $name (peak GPU memory $(sort -n "$R/$name.mem" | tail -1) MiB)"
  grep -E '^\| verify forward|^target weights held|^\| prefill' "$R/$name.out" | head -7
}
for round in 1 2; do
  run_micro oss20-mx-$round $M/oss20-mx
  run_micro oss20-bf16-$round $M/oss20-bf16
done
rm -rf $M/oss20-mx $M/oss20-bf16
df -h /dev/shm | tail -1
timeout 220 $PY "$here/make_gpt_oss_mxfp4.py" $M/oss120 --published 120b > "$R/make120.log" 2>&1 \
  || { echo "make 120b failed rc $?"; tail -3 "$R/make120.log"; }
tail -1 "$R/make120.log"
echo "### 120b made in $((SECONDS - T0)) s"
DEADLINE=590 run_micro oss120-mx $M/oss120
rm -rf $M
echo "done in $((SECONDS - T0)) s"
