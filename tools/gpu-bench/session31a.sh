#!/usr/bin/env bash
# Session 31, first call (issues 22 and 20). (1) the whole of tests/fused_cuda.rs: the first GPU
# run of dfefc73..HEAD (session 30's last builds were not run there) and the new
# `conv_epilogue_equals_the_product_then_the_convolution` (the DFlash2 finishing convolution in
# the skinny GEMM's epilogue, bit for bit the product then the convolution kernel; the DFlash2
# draft test also runs with it on); (2) the DFlash and the DFlash2 draft step at the Qwen3-8B
# shape (5-layer drafts, published DFlash2 sizes: models.py + make_dflash2.py), alternating in
# each round: DFlash, DFlash2 as default, DFlash2 with DFLASH_TRY=conv_epilogue.
# (Moved onto env.sh's dflash2_models / draft_step / ratio after the runs; same steps.)
#   run(command="bash tools/gpu-bench/session31a.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" dflash fused_cuda
R=${OUT:-/tmp}/s31a
M=/root/gpu-bench-models
mkdir -p "$R" "$M"
fused_tests tests "${TEST_LIMIT:-220}"
echo "### tests done in $((SECONDS - T0)) s"
dflash2_models "$M"
echo "### models in $((SECONDS - T0)) s"
common=(bench --micro --model "$M/target" --device cuda --dtype bf16 --micro-context 128 --micro-q 1 --micro-iters 30)
rows=()
round() {  # $1: round
  for v in draft-agree: draft2: draft2:conv_epilogue; do
    local d=${v%%:*} t=${v#*:}
    DFLASH_TRY=$t timeout 90 /tmp/stash/dflash "${common[@]}" --draft "$M/$d" --out "$R/m-$d-$t-$1" \
      > "$R/m-$d-$t-$1.log" 2>&1 || { echo "micro $d $t rc $?"; tail -3 "$R/m-$d-$t-$1.log"; }
  done
  local a b c
  a=$(draft_step "$R/m-draft-agree--$1/micro.md"); b=$(draft_step "$R/m-draft2--$1/micro.md")
  c=$(draft_step "$R/m-draft2-conv_epilogue-$1/micro.md")
  rows+=("| $1 | ${a:-?} | ${b:-?} | ${c:-?} | $(ratio "$b" "$a") | $(ratio "$c" "$a") |")
  echo "${rows[-1]}"
}
for r in 1 2 3 4; do
  [ $((SECONDS - T0)) -gt ${DEADLINE:-480} ] && break
  round $r
done
grep -h "switches\|try" "$R/m-draft2-conv_epilogue-1/micro.md" 2>/dev/null | head -3
echo "| round | DFlash draft step (us) | DFlash2 (us) | DFlash2, conv_epilogue (us) | DFlash2 / DFlash | conv_epilogue / DFlash |"
echo "|---|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
echo "done in $((SECONDS - T0)) s"
