#!/usr/bin/env bash
# Session 46, after the fused training ops (kernels/train.cu): their CUDA test against the CPU
# paths (the fused_cuda test binary carried as .device/fused_cuda.xz), then where a training
# step's time goes now (session45.sh's section medians, wall times; RUNS) and ncu over steps 6
# and 7 at NCU_SHAPE (BATCH:BPS, 128:16; NCU=0: no ncu). Needs stage.sh's dflash and GGUF and data in /root/work/t0.
set -uo pipefail
. "$(dirname "$0")/demo-env.sh"
W=/root/work
mkdir -p "$W/logs"
if [ -f .device/fused_cuda.xz ]; then
  xz -dc .device/fused_cuda.xz > /root/stash/fused_cuda && chmod +x /root/stash/fused_cuda
  /root/stash/fused_cuda training_ops 2>&1 | grep -E "^test |test result|panicked|assert" | head -8
fi
export SEQS=${SEQS:-$W/t0/sequences.jsonl}
# NCU_ONLY=1: the ncu part alone
[ "${NCU_ONLY:-0}" = 1 ] || RUNS=${RUNS:-128:16 512:64 1024:64} OUT=$W/logs PROFILE=1 bash tools/gpu-bench/session45.sh
[ "${NCU:-1}" = 0 ] && exit 0
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
IFS=: read -r nb nbps <<< "${NCU_SHAPE:-128:16}"
echo "== ncu: training steps 6 and 7, batch $nb blocks, $nbps a sequence"
DFLASH_PROFILE=ncu-train timeout 200 "$NCU" --profile-from-start off --clock-control none \
  --metrics gpu__time_duration.sum --csv --page raw \
  "$BIN" train --target "$GGUF" --device cuda --max-seq 768 --sequences "$SEQS" \
  --draft-layers 4 --block-size 16 --steps 8 --batch-blocks "$nb" --blocks-per-seq "$nbps" \
  --lr 6e-4 --warmup 10 --save-every 0 --seed 0 --example-budget-gb 2 --out "$W/prof-ncu" \
  > "$R/ncu-train.csv" 2> "$W/logs/ncu-train.err" || { echo "ncu rc $?"; tail -3 "$W/logs/ncu-train.err"; }
python3 tools/gpu-bench/ncu_summary.py "$R/ncu-train.csv" | head -25
