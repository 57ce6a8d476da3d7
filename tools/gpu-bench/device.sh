#!/usr/bin/env bash
# One H200 device call (issue 8): the CUDA parity tests, the Qwen3-8B-shape bench (run.sh: micro
# in both modes + end to end, + the reference with SKIP_REF=0), then per-section GPU profiles
# (DFLASH_PROFILE=gpu) of verify(16) and the draft at contexts 128 and 2048.
# Prepare here (ignored folder .device/, carried with the call):
#   source ../shared/tools/cuda-env.sh
#   CARGO_TARGET_DIR=/work/target-cuda cargo build --release --features cuda -p dflash-cli
#   CARGO_TARGET_DIR=/work/target-cuda cargo test --release --features cuda -p dflash --test fused_cuda --no-run
#   strip both binaries; xz -9e them to .device/dflash.xz and .device/fused_cuda.xz (a call
#   carries at most 64 MiB with the tracked tree's ~41 MB: at xz -3 the two no longer fit)
# Run there from the repo root: SKIP_REF=0 tools/gpu-bench/device.sh (PROFILES=0: no profiles)
# (carry [".device", "tools/goldens/wheels"]); results come back as $OUT/gb.tgz.
set -u
mkdir -p /root/stash /tmp/gb
for b in dflash fused_cuda; do xz -dc .device/$b.xz > /root/stash/$b && chmod +x /root/stash/$b; done
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
echo "== fused_cuda tests"
/root/stash/fused_cuda --test-threads=1 > /tmp/gb/tests.txt 2>&1 || echo "!! fused_cuda FAILED"
grep -E "^test |test result|panicked|assert" /tmp/gb/tests.txt | head -30
timeout ${RUN_LIMIT:-450} env BIN=/root/stash/dflash RES=/tmp/gb SKIP_REF=${SKIP_REF:-1} REPEAT=${REPEAT:-1} AB_MMA=1 SKIP_PROBE=1 SKIP_E2E=${SKIP_E2E:-0} tools/gpu-bench/run.sh > /tmp/gb/run.out 2> /tmp/gb/run.err
grep -i "error\|fail\|panic" /tmp/gb/run.err | head -20
echo "== table"; cat /tmp/gb/run.out
M=/root/gpu-bench-models
[ "${PROFILES:-1}" = 1 ] && for ctx in 128 2048; do for q in 16; do
  DFLASH_PROFILE=gpu timeout 60 /root/stash/dflash bench --micro --model $M/target --draft $M/draft-agree \
    --device cuda --dtype bf16 --micro-context $ctx --micro-q $q --micro-iters 30 --out /tmp/gb/p-$ctx-$q > /tmp/gb/p-$ctx-$q.log 2>&1
  echo "== profile ctx=$ctx q=$q"; grep -E "^\| (verify|draft)" /tmp/gb/p-$ctx-$q.log | cut -d'|' -f2,5
  python3 tools/gpu-bench/profile_sections.py /tmp/gb/p-$ctx-$q.log 9 3
done; done
tar czf $OUT/gb.tgz -C /tmp gb
