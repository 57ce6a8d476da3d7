#!/usr/bin/env bash
# Session 26's second call (issue 20): (1) the skinny-GEMM lab again, its whole output kept
# (skinny.txt in $OUT/s26b.tgz); (2) the family sweep (families.sh) of the MoE families and
# qwen3 with CUDA graphs on (the default now) and DFLASH_TRY=mma_split, each MoE family's micro
# again with graphs off (AB_GRAPHS).
#   run(command="bash tools/gpu-bench/session26b.sh", carry=[".device", "tools/goldens/wheels"], timeout_s=600)
set -uo pipefail
T0=$SECONDS
here=$(cd "$(dirname "$0")" && pwd)
R=/tmp/s26b
mkdir -p $R/lab
xz -dc .device/skinny.xz > /tmp/skinny && chmod +x /tmp/skinny
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
timeout 100 /tmp/skinny 20 > $R/lab/skinny.txt 2>&1
echo "### lab ($((SECONDS - T0)) s)"
grep -E "^\| (dyn-k|router|o 2048|kv 1024)" $R/lab/skinny.txt
grep -E "^(dyn-k|router|o 2048|kv 1024).*(prod w8u2|split)" $R/lab/skinny.txt | awk '{print $1, $2, $3, $4, $5, $6, $7, $(NF-3)}' | head -60
export DFLASH_TRY=mma_split
RES=$R/families FAMILIES="${FAMILIES:-qwen3_moe gpt_oss qwen3_5_moe qwen3_next qwen3}" AB_GRAPHS="${AB_GRAPHS:-qwen3_moe gpt_oss qwen3}" \
  DEADLINE=${DEADLINE:-360} OUT= bash "$here/families.sh"
tar czf ${OUT:-/tmp}/s26b.tgz -C /tmp s26b
echo "done in $((SECONDS - T0)) s"
