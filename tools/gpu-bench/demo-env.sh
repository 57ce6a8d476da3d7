# Sourced by the demo-model scripts of tools/gpu-bench (demo-train.sh, session43.sh,
# session44.sh), after `set -uo pipefail`: the repo root as the working directory, BIN and
# GGUF (where tools/gpu-bench/stage.sh leaves them; override to run elsewhere, GGUF also with a
# safetensors target directory), R (= $OUT,
# what comes back), the CUDA 13 wheel's libraries on the loader path; exits when BIN or GGUF
# is missing.
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
BIN=${BIN:-/root/stash/dflash}
GGUF=${GGUF:-/root/stash/SmolLM2-135M-Instruct.Q4_1.gguf}
R=${OUT:-/tmp}
lib=$(python3 -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))' 2>/dev/null) &&
  export LD_LIBRARY_PATH=$lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
[ -x "$BIN" ] && [ -e "$GGUF" ] || { echo "!! stage the GGUF and dflash first (tools/gpu-bench/stage.sh)"; exit 1; }
