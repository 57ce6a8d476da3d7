#!/usr/bin/env bash
# H200: the prefix cache's second-turn TTFT and output vs a cold run (issue 23 acceptance 3),
# Qwen3-8B shape, random weights, 2,000-token first turn (examples/prefix_ttft.rs).
# Binaries: .device/prefix_ttft.xz; carry [".device", "tools/goldens/wheels"].
set -uo pipefail
. "$(dirname "$0")/env.sh" prefix_ttft
RES=${OUT:-/tmp}/prefix
M=/root/s20-models
mkdir -p "$RES" "$M"
ensure_models "$M"
timeout 240 /tmp/stash/prefix_ttft --model "$M/target" --draft "$M/draft-agree" --device cuda --dtype bf16 \
  --prompt-len 2000 --max-tokens 64 --extra 40 2> "$RES/err.txt" || tail -5 "$RES/err.txt"
