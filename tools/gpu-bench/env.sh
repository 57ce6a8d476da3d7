# Sourced by the session scripts of tools/gpu-bench (run on the H200 from the repo root):
# unpacks the named binaries of .device/ into /tmp/stash, points the loader at the CUDA 13
# wheel's libraries and Python at the authors' dflash wheel, and offers `ensure_models DIR`
# (the Qwen3-8B-shape random target + drafts of models.py, made once per machine).
#   . "$(dirname "$0")/env.sh" dflash fused_cuda concurrency
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
PY=${PY:-python3}
mkdir -p /tmp/stash
for b in "$@"; do
  # a call carries at most 64 MiB with the tree: binaries may come in separate calls
  [ -f "$root/.device/$b.xz" ] || { echo "(.device/$b.xz not here: not unpacked)"; continue; }
  mkdir -p "$(dirname "/tmp/stash/$b")"
  xz -dc "$root/.device/$b.xz" > "/tmp/stash/$b" && chmod +x "/tmp/stash/$b"
done
export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$root"/tools/goldens/wheels/dflash-*.whl .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"
ensure_models() {
  [ -d "$1/target" ] || timeout 240 $PY "$here/models.py" --shape qwen3-8b --out "$1" > "$1.log" 2>&1
}
# fused_tests NAME LIMIT [FILTER ...]: tests/fused_cuda.rs (unpacked by this file's caller) over
# families.py's small models (made once per machine in /root/small), LIMIT seconds at most; the
# output to /tmp/NAME.txt and $R/ (when set), the results, passes and panics printed. The
# caller's environment goes with it (e.g. `DFLASH_TRY=all fused_tests trials 150 graphs`).
fused_tests() {
  local name=$1 limit=$2; shift 2
  [ -d /root/small ] || HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 120 $PY "$here/families.py" build \
    --models /root/small --small --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 \
    || { echo "small models: rc $?"; tail -5 /tmp/small.log; }
  DFLASH_FAMILY_MODELS=/root/small timeout "$limit" /tmp/stash/fused_cuda --test-threads=1 --nocapture "$@" \
    > "/tmp/$name.txt" 2>&1 || echo "!! fused_cuda ($name) rc $?"
  grep -E "test result|panicked|FAILED|failed" "/tmp/$name.txt" | cut -c1-150 | head -20
  echo "$(grep -cE '^test .* ok$' "/tmp/$name.txt") ok"
  grep -A8 "panicked" "/tmp/$name.txt" | head -24
  [ -n "${R:-}" ] && cp "/tmp/$name.txt" "$R/"
}
# sweep FAM "TRIAL SETS" [VAR=VALUE ...]: families.sh for one family (A/B over the trial sets
# when given), within BUDGET seconds of T0 (skipped with under 90 s left); its log to
# $R/sweep-FAM.log, its log lines and table rows printed.
sweep() {
  local fam=$1 tries=$2; shift 2
  local left=$((${BUDGET:-570} - (SECONDS - T0)))
  [ $left -lt 90 ] && { echo "$fam: skipped, ${left}s left"; return; }
  env "$@" RES=/tmp/sweep-$fam BIN=/tmp/stash/dflash FAMILIES="$fam" AB_TRY="${tries:+$fam}" TRY="$tries" \
    DEADLINE=$((left - 100)) OUT= bash "$here/families.sh" > "$R/sweep-$fam.log" 2>&1
  grep -E "^\[ *[0-9]+s\] $fam|^\| $fam" "$R/sweep-$fam.log" | cut -c1-330
}
# dflash2_models DIR: ensure_models DIR, then DIR/draft2 (the DFlash draft with the published
# DFlash2 parts, make_dflash2.py); the log to $R/make_dflash2.log when R is set.
dflash2_models() {
  ensure_models "$1" || { echo "models failed"; tail -5 "$1.log"; }
  $PY "$here/make_dflash2.py" "$1/draft-agree" "$1/draft2" > "${R:-/tmp}/make_dflash2.log" 2>&1 \
    || echo "make_dflash2 failed"
}
# draft_step MICRO.md: the median us of the draft proposal in a `bench --micro` report.
draft_step() { grep -h "^| draft forward Q=" "$1" 2>/dev/null | head -n 1 | awk -F'|' '{gsub(/ /,"",$5); print $5}'; }
# ratio A B: A / B to 3 decimals ("?" when either is missing).
ratio() { $PY -c "print(f'{float(\"$1\")/float(\"$2\"):.3f}')" 2>/dev/null || echo "?"; }

# batch_step_profile ERR: the mean ms per section of the `profile batch step` lines (a
# `DFLASH_PROFILE` run of examples/concurrency.rs) over the steps that ran a verify.
batch_step_profile() {
  grep "profile batch step" "$1" | $PY -c '
import sys, re, collections
acc = collections.defaultdict(float); n = 0
for line in sys.stdin:
    parts = dict((m.group(1).strip(), float(m.group(2))) for m in re.finditer(r"([a-z ]+) ([0-9.]+)", line.split("=", 1)[1]))
    if parts.get("verify forward", 0) <= 0: continue
    n += 1
    for k, v in parts.items(): acc[k] += v
print(f"{n} steps: " + ", ".join(f"{k} {v / max(n, 1):.3f}" for k, v in acc.items()))'
}

# begin_session NAME: the results folder $R (NAME under $OUT, which the device tool gives, else
# /tmp) made; the GPU's name and driver printed.
begin_session() {
  R=${OUT:-/tmp}/$1
  mkdir -p "$R"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
}
# The Qwen3-8B-shape models of models.py in $M (made once per machine by qwen3_models, which
# says so when it fails; run it with `&` to overlap the tests), and CONC_ARGS, examples/
# concurrency's arguments over them: the controlled-acceptance draft, prompts of 128 random
# ids, 128 new tokens, T = 1.
M=/root/s20-models
qwen3_models() {
  mkdir -p "$M"
  ensure_models "$M" || { echo "models failed"; tail -5 "$M.log"; return 1; }
}
# A random target at SmolLM2-135M's widths (models.py --shape smollm2-135m --target-only; the
# demo target's batch-step timings, issue 26) in $S, made once per machine by smol_model.
S=/root/smol-shape
smol_model() {
  [ -d $S/target ] || timeout 200 $PY "$here/models.py" --shape smollm2-135m --target-only --out $S > $S.log 2>&1 \
    || { echo "smol model failed"; tail -5 $S.log; return 1; }
}
# smol_session NAME: begin_session NAME with smol_model's target (exits when it fails; says
# when it is there, in seconds since the caller's T0)
smol_session() {
  begin_session "$1"
  smol_model || exit 1
  echo "### model in $((SECONDS - T0)) s"
}
# (for examples/concurrency, which sessions 20-41 carried as .device/concurrency.xz; removed since:
# `dflash bench --concurrency` is the table now, see session41a.sh)
CONC_ARGS="--model $M/target --draft $M/draft-agree --device cuda --dtype bf16 --prompt-len 128 --temperature 1.0 --max-tokens 128"
# tests_and_models NAME LIMIT [FILTER ...]: fused_tests (same arguments) while qwen3_models makes
# the Qwen3-8B-shape models beside it; returns when both are done.
tests_and_models() {
  qwen3_models &
  local mk=$!
  fused_tests "$@"
  wait $mk
}
