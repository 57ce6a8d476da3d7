#!/usr/bin/env bash
# Issue 22 on one H200 call: the DFlash2 CUDA tests (fused_cuda: kernels vs portable, a DFlash2
# draft on the device greedy == plain), then the draft step of a DFlash and a DFlash2 draft of
# the same width (Qwen3-8B shape, random weights, 5 layers, published DFlash2 sizes) side by
# side in one run. Prepare the binaries as for issue20.sh (.device/dflash.xz and
# .device/fused_cuda.xz, carry [".device", "tools/goldens/wheels"]); run from the repo root:
#   tools/gpu-bench/dflash2.sh
#   SHAPE=tiny DEV=cpu DTYPE=float32 BIN=target/release/dflash PY=/work/pyenv-sweep/bin/python \
#     tools/gpu-bench/dflash2.sh          # CPU smoke test of the pipeline
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p /tmp/stash
for b in dflash fused_cuda; do
  [ -f "$root/.device/$b.xz" ] && xz -dc "$root/.device/$b.xz" > /tmp/stash/$b && chmod +x /tmp/stash/$b
done
BIN=${BIN:-/tmp/stash/dflash}
PY=${PY:-python3}
RES=${RES:-${OUT:-/tmp}/gpu-bench}
MODELS=${MODELS:-/root/gpu-bench-models}
SHAPE=${SHAPE:-qwen3-8b}
DEV=${DEV:-cuda}
DTYPE=${DTYPE:-bfloat16}
case $DTYPE in bfloat16) ours=bf16 ;; *) ours=f32 ;; esac
mkdir -p "$RES" "$MODELS"
[ "$DEV" = cpu ] || export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
if [ -x /tmp/stash/fused_cuda ]; then
  echo "== fused_cuda: dflash2 + attention" >&2
  /tmp/stash/fused_cuda --test-threads 1 dflash2 attention_layer 2>&1 | tail -n 20 | tee "$RES/fused_dflash2.txt" >&2 || true
fi
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$root"/tools/goldens/wheels/dflash-*.whl .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"
$PY "$here/reference.py" --models-only --shape "$SHAPE" --models "$MODELS" --out "$RES" --device "$DEV" \
  --dtype "$DTYPE" --max-new 16 --repeat 1 > "$RES/reference.log" 2>&1
$PY "$here/make_dflash2.py" "$MODELS/draft-agree" "$MODELS/draft2" >&2
for d in draft-agree draft2; do
  for rep in 1 2; do
    "$BIN" bench --micro --model "$MODELS/target" --draft "$MODELS/$d" --device "$DEV" --dtype "$ours" \
      --micro-context 128 --micro-q 1 --micro-iters 30 --out "$RES/micro-$d-$rep" > "$RES/micro-$d-$rep.log" 2>&1 \
      || echo "micro $d FAILED" >&2
  done
done
med() { grep -h "^| draft forward Q=" "$RES/micro-$1-$2/micro.md" | head -n 1 | awk -F'|' '{gsub(/ /,"",$5); print $5}'; }
echo "| run | DFlash draft step (median us) | DFlash2 draft step (median us) | DFlash2 / DFlash |"
echo "|---|---:|---:|---:|"
for rep in 1 2; do
  a=$(med draft-agree $rep); b=$(med draft2 $rep)
  r=$($PY -c "print(f'{float(\"$b\")/float(\"$a\"):.3f}')" 2>/dev/null || echo "?")
  echo "| $rep | ${a:-?} | ${b:-?} | $r |"
done
