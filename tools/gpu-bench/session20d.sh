#!/usr/bin/env bash
# Fourth H200 call of session 20: where a batched DFlash step spends its GPU time at c=8,
# and aggregate tok/s by fixed block size (4, 8, 16) at c=1, 8, 32.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p /tmp/stash
for b in concurrency; do xz -dc "$root/.device/$b.xz" > /tmp/stash/$b && chmod +x /tmp/stash/$b; done
PY=python3
RES=${OUT:-/tmp}/s20d
M=/root/s20-models
mkdir -p "$RES" "$M"
export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$root"/tools/goldens/wheels/dflash-*.whl .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"
[ -d "$M/target" ] || timeout 240 $PY "$here/models.py" --shape qwen3-8b --out "$M" > "$RES/models.log" 2>&1
C="/tmp/stash/concurrency --model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0"
DFLASH_PROFILE=gpu timeout 100 $C --block 16 --concurrency 8 --max-tokens 64 --modes dflash > "$RES/prof.md" 2> "$RES/prof.err"
for b in ${BLOCKS:-4 8 16}; do
  timeout 150 $C --block $b --concurrency 1,8,32 --max-tokens 128 --modes dflash > "$RES/block$b.md" 2> "$RES/block$b.err" || tail -3 "$RES/block$b.err"
done
timeout 120 $C --block 16 --concurrency 8 --max-tokens 64 --modes dflash --check > "$RES/check.md" 2> "$RES/check.err"
echo "### check"; tail -n 2 "$RES/check.md"
echo "### profile c=8 dflash block 16 (GPU time)"; $PY "$here/profile_summary.py" "$RES/prof.err" 5
for b in 4 8 16; do echo "### block $b"; grep -E '^\| dflash' "$RES/block$b.md"; done
