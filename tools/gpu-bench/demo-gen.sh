#!/usr/bin/env bash
# Issue 26: one call of new training data for the demo draft, on a warm machine where
# stage.sh (the GGUF, the prompts) and stage_data.sh (earlier sessions' sequences) ran:
# T1_PASSES sampled passes over PROMPTS (the ShareGPT turns) numbered from T1_FROM, and SYNTH
# of the model's own user turns seeded from SYNTH_SEED, GEN_PROCS processes a pass; then every
# sequence on the machine packed back into $OUT. The gen logs stay off $OUT (a call returns 8
# files: they would crowd the parts out). Seeds must be new each session (docs/training.md
# names the ones used: T = 1 passes 1-5, synth seeds 0 and 100000 by session 50).
#   run(command="T1_FROM=6 SYNTH_SEED=200000 bash tools/gpu-bench/demo-gen.sh")
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
T=$here/demo-train.sh
out=${OUT:-/tmp}
mkdir -p /tmp/gen-logs
export GEN_PROCS=${GEN_PROCS:-4} GEN_BATCH=${GEN_BATCH:-128}
OUT=/tmp/gen-logs PHASE=gen GREEDY=0 SYNTH=0 T1_FROM=${T1_FROM:?T1_FROM: the first new pass number} \
  T1_PASSES=${T1_PASSES:-2} GEN_SECS=${GEN_SECS:-60} \
  PROMPTS=${PROMPTS:-/root/work/prompts/sharegpt-turns-2k4.jsonl.gz} bash "$T"
OUT=/tmp/gen-logs PHASE=gen GREEDY=0 T1_PASSES=0 SYNTH=${SYNTH:-16000} \
  SYNTH_SEED=${SYNTH_SEED:?SYNTH_SEED: a seed no session used} \
  SYNTH_STEERS=${SYNTH_STEERS-|Write a Python function} GEN_SECS_SYNTH=${GEN_SECS_SYNTH:-130} bash "$T"
OUT=$out PHASE=pack bash "$T" | grep -E "sequences|sequences.jsonl.gz"
