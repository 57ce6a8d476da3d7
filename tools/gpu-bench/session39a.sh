#!/usr/bin/env bash
# Session 39: where a batched DFlash step goes, kernel by kernel. Qwen3-8B shape, the
# controlled-acceptance draft, T = 1, block 8, c = 32 DFlash (and c = 32 plain for contrast)
# through examples/concurrency under nsys (kernel time and launch count by kernel name, CUDA
# API time by call), so the per-sequence launches of the batched draft and verify show.
#   run(command="bash tools/gpu-bench/session39a.sh", carry=[".device/concurrency.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" concurrency
R=${OUT:-/tmp}/s39a
mkdir -p "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
M=/root/s20-models
mkdir -p $M
ensure_models "$M" || { echo "models failed"; tail -5 "$M.log"; }
echo "### models in $((SECONDS - T0)) s"
NSYS=$(command -v nsys || ls /opt/nvidia/nsight-systems/*/bin/nsys /usr/local/cuda*/bin/nsys 2>/dev/null | head -1)
echo "nsys: ${NSYS:-none}"
args="--model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0 --max-tokens 128 --block 8 --concurrency 32"
for mode in dflash plain; do
  if [ -n "$NSYS" ]; then
    timeout 200 "$NSYS" profile -t cuda -o "$R/$mode" -f true /tmp/stash/concurrency $args --modes $mode > "$R/$mode.md" 2> "$R/$mode.err"
    "$NSYS" stats -r cuda_gpu_kern_sum,cuda_api_sum -f csv -o "$R/$mode" "$R/$mode.nsys-rep" > /dev/null 2>&1
    echo "### $mode c=32: $(grep -E '^\| ' "$R/$mode.md" | tail -1)"
    $PY - "$R/${mode}_cuda_gpu_kern_sum.csv" "$R/${mode}_cuda_api_sum.csv" <<'PY'
import csv, sys
for f, top in ((sys.argv[1], 22), (sys.argv[2], 8)):
    try:
        rows = list(csv.DictReader(open(f)))
    except Exception as e:
        print("no", f, e); continue
    tot = sum(float(r["Total Time (ns)"]) for r in rows)
    print(f"{f.split('/')[-1]}: total {tot/1e6:.1f} ms")
    for r in rows[:top]:
        print(f'{float(r["Total Time (ns)"])/1e6:9.1f} ms {int(r["Instances"]):8d} x {float(r["Avg (ns)"])/1e3:8.1f} us  {r["Name"][:90]}')
PY
  else
    DFLASH_PROFILE=gpu timeout 60 /tmp/stash/concurrency $args --modes $mode > "$R/$mode.md" 2> "$R/$mode.err"
    echo "### $mode (no nsys): $(batch_step_profile "$R/$mode.err")"
  fi
  [ $((SECONDS - T0)) -gt 450 ] && break
done
rm -f "$R"/*.nsys-rep "$R"/*.sqlite
echo "### done in $((SECONDS - T0)) s"
