#!/usr/bin/env bash
# Issue 26 on the GPU machine: the demo draft trained on SmolLM2's own answers. Needs the demo
# GGUF and the CUDA dflash staged first (tools/train/stage_gguf.sh here, then
# tools/gpu-bench/stage.sh there, one call per part, the last with .device/dflash.xz), all on
# the same warm machine. Then one call per phase (each well under 10 minutes):
#   PHASE=gen   bash tools/gpu-bench/demo-train.sh   # greedy + T = 1 responses (data only; again
#                                                    # with a higher T1_PASSES adds sampled passes)
#   PHASE=pack  bash tools/gpu-bench/demo-train.sh   # the data back in parts (for a later session)
#   PHASE=train bash tools/gpu-bench/demo-train.sh   # first chunk (resumable)
#   PHASE=more  bash tools/gpu-bench/demo-train.sh   # further chunks (--resume)
#   PHASE=eval  bash tools/gpu-bench/demo-train.sh   # held-out tau / speedup per block, draft to $OUT
# Env: GEN_SECS (per pass, 200), SYNTH / SYNTH_STEERS / SYNTH_T / SYNTH_SEED / GEN_SECS_SYNTH (user turns the model writes itself, below), GEN_SECS_T0 (the greedy pass's, GEN_SECS), T1_PASSES (sampled passes, 1), T1_FROM (first pass's number, 1), GREEDY (1), GEN_BATCH (64, a process), GEN_PROCS (processes a pass, 1), MAX_NEW (256), PROMPTS (prompt
# files, space-separated; default the 9,669 ShareGPT first turns; data/train/humaneval-rest.jsonl.gz and
# mtbench-rest.jsonl.gz add the HumanEval / MT-Bench prompts past the 40 held for evaluation, each 16 times), LAYERS (4), STEPS (schedule, 30000), CHUNK (training seconds a call,
# 480), TIME_LIMIT (fit the schedule to it), ROWS / REPEAT / LIMIT (eval rows, repeats, prompts a set), INIT (a draft to train on from), BATCH (blocks a step, 128), BPS (blocks a sequence, 16), LR (6e-4), BUDGET_GB (taps held; default the GPU's memory less 45 GB, which a 512 : 64 step and the target need: 35 on an H100, ~95 on an H200, 12 without nvidia-smi; 46 ran out of memory on an H100 in session 50; their target passes run before the first step, 32 sequences a batch), TRAIN_EXTRA (more `dflash train` flags for the train phases); BIN, GGUF, WORK, DEVICE
# to run it elsewhere (e.g. a smoke run on the CPU).
set -uo pipefail
. "$(dirname "$0")/demo-env.sh"
W=${WORK:-/root/work}
mkdir -p "$W" "$R"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null
# the taps the trainer holds: the GPU's memory less what a 512-block step and the target take
if [ -z "${BUDGET_GB:-}" ]; then
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  BUDGET_GB=12; [ -n "$mib" ] && BUDGET_GB=$(( mib / 1024 - 45 )) && [ "$BUDGET_GB" -lt 2 ] && BUDGET_GB=2
fi
common=(--target "$GGUF" --device "${DEVICE:-cuda}" --max-seq 768)
draft=(--draft-layers "${LAYERS:-4}" --block-size 16 --steps "${STEPS:-30000}" --batch-blocks "${BATCH:-128}"
  --blocks-per-seq "${BPS:-16}" --lr "${LR:-6e-4}" --warmup 300 --save-every 500 --seed 0 --example-budget-gb "$BUDGET_GB")
seqs=("$W"/t*/sequences.jsonl)
case ${PHASE:?PHASE=gen|pack|train|more|eval} in
  gen)
    # greedy once (GREEDY=0: not), then T1_PASSES sampled passes numbered from T1_FROM (1;
    # record i of pass k seeded k * 100000 + i, so passes staged from an earlier session are
    # not made again by starting past them). GEN_PROCS=N (1) runs each pass as N processes
    # on the one GPU (`--gen-shard K/N`: records K mod N, whole-run seeds; a batch step of the
    # 135M target is host-bound), into RUN-sK
    from=${T1_FROM:-1}; procs=${GEN_PROCS:-1}
    [ "${GREEDY:-1}" = 0 ] && runs="" || runs=t0
    for run in $runs $(seq -f 't1-%g' "$from" $((from + ${T1_PASSES:-1} - 1))); do
      T0=$SECONDS
      case $run in t0) t=0 seed=0 secs=${GEN_SECS_T0:-${GEN_SECS:-200}} ;; *) t=1 seed=$((${run#t1-} * 100000)) secs=${GEN_SECS:-200} ;; esac
      for k in $(seq 0 $((procs - 1))); do
        out=$run; [ "$procs" -gt 1 ] && out=$run-s$k
        # shellcheck disable=SC2086
        "$BIN" train "${common[@]}" --prompts ${PROMPTS:-data/train/sharegpt-prompts-9k.jsonl.gz} \
          --max-prompts 100000 --data self --temperature $t --seed $seed --gen-shard "$k/$procs" \
          --exclude-prompts data/eval/humaneval-held.jsonl.gz data/eval/mtbench-held.jsonl.gz \
          --gen-batch "${GEN_BATCH:-64}" --max-new "${MAX_NEW:-256}" --data-time-limit "$secs" \
          --data-only --out "$W/$out" > "$R/gen-$out.log" 2>&1 || { echo "!! gen $out"; tail -3 "$R/gen-$out.log"; } &
      done
      wait
      for f in "$R"/gen-"$run".log "$R"/gen-"$run"-s*.log; do
        [ -f "$f" ] && echo "$(basename "$f" .log): $(grep -o '[0-9]* sequences ([0-9]* tokens[^)]*)' "$f")"
      done
      echo "$run: $((SECONDS - T0)) s"
    done
    # SYNTH=N: N more user turns sampled from the model itself (`--synth-prompts`; steered by
    # SYNTH_STEERS, '|'-separated; a leading '|' adds an unsteered one), answered at SYNTH_T (0) within
    # GEN_SECS_SYNTH (GEN_SECS); the run is ts-SYNTH_SEED (0: turn i seeded 2^32 + i); with
    # GEN_PROCS=N, N processes of SYNTH / N turns each, process K's turns and answers seeded
    # apart (K * 10^7 added), into ts-SYNTH_SEED-sK
    if [ "${SYNTH:-0}" -gt 0 ]; then
      T0=$SECONDS; steer=()
      IFS='|' read -r -a steers <<< "${SYNTH_STEERS:-}"
      for s in "${steers[@]}"; do steer+=(--synth-steer "$s"); done
      for k in $(seq 0 $((procs - 1))); do
        run=ts-${SYNTH_SEED:-0}; [ "$procs" -gt 1 ] && run=$run-s$k
        base=$((${SYNTH_SEED:-0} + k * 10000000))
        "$BIN" train "${common[@]}" --synth-prompts $((SYNTH / procs)) "${steer[@]}" --data self \
          --temperature "${SYNTH_T:-0}" --seed "$base" --synth-seed $((base + 4294967296)) \
          --exclude-prompts data/eval/humaneval-held.jsonl.gz data/eval/mtbench-held.jsonl.gz \
          --gen-batch "${GEN_BATCH:-64}" --max-new "${MAX_NEW:-256}" --data-time-limit "${GEN_SECS_SYNTH:-${GEN_SECS:-200}}" \
          --data-only --out "$W/$run" > "$R/gen-$run.log" 2>&1 || { echo "!! gen $run"; tail -3 "$R/gen-$run.log"; } &
      done
      wait
      for f in "$R"/gen-ts-*.log; do
        echo "$(basename "$f" .log): $(grep -o '[0-9]* user turns sampled[^:]*' "$f"); $(grep -o '[0-9]* sequences ([0-9]* tokens[^)]*)' "$f")"
      done
      echo "synth: $((SECONDS - T0)) s"
    fi ;;
  pack)
    # every generated pass's sequences, gzipped, back in 15 MB parts (<= 8 files, 64 MiB a
    # call come back): keep them here in .device/data/ and stage them into a later session
    # with tools/gpu-bench/stage_data.sh, one part a call beside the tree
    cat "$W"/t*/sequences.jsonl | gzip -6 > "$W/sequences.jsonl.gz"
    split -b 15000000 -d "$W/sequences.jsonl.gz" "$R/sequences.part-"
    cat "$W"/t*/manifest.json > "$R/manifests.json" 2>/dev/null
    echo "$(cat "$W"/t*/sequences.jsonl | wc -l) sequences, $(stat -c %s "$W/sequences.jsonl.gz") bytes gzipped"
    sha256sum "$W/sequences.jsonl.gz"
    ls -la "$R" ;;
  train|more)
    extra=(); [ "$PHASE" = more ] && extra=(--resume "$W/draft")
    # INIT: a draft returned by an earlier session (staged with stage_data.sh) to train on from
    [ "$PHASE" = train ] && [ -n "${INIT:-}" ] && extra+=(--init-from "$INIT")
    # TIME_LIMIT: fit the schedule (cosine decay included) to this many seconds of steps, for
    # a session that has one training call; CHUNK then only guards the call's length
    [ -n "${TIME_LIMIT:-}" ] && extra+=(--time-limit "$TIME_LIMIT")
    # DRAFT_VOCAB (4096; 0: none): also OUT/narrow-K, the trained draft with its own head over
    # the K most frequent response tokens (as models/ ships the demo draft, session 49)
    # TRAIN_EXTRA: more flags (e.g. --pack-scores N, as session51a.sh's A/B finds best)
    # shellcheck disable=SC2086
    "$BIN" train "${common[@]}" --sequences "${seqs[@]}" "${draft[@]}" --chunk-time "${CHUNK:-480}" --draft-vocab "${DRAFT_VOCAB:-4096}" \
      "${extra[@]}" ${TRAIN_EXTRA:-} --out "$W/draft" > "$R/$PHASE.log" 2>&1 || { echo "!! $PHASE"; tail -5 "$R/$PHASE.log"; }
    grep -E "^step|resumed|started from|chunk-time|saved|fit --example|held-out" "$R/$PHASE.log" | tail -12 ;;
  eval)
    # held-out tau and speedup per block (HumanEval + MT-Bench first turns, never trained on:
    # the gen phase excludes the first 40 of each, data/eval/*-held.jsonl.gz)
    [ "${LIMIT:-10}" -le 40 ] || { echo "!! LIMIT ${LIMIT} > 40: past the held prompts (tools/train/eval_split.py)"; exit 1; }
    # (the eval's logs stay on the machine: $OUT returns at most 8 files of 16 MiB each)
    # (the narrowed copy beside the trained draft when the train phase made one)
    GGUF=$GGUF BIN=$BIN OUT="$W/eval" LIMIT=${LIMIT:-10} BENCH=1 DRAFTS="$W/draft $(ls -d "$W"/draft/narrow-* 2>/dev/null | head -1)" \
      ROWS="${ROWS:-t0-b16 t1-b16 t0-adaptive t0-b8}" bash tools/eval-demo/gpu.sh 2>&1 | tail -20
    # the draft in 15 MB parts (a 4-layer bf16 draft is 31.6 MB); join with `cat part-* >`
    cp "$W/draft/config.json" "$W/draft/train_log.jsonl" "$R/" 2>/dev/null
    split -b 15000000 -d "$W/draft/model.safetensors" "$R/model.safetensors.part-"
    sha256sum "$W/draft/model.safetensors"
    ls -la "$R" ;;
esac
