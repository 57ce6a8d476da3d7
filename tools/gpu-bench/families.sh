#!/usr/bin/env bash
# Family sweep: our engine's `bench --micro` on every supported target family at its published
# widths (random weights, layers reduced on the large models), against each family's HBM floor.
#
# One H200 device call (about 5-7 minutes), from the repo root:
#   run(command="tools/gpu-bench/families.sh", carry=[".device", "tools/goldens/wheels"], timeout_s=600)
# It carries the stripped CUDA binary as .device/dflash.xz (or .device/dflash; see device.sh for
# how it is built) and the authors' `dflash` wheel (tools/goldens/wheels/dflash-*.whl: its
# DFlashDraftModel builds the drafts). It prints, per family, the build timings and the micro
# bench's verify/draft lines, then the table (families_summary.py): plain step ms against its
# floor, verify(4/8/16) against the step and (MoE) against the q-row union floor, the draft
# against the step, and the projected speedup at tau 6.5. Everything (per family: manifest,
# config + tensor list, micro.json, the engine's stdout/stderr, exit status, build log) comes back
# as $OUT/families.tgz; the table also as $OUT/table.md.
#
# Per family: families.py builds the target + draft (on the GPU, bf16, save_pretrained; skipped
# when MODELS/<fam>/manifest.json exists), the engine runs under its own timeout (a crash or a
# hang costs that family only), then the weights are deleted (KEEP_MODELS=0, the default at full
# shape: one family on disk at a time, the largest is deepseek_v3 at ~45 GB). Models go to
# /dev/shm when it has room (no disk writes), else /root/fam-models. Target files (bf16):
# qwen3 16.4 GB, qwen3_5 17.9, qwen3_moe 16.2, qwen3_5_moe 15.5, qwen3_next 27.6, gpt_oss 15.5,
# gemma4 8.7, deepseek_v3 39.8; drafts 1-5.5 GB each: ~180 GB written in all, ~45 GB at a time.
# Budget: no family starts after DEADLINE (430 s); families left are reported as skipped.
# A CPU smoke test of the whole pipeline at tiny widths:
#   SHAPE=tiny DEV=cpu DTYPE=float32 BIN=target/release/dflash PY=/work/pyenv-sweep/bin/python \
#     RAYON_NUM_THREADS=1 tools/gpu-bench/families.sh      # ~40 s on the 2-core box; the engine as built
# Options (env): FAMILIES="qwen3 gpt_oss ..." (default: all 8), RES (default /tmp/families),
# MODELS, KEEP_MODELS, AB_INVARIANT ("fam ...": micro again with DFLASH_BATCH_INVARIANT=0), AB_GRAPHS ("fam ...": again with DFLASH_CUDA_GRAPHS=0), AB_TRY ("fam ...": again with DFLASH_TRY=t for each t of TRY ("prefetch combine prefetch,combine"), then the default again), PROFILE ("fam ..." also timed per section, DFLASH_PROFILE=gpu), CTX (128), QS (1,4,8,16), ITERS (20), FAM_TIMEOUT (engine, s, 120),
# BUILD_TIMEOUT (s, 240), DEADLINE (s after start past which no family starts, 430; the engine
# runs are cut to end by DEADLINE + 60 s),
# DTYPE (bfloat16 | float32 | float16; engine dtype follows), DEV (cuda | cpu), TAU (6.5).
set -u
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"
T0=$SECONDS
SHAPE=${SHAPE:-full}
DEV=${DEV:-cuda}
DTYPE=${DTYPE:-bfloat16}
PY=${PY:-python3}
RES=${RES:-/tmp/families}
FAMILIES=${FAMILIES:-"qwen3 qwen3_5 qwen3_moe qwen3_5_moe qwen3_next gpt_oss gemma4 deepseek_v3"}
CTX=${CTX:-128}
QS=${QS:-1,4,8,16}
ITERS=${ITERS:-20}
FAM_TIMEOUT=${FAM_TIMEOUT:-120}
BUILD_TIMEOUT=${BUILD_TIMEOUT:-240}
DEADLINE=${DEADLINE:-430}
TAU=${TAU:-6.5}
tiny=""
if [ "$SHAPE" = tiny ]; then tiny=--tiny; KEEP_MODELS=${KEEP_MODELS:-1}; else KEEP_MODELS=${KEEP_MODELS:-0}; fi
case $DTYPE in bfloat16) ours=bf16 ;; float32) ours=f32 ;; float16) ours=f16 ;; *) echo "DTYPE $DTYPE?"; exit 2 ;; esac
if [ -z "${MODELS:-}" ]; then
  if [ "$SHAPE" = tiny ]; then MODELS=/tmp/fam-models-tiny
  elif [ "$(df -P -k /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')" -gt $((60 * 1024 * 1024)) ] 2>/dev/null; then
    MODELS=/dev/shm/fam-models
  else MODELS=/root/fam-models; fi
fi
mkdir -p "$RES" "$MODELS"
log() { echo "[$(printf '%4d' $((SECONDS - T0)))s] $*"; }

# The engine binary: BIN, else .device/dflash.xz unpacked, else .device/dflash, else target/release.
if [ -z "${BIN:-}" ]; then
  if [ -f .device/dflash.xz ]; then
    mkdir -p /tmp/fam-bin && xz -dc .device/dflash.xz > /tmp/fam-bin/dflash && chmod +x /tmp/fam-bin/dflash
    BIN=/tmp/fam-bin/dflash
  elif [ -x .device/dflash ]; then BIN=$root/.device/dflash
  else BIN=$root/target/release/dflash; fi
fi
[ -x "$BIN" ] || { echo "no engine binary at $BIN"; exit 2; }
if [ "$DEV" != cpu ]; then
  export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))' 2>/dev/null):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv > "$RES/gpu.txt" 2>&1
  cat "$RES/gpu.txt"
fi
# The authors' package (DFlashDraftModel) on PYTHONPATH.
whl=$(ls "$root"/tools/goldens/wheels/dflash-*.whl 2>/dev/null | head -1)
[ -n "$whl" ] || { echo "no tools/goldens/wheels/dflash-*.whl (python3 -m pip download --no-deps dflash -d tools/goldens/wheels)"; exit 2; }
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$whl" .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1
pyrun() { env OMP_NUM_THREADS=${PY_THREADS:-1} $PY "$@"; }
{ echo "shape $SHAPE dev $DEV dtype $DTYPE bin $BIN models $MODELS keep $KEEP_MODELS"; df -h "$MODELS" /tmp 2>/dev/null; } > "$RES/setup.txt"
log "setup: $(head -1 "$RES/setup.txt")"
log "models dir: $(df -h "$MODELS" | awk 'NR==2 {print $4 " free on " $6}')"

pyrun "$here/families.py" bandwidth --device "$DEV" --out "$RES/bandwidth.json" 2>&1 | grep -v -i warn

for fam in $FAMILIES; do
  d=$RES/$fam
  rm -rf "$d"; mkdir -p "$d"
  left=$((DEADLINE - (SECONDS - T0)))
  if [ $left -lt 20 ]; then echo "skipped: out of time (DEADLINE $DEADLINE s)" > "$d/status"; log "$fam: skipped (out of time)"; continue; fi
  bt=$BUILD_TIMEOUT; [ $bt -gt $left ] && bt=$left
  tb=$SECONDS
  timeout -k 5 $bt env OMP_NUM_THREADS=${PY_THREADS:-1} \
    $PY "$here/families.py" build --models "$MODELS" --only "$fam" $tiny --device "$DEV" --dtype "$DTYPE" > "$d/build.log" 2>&1
  brc=$?
  if [ ! -f "$MODELS/$fam/manifest.json" ]; then
    if grep -q "SKIPPED:" "$d/build.log"; then echo "skipped: $(grep -m1 -o 'SKIPPED:.*' "$d/build.log")" > "$d/status"
    else echo "build failed (rc $brc)" > "$d/status"; fi
    log "$fam: $(cat "$d/status"): $(grep -m1 -iE 'error|failed' "$d/build.log" | cut -c1-200)"
    [ "$KEEP_MODELS" = 0 ] && rm -rf "${MODELS:?}/$fam"  # a build killed by its timeout leaves files
    continue
  fi
  log "$fam: $(grep -E "^$fam: " "$d/build.log" | tail -1 | cut -d' ' -f2-) [build step $((SECONDS - tb))s]"
  cp "$MODELS/$fam/manifest.json" "$d/"
  for part in target draft; do
    mkdir -p "$d/$part"; cp "$MODELS/$fam/$part/config.json" "$MODELS/$fam/$part/tensors.json" "$d/$part/"
  done
  left=$((DEADLINE + 60 - (SECONDS - T0)))
  ft=$FAM_TIMEOUT; [ $ft -gt $left ] && ft=$left; [ $ft -lt 10 ] && ft=10
  tr=$SECONDS
  timeout -k 10 $ft "$BIN" bench --micro --model "$MODELS/$fam/target" --draft "$MODELS/$fam/draft" \
    --device "$DEV" --dtype "$ours" --micro-context "$CTX" --micro-q "$QS" --micro-iters "$ITERS" \
    --out "$d/micro" > "$d/micro.out" 2> "$d/micro.err"
  rc=$?
  echo $rc > "$d/rc"
  if [ $rc = 0 ]; then
    log "$fam: micro ok in $((SECONDS - tr))s: $(grep -E '^\| (verify forward|draft forward)' "$d/micro.out" | awk -F'|' '{sub(/^ *verify forward /,"v",$2); sub(/^ *draft forward /,"draft ",$2); sub(/ *$/,"",$2); printf "%s %.2fms  ", $2, $5/1000}')"
  else
    log "$fam: micro FAILED rc $rc after $((SECONDS - tr))s: $(grep -m1 -iE 'error|panick|failed' "$d/micro.err" | cut -c1-200)"
  fi
  # AB_INVARIANT="fam ...": the same micro with the batch-invariant kernels off (their cost)
  case " ${AB_INVARIANT:-} " in *" $fam "*)
    DFLASH_BATCH_INVARIANT=0 timeout -k 5 60 "$BIN" bench --micro --model "$MODELS/$fam/target" --draft "$MODELS/$fam/draft" \
      --device "$DEV" --dtype "$ours" --micro-context "$CTX" --micro-q 1,16 --micro-iters "$ITERS" --out "$d/micro-noninvariant" \
      > "$d/micro-noninvariant.out" 2>&1
    log "$fam: batch-invariant off: $(grep -E '^\| (verify forward|draft forward)' "$d/micro-noninvariant.out" | awk -F'|' '{sub(/^ *verify forward /,"v",$2); sub(/^ *draft forward /,"draft ",$2); sub(/ *$/,"",$2); printf "%s %.2fms  ", $2, $5/1000}')" ;;
  esac
  # AB_GRAPHS="fam ...": the same micro with CUDA graphs off (what they save)
  case " ${AB_GRAPHS:-} " in *" $fam "*)
    DFLASH_CUDA_GRAPHS=0 timeout -k 5 60 "$BIN" bench --micro --model "$MODELS/$fam/target" --draft "$MODELS/$fam/draft" \
      --device "$DEV" --dtype "$ours" --micro-context "$CTX" --micro-q 1,4,16 --micro-iters "$ITERS" --out "$d/micro-nographs" \
      > "$d/micro-nographs.out" 2>&1
    log "$fam: graphs off: $(grep -E '^\| (verify forward|draft forward)' "$d/micro-nographs.out" | awk -F'|' '{sub(/^ *verify forward /,"v",$2); sub(/^ *draft forward /,"draft ",$2); sub(/ *$/,"",$2); printf "%s %.2fms  ", $2, $5/1000}')"
    log "$fam: graphs on:  $(grep -h 'CUDA graphs' "$d/micro.out")" ;;
  esac
  # AB_TRY="fam ...": the same micro with DFLASH_TRY=t for each trial set t of TRY, then the
  # default again (so the trials sit between two default runs of the same process setup)
  case " ${AB_TRY:-} " in *" $fam "*)
    runs=""
    for t in $TRY; do runs="$runs try-$t:$t"; done
    for run in $runs base2:; do
      tag=${run%%:*}; val=${run#*:}
      DFLASH_TRY=$val timeout -k 5 60 "$BIN" bench --micro --model "$MODELS/$fam/target" --draft "$MODELS/$fam/draft" \
        --device "$DEV" --dtype "$ours" --micro-context "$CTX" --micro-q "$QS" --micro-iters "$ITERS" --out "$d/micro-$tag" \
        > "$d/micro-$tag.out" 2>&1
      log "$fam: $tag (DFLASH_TRY=$val): $(grep -E '^\| (verify forward|draft forward)' "$d/micro-$tag.out" | awk -F'|' '{sub(/^ *verify forward /,"v",$2); sub(/^ *draft forward /,"draft ",$2); sub(/ *$/,"",$2); printf "%s %.3fms  ", $2, $5/1000}')"
    done ;;
  esac
  # PROFILE="fam ...": per-section GPU times (DFLASH_PROFILE=gpu) of a decode step (Q=1 verify)
  case " ${PROFILE:-} " in *" $fam "*)
    DFLASH_PROFILE=gpu timeout -k 5 60 "$BIN" bench --micro --model "$MODELS/$fam/target" --draft "$MODELS/$fam/draft" \
      --device "$DEV" --dtype "$ours" --micro-context "$CTX" --micro-q 1 --micro-iters 10 --out "$d/profile" > "$d/profile.log" 2>&1
    log "$fam: profile (Q=1, ms): $(pyrun "$here/profile_sections.py" "$d/profile.log" 8 3 | tr '\n' ' ')" ;;
  esac
  [ "$KEEP_MODELS" = 0 ] && rm -rf "${MODELS:?}/$fam"
done

log "done; table:"
pyrun "$here/families_summary.py" "$RES" --tau "$TAU"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/families.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
  cp "$RES/table.md" "$OUT/table.md" 2>/dev/null
fi
rm -rf "$refdir"
