#!/usr/bin/env bash
# Third H200 call of session 20: the batched attention (one K/V write + one attention launch
# for every sequence) tests, then concurrency 1 / 8 / 32 for plain and DFlash (controlled-
# acceptance draft, T=1) with greedy batched == alone, and a GPU-time profile at c=8.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p /tmp/stash
for b in dflash fused_cuda concurrency; do
  xz -dc "$root/.device/$b.xz" > /tmp/stash/$b && chmod +x /tmp/stash/$b
done
PY=python3
RES=${OUT:-/tmp}/s20c
M=/root/s20-models
mkdir -p "$RES" "$M"
export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$root"/tools/goldens/wheels/dflash-*.whl .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"
timeout 200 /tmp/stash/fused_cuda --test-threads 1 batched_attention forward_batch attention_layer 2>&1 | grep -E "^test |test result|panicked|assert|left|right" | head -30 > "$RES/fused.txt"
[ -d "$M/target" ] || timeout 240 $PY "$here/models.py" --shape qwen3-8b --out "$M" > "$RES/models.log" 2>&1
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0 --block 16"
timeout 300 $C --concurrency 1,8,32 --max-tokens 128 --check > "$RES/concurrency.md" 2> "$RES/concurrency.err" || tail -5 "$RES/concurrency.err"
DFLASH_PROFILE=gpu timeout 100 $C --concurrency 8 --max-tokens 48 --modes plain > "$RES/prof.md" 2> "$RES/prof.err"
echo "### fused_cuda"; cat "$RES/fused.txt"
echo "### concurrency"; cat "$RES/concurrency.md"
echo "### profile c=8 plain (GPU time)"; $PY "$here/profile_summary.py" "$RES/prof.err" 5
