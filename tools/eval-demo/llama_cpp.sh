#!/usr/bin/env bash
# The demo draft in llama.cpp's DFlash mode vs in this engine, same target GGUF, same prompts
# (ChatML as SmolLM2's template renders it, default system prompt), greedy, block 16 (llama.cpp:
# --spec-draft-n-max 15 = 16-row verify), plain decoding of each engine alongside (llama.cpp's:
# llama-bench tg N, as llama-speculative-simple needs a speculative type). Issue 9.
# Needs a llama.cpp build with llama-speculative-simple (LLAMA_BIN) and the draft converted with
# llama.cpp's converter (DRAFT_GGUF; see docs/training.md):
#   cargo run --release --example gguf_to_hf -p dflash -- MODEL.gguf /tmp/smol-hf
#   python convert_hf_to_gguf.py models/smollm2-135m-dflash --target-model-dir /tmp/smol-hf \
#       --outfile /tmp/smol-dflash-draft.gguf --outtype f32
# Then: LLAMA_BIN=.../build/bin DRAFT_GGUF=/tmp/smol-dflash-draft.gguf tools/eval-demo/llama_cpp.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
BIN=${BIN:-target/release/dflash}
MODEL=${MODEL:-$HOME/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf}
DRAFT=${DRAFT:-models/smollm2-135m-dflash}
OUT=${OUT:-bench-results/llama-cpp}
N=${N:-64}
THREADS=${THREADS:-2}
mkdir -p "$OUT"
prompts=$(python3 - <<'PY'
import gzip, json
out = []
for path, key in (("data/eval/HumanEval.jsonl.gz", "prompt"), ("data/eval/mt_bench_question.jsonl.gz", "turns")):
    for i, line in enumerate(gzip.open(path, "rt")):
        if i >= 3: break
        v = json.loads(line)[key]
        out.append(v[0] if isinstance(v, list) else v)
print(json.dumps(out))
PY
)
sys_prompt="You are a helpful AI assistant named SmolLM, trained by Hugging Face"
count=$(python3 -c "import json,sys;print(len(json.loads(sys.argv[1])))" "$prompts")
for i in $(seq 0 $((count - 1))); do
  p=$(python3 -c "import json,sys;print(json.loads(sys.argv[1])[int(sys.argv[2])])" "$prompts" "$i")
  chat=$(printf '<|im_start|>system\n%s<|im_end|>\n<|im_start|>user\n%s<|im_end|>\n<|im_start|>assistant\n' "$sys_prompt" "$p")
  "$LLAMA_BIN/llama-speculative-simple" -m "$MODEL" -md "$DRAFT_GGUF" --spec-type draft-dflash \
    --spec-draft-n-max 15 -p "$chat" -n "$N" --temp 0 -t "$THREADS" -c 2048 --ignore-eos > "$OUT/llama-dflash-$i.log" 2>&1
  "$BIN" generate --model "$MODEL" --draft "$DRAFT" --prompt "$p" --max-tokens "$N" --block-size 16 --adaptive off --ignore-eos --json > "$OUT/ours-dflash-$i.json" 2>/dev/null
  "$BIN" generate --model "$MODEL" --prompt "$p" --max-tokens "$N" --no-draft --ignore-eos --json > "$OUT/ours-none-$i.json" 2>/dev/null
  "$BIN" generate --model "$MODEL" --draft "$DRAFT" --prompt "$p" --max-tokens "$N" --ignore-eos --json > "$OUT/ours-adaptive-$i.json" 2>/dev/null
done
"$LLAMA_BIN/llama-bench" -m "$MODEL" -p 0 -n "$N" -t "$THREADS" -r 3 -o json > "$OUT/llama-bench.json" 2>/dev/null
python3 - "$OUT" "$count" <<'PY'
import json, re, sys
out, n = sys.argv[1], int(sys.argv[2])
def llama(path):
    t = open(path, errors="replace").read()
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", t)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", t)
    acc = re.search(r"n_accept\s*=\s*(\d+)", t)
    return int(dec.group(1)), float(dec.group(2)), int(drafted.group(1)) if drafted else 0, int(acc.group(1)) if acc else 0
rows = {}
bench = json.load(open(f"{out}/llama-bench.json"))[0]
rows["llama.cpp none"] = [bench["n_gen"], bench["n_gen"] / bench["avg_ts"], bench["n_gen"], 0]
for i in range(n):
    toks, secs, drafted, acc = llama(f"{out}/llama-dflash-{i}.log")
    r = rows.setdefault("llama.cpp dflash", [0, 0.0, 0, 0])
    r[0] += toks; r[1] += secs; r[2] += drafted // 15; r[3] += acc
    for m in ("dflash", "none", "adaptive"):
        s = json.load(open(f"{out}/ours-{m}-{i}.json"))["stats"]
        r = rows.setdefault(f"dflash (ours) {m}", [0, 0.0, 0, 0])
        r[0] += s["generated_tokens"]; r[1] += s["decode_ms"] / 1e3; r[2] += s.get("cycles") or s["generated_tokens"]; r[3] += 0
print("| engine | mode | tokens | decode s | tok/s | tau (tokens per verify) |")
print("|---|---|---|---|---|---|")
for k, (toks, secs, cycles, acc) in rows.items():
    eng, mode = k.rsplit(" ", 1)
    print(f"| {eng} | {mode} | {toks} | {secs:.2f} | {toks / secs:.1f} | {toks / max(cycles, 1):.2f} |")
PY
