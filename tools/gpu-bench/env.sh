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
  xz -dc "$root/.device/$b.xz" > "/tmp/stash/$b" && chmod +x "/tmp/stash/$b"
done
export LD_LIBRARY_PATH=$($PY -c 'import nvidia,os;print(os.path.join(nvidia.__path__[0],"cu13","lib"))'):/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
refdir=$(mktemp -d)
(cd "$refdir" && $PY -m zipfile -e "$root"/tools/goldens/wheels/dflash-*.whl .)
export PYTHONPATH="$refdir:${PYTHONPATH:-}"
ensure_models() {
  [ -d "$1/target" ] || timeout 240 $PY "$here/models.py" --shape qwen3-8b --out "$1" > "$1.log" 2>&1
}
