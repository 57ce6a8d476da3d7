#!/usr/bin/env bash
# Session 31, second call (issues 22 and 20). (1) the skinny-GEMM and DFlash2 tests of
# tests/fused_cuda.rs (trial narrow16: 16 warps a tile up to 128 tiles; trial conv_epilogue now
# with the preparing form's x and base slabs copied to shared memory by cp.async before the main
# loop), then the engine-level tests with DFLASH_TRY=all (greedy DFlash == plain for every
# family, graphs == eager, verify == decode steps, batched == alone); (2) the draft steps at the
# Qwen3-8B shape (5-layer drafts, published DFlash2 sizes), alternating in each round: DFlash,
# DFlash2, DFlash2 conv_epilogue, DFlash narrow16, DFlash2 narrow16+conv_epilogue.
# (Moved onto env.sh's dflash2_models / draft_step / ratio after the runs; same steps.)
#   run(command="bash tools/gpu-bench/session31b.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s31b
M=/root/gpu-bench-models
mkdir -p "$R" "$M"
fused_tests tests 90 mma conv_epilogue kconv dflash2
DFLASH_TRY=all fused_tests tests-all 150 graphs verify_rows every_family dflash2_draft batched
echo "### tests done in $((SECONDS - T0)) s"
dflash2_models "$M"
echo "### models in $((SECONDS - T0)) s"
common=(bench --micro --model "$M/target" --device cuda --dtype bf16 --micro-context 128 --micro-q 1 --micro-iters 30)
rows=()
round() {  # $1: round
  for v in draft-agree:none draft2:none draft2:conv_epilogue draft-agree:narrow16 draft2:narrow16,conv_epilogue; do
    local d=${v%%:*} t=${v#*:}
    DFLASH_TRY=$t timeout 90 /tmp/stash/dflash "${common[@]}" --draft "$M/$d" --out "$R/m-$d-$t-$1" \
      > "$R/m-$d-$t-$1.log" 2>&1 || { echo "micro $d $t rc $?"; tail -3 "$R/m-$d-$t-$1.log"; }
  done
  local a b c d e
  a=$(draft_step "$R/m-draft-agree-none-$1/micro.md"); b=$(draft_step "$R/m-draft2-none-$1/micro.md")
  c=$(draft_step "$R/m-draft2-conv_epilogue-$1/micro.md"); d=$(draft_step "$R/m-draft-agree-narrow16-$1/micro.md")
  e=$(draft_step "$R/m-draft2-narrow16,conv_epilogue-$1/micro.md")
  rows+=("| $1 | ${a:-?} | ${b:-?} | ${c:-?} | ${d:-?} | ${e:-?} | $(ratio "$b" "$a") | $(ratio "$c" "$a") | $(ratio "$e" "$d") |")
  echo "${rows[-1]}"
}
for r in 1 2 3; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-400} ] && break
  round $r
done
echo "| round | DFlash (us) | DFlash2 | DFlash2 conv_epilogue | DFlash narrow16 | DFlash2 narrow16+conv_epilogue | DFlash2 / DFlash | conv_epilogue / DFlash | both / DFlash narrow16 |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
echo "done in $((SECONDS - T0)) s"
