#!/usr/bin/env bash
# Fourth H200 call of session 21 (issue 21, first step): MLX affine weights kept as stored on
# CUDA. (1) tests/fused_cuda.rs affine_kernels_match_the_dequantized_weights and
# mlx_checkpoint_on_the_gpu_runs_as_stored; (2) the Qwen3-8B-shape random target quantized to
# MLX 4-bit g64 (make_mlx.py) against its bf16 original, `dflash bench --micro` (context 128,
# q 1/4/8/16), one run. (Run again after the kernel change
# as TAG=s21e: docs/perf.md "MLX affine 4-bit kept as stored".)
set -uo pipefail
. "$(dirname "$0")/env.sh" dflash fused_cuda
RES=${OUT:-/tmp}/${TAG:-s21d}
M=/root/s20-models
mkdir -p "$RES" "$M"
timeout 150 /tmp/stash/fused_cuda --test-threads 1 --nocapture affine mlx_checkpoint > "$RES/tests.txt" 2>&1
ensure_models "$M"
[ -d "$M/target-mlx4" ] || timeout 200 $PY "$here/make_mlx.py" "$M/target" "$M/target-mlx4" --bits 4 --group 64 > "$RES/make_mlx.log" 2>&1
for t in target target-mlx4 target target-mlx4; do
  timeout 150 /tmp/stash/dflash bench --micro --model "$M/$t" --draft "$M/draft-agree" --device cuda --dtype bf16 \
    --micro-context 128 --micro-q 1,4,8,16 --micro-iters 20 > "$RES/$t.out" 2> "$RES/$t.err" || tail -3 "$RES/$t.err"
  echo "### $t"; grep -E '^\| (verify forward|draft forward)|weights|GB|floor' "$RES/$t.out" | head -12
  grep -iE "mlx affine|memory|weights" "$RES/$t.err" | head -3
done
echo "### tests"; grep -E "^ok |^test |panicked|test result|assert" "$RES/tests.txt" | cut -c1-300 | head -30
tail -2 "$RES/make_mlx.log"; du -sh "$M/target" "$M/target-mlx4"
