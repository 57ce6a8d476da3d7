#!/usr/bin/env bash
# Session 49 (issues 26, 23): the memory pool's release threshold. session49a.sh found a
# c = 256 plain batch step of the SmolLM2-135M-width target at 8-12 ms by CUDA events while
# its kernels sum to 2.4 ms (ncu). The default pool hands freed memory back at every
# synchronization (each step reads its choices), so each step's buffers are mapped again.
# `bench --concurrency 1,64,256` plain with DFLASH_CUDA_POOL_KEEP=0 (CUDA's default) and 1
# (the pool kept, opt-in until measured), one round each; then the c = 256 step sections with the pool
# kept. Also unpacks dflash for the GGUF staging calls (stage.sh).
# Then issue 23's table (session42b.sh: Qwen3-8B shape, controlled-acceptance draft, T = 1,
# block 8, c = 1 / 8 / 32, plain and DFlash) with the pool kept, and once with CUDA's default.
#   run(command="bash tools/gpu-bench/session49b.sh", carry=[".device/dflash.xz", ".device/fused_cuda.xz", ".device/gguf/MANIFEST", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/stage.sh" > /dev/null 2>&1
. "$here/env.sh" dflash fused_cuda
begin_session s49b
echo "### the narrowed (demo-style) draft on CUDA (repo at $root)"
# the test binary finds its fixtures at the build machine's path
[ -d /work/main/crates ] || { mkdir -p /work && ln -sfn "$root" /work/main; }
timeout 120 /tmp/stash/fused_cuda --test-threads=1 --nocapture narrowed_draft > $R/narrowed.txt 2>&1 || echo "!! fused_cuda narrowed rc $?"
grep -hE "narrowed draft on CUDA|test result|panicked" $R/narrowed.txt | cut -c1-200
smol_model
echo "### model in $((SECONDS - T0)) s"
conc=(bench --model $S/target --device cuda --dtype bf16 --concurrency-modes plain --concurrency-prompt-len 150
  --concurrency-rounds 1 --max-tokens 64 --concurrency 64,256)
for round in 1; do
  for keep in 0 1; do
    DFLASH_CUDA_POOL_KEEP=$keep timeout 100 /tmp/stash/dflash "${conc[@]}" > $R/t$round-k$keep.md 2> $R/t$round-k$keep.err || { echo "rc $?"; tail -3 $R/t$round-k$keep.err; }
    echo "### round $round, DFLASH_CUDA_POOL_KEEP=$keep"
    grep -E '^\| plain' $R/t$round-k$keep.md | cut -c1-120
  done
done
DFLASH_PROFILE=gpu timeout 100 /tmp/stash/dflash "${conc[@]}" > $R/prof.md 2> $R/prof.err
grep "profile batch step" $R/prof.err | sed 's/.*verify forward \([0-9.]*\).*/\1/' | grep -v profile | tail -63 \
  | sort -n | awk '{a[NR]=$1; s+=$1} END {print "### pool kept, c = 256 verify forward (GPU events): mean", s/NR, "p50", a[int(NR/2)], "max", a[NR]}'
grep -ho "cuda_pool_keep=[a-z0-9]*" $R/t1-k1.md $R/t1-k0.md
qwen3_models > /dev/null 2>&1
echo "### qwen3-8b models in $((SECONDS - T0)) s"
pair=(--model "$M/target" --draft "$M/draft-agree" --device cuda --dtype bf16)
conc=(bench "${pair[@]}" --concurrency-prompt-len 128 --block-size 8)
timeout 120 /tmp/stash/dflash "${conc[@]}" --concurrency 8 --max-tokens 64 --concurrency-check > "$R/check.md" 2> "$R/check.err"
echo "### greedy c = 8: $(grep -h greedy "$R/check.md" | tr '\n' ' ')"
for keep in ${TABLE_KEEPS:-1 0}; do
  [ $((SECONDS - T0)) -gt ${TABLE_LIMIT:-420} ] && break
  DFLASH_CUDA_POOL_KEEP=$keep timeout 200 /tmp/stash/dflash "${conc[@]}" --concurrency 1,8,32 --max-tokens 128 --temperature 1.0 \
    > "$R/table-k$keep-$SECONDS.md" 2> "$R/table-k$keep.err" || { echo "table rc $?"; tail -3 "$R/table-k$keep.err"; }
  echo "### issue 23 table, DFLASH_CUDA_POOL_KEEP=$keep ($((SECONDS - T0)) s)"
  grep -hE '^\| (plain|dflash)' $(ls -t "$R"/table-k$keep-*.md | head -1) | cut -c1-200
done
echo "### done in $((SECONDS - T0)) s"
