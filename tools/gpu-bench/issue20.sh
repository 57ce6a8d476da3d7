#!/usr/bin/env bash
# One H200 device call for issue 20: the CUDA test binary (kernels against the portable path,
# every family's small model through the fused path: parity, verify == decode with rollbacks,
# greedy DFlash == plain), then the family sweep (families.sh) in the time left.
# Prepare here (both binaries stripped and xz'd into the ignored .device/):
#   source ../shared/tools/cuda-env.sh; export CARGO_TARGET_DIR=/work/target-cuda
#   cargo build --release --features cuda -p dflash-cli
#   cargo test --release --features cuda -p dflash --test fused_cuda --no-run
#   strip + xz -3 to .device/dflash.xz and .device/fused_cuda.xz
# Run there from the repo root (carry [".device", "tools/goldens/wheels"]):
#   tools/gpu-bench/issue20.sh            # TESTS=0: sweep only; SWEEP=0: tests only;
#                                         # FAMILIES=..., TEST_FILTER=... pass through
set -u
T0=$SECONDS
mkdir -p /root/stash
for b in dflash fused_cuda; do
  [ -f .device/$b.xz ] && xz -dc .device/$b.xz > /root/stash/$b && chmod +x /root/stash/$b
done
export LD_LIBRARY_PATH=$(python3 -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${TESTS:-1}" = 1 ]; then
  whl=$(ls tools/goldens/wheels/dflash-*.whl | head -1)
  refdir=$(mktemp -d); (cd "$refdir" && python3 -m zipfile -e "$OLDPWD/$whl" .)
  echo "== small family models"
  PYTHONPATH=$refdir HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 \
    python3 tools/gpu-bench/families.py build --models /root/small --small --device cuda --dtype bfloat16 \
    2>&1 | grep -E "^[a-z0-9_]+: " | cut -c1-150
  echo "== fused_cuda tests ($((SECONDS - T0)) s)"
  DFLASH_FAMILY_MODELS=/root/small timeout ${TEST_LIMIT:-300} /root/stash/fused_cuda --test-threads=1 --nocapture ${TEST_FILTER:-} \
    > "$OUT/tests.txt" 2>&1 || echo "!! fused_cuda FAILED (rc $?)"
  grep -E "^test |test result|panicked|^ok [a-z]|families," "$OUT/tests.txt" | grep -v "^ok d " | cut -c1-220 | head -60
  grep -A4 "panicked" "$OUT/tests.txt" | head -40
fi
if [ "${SWEEP:-1}" = 1 ]; then
  left=$(( ${BUDGET:-560} - (SECONDS - T0) ))
  echo "== sweep ($((SECONDS - T0)) s elapsed, deadline $((left - 70)) s)"
  BIN=/root/stash/dflash DEADLINE=$((left - 70)) OUT=$OUT tools/gpu-bench/families.sh 2>&1 | tail -40
fi
echo "== done in $((SECONDS - T0)) s"
