#!/usr/bin/env bash
# H200: the prefix cache's second-turn TTFT and output vs a cold run (issue 23 acceptance 3),
# Qwen3-8B shape, random weights, 2,000-token first turn (examples/prefix_ttft.rs).
# Binaries: .device/prefix_ttft.xz; carry [".device", "tools/goldens/wheels"].
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p /tmp/stash
xz -dc "$root/.device/prefix_ttft.xz" > /tmp/stash/prefix_ttft && chmod +x /tmp/stash/prefix_ttft
PY=python3
RES=${OUT:-/tmp}/prefix
M=/root/s20-models
mkdir -p "$RES" "$M"
export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$root"/tools/goldens/wheels/dflash-*.whl .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"
[ -d "$M/target" ] || timeout 240 $PY "$here/models.py" --shape qwen3-8b --out "$M" > "$RES/models.log" 2>&1
timeout 240 /tmp/stash/prefix_ttft --model "$M/target" --draft "$M/draft-agree" --device cuda --dtype bf16 \
  --prompt-len 2000 --max-tokens 64 --extra 40 2> "$RES/err.txt" || tail -5 "$RES/err.txt"
