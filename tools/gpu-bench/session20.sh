#!/usr/bin/env bash
# One H200 call for issues 22 and 23: (1) fused_cuda tests (DFlash2 kernels, attention incl.
# the non-causal window bound), (2) DFlash vs DFlash2 draft step at the Qwen3-8B shape, (3)
# aggregate / per-request tok/s at concurrency 1, 8, 32 for plain and DFlash with the
# controlled-acceptance draft at T=1 (examples/concurrency), and greedy batched == alone.
# Binaries: .device/{dflash,fused_cuda,concurrency}.xz; carry [".device", "tools/goldens/wheels"].
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
mkdir -p /tmp/stash
for b in dflash fused_cuda concurrency; do
  xz -dc "$root/.device/$b.xz" > /tmp/stash/$b && chmod +x /tmp/stash/$b
done
PY=python3
RES=${OUT:-/tmp}/s20
M=/root/s20-models
mkdir -p "$RES" "$M"
export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >&2
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$root"/tools/goldens/wheels/dflash-*.whl .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"
if [ -z "${SKIP_TESTS:-}" ]; then
echo "== fused_cuda: dflash2 + attention" >&2
timeout 240 /tmp/stash/fused_cuda --test-threads 1 dflash2 attention forward_batch 2>&1 | tail -n 25 | tee "$RES/fused.txt" >&2
fi
echo "== models" >&2
timeout 240 $PY "$here/models.py" --shape qwen3-8b --out "$M" > "$RES/models.log" 2>&1 || { tail -5 "$RES/models.log" >&2; }
$PY "$here/make_dflash2.py" "$M/draft-agree" "$M/draft2" >&2
echo "== micro DFlash vs DFlash2" >&2
for d in draft-agree draft2; do
  timeout 120 /tmp/stash/dflash bench --micro --model "$M/target" --draft "$M/$d" --device cuda --dtype bf16 \
    --micro-context 128 --micro-q 1 --micro-iters 30 --out "$RES/micro-$d" > "$RES/micro-$d.log" 2>&1 \
    || { echo "micro $d FAILED" >&2; tail -5 "$RES/micro-$d.log" >&2; }
done
echo "== concurrency" >&2
timeout 300 /tmp/stash/concurrency --model "$M/target" --draft "$M/draft-agree" --device cuda --dtype bf16 \
  --concurrency 1,8,32 --max-tokens 128 --prompt-len 128 --temperature 1.0 --block 16 --check \
  > "$RES/concurrency.md" 2> "$RES/concurrency.err" || tail -5 "$RES/concurrency.err" >&2
echo; echo "### fused_cuda"; grep -E "^test |test result" "$RES/fused.txt" | tail -n 12
echo "### draft step"
for d in draft-agree draft2; do echo "$d: $(grep -h '^| draft forward Q=' "$RES/micro-$d/micro.md" 2>/dev/null | head -n 1)"; done
echo "### concurrency"; cat "$RES/concurrency.md"
