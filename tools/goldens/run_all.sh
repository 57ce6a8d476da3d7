#!/usr/bin/env bash
# Produce all fixtures on a machine with torch + transformers (CPU is enough).
# Usage (from the repo root): bash tools/goldens/run_all.sh OUTDIR
#   OUTDIR gets log files and fixtures.tgz (the tree to unpack into crates/dflash/tests/fixtures/).
# dflash is taken from tools/goldens/wheels/dflash-*.whl (see README.md).
set -u
OUTDIR=${1:?OUTDIR}
HERE=$(cd "$(dirname "$0")" && pwd)
FX=$(mktemp -d /tmp/dflash-fixtures.XXXXXX)
SITE=$(mktemp -d /tmp/dflash-site.XXXXXX)
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=
mkdir -p "$OUTDIR"

python3 -m pip install -q --no-index --no-deps --target "$SITE" "$HERE"/wheels/dflash-*.whl \
  || python3 -m zipfile -e "$HERE"/wheels/dflash-*.whl "$SITE" || exit 1
export PYTHONPATH="$SITE"

{
  echo "host: $(uname -a)"; echo "cpus: $(nproc)"; python3 --version
  python3 -c 'import torch, transformers, dflash, importlib.metadata as m; print("torch", torch.__version__, "transformers", transformers.__version__, "dflash", m.version("dflash"), "file", dflash.__file__)'
  python3 "$HERE/selftest.py"
} 2>&1 | tee "$OUTDIR/env.log"

cd "$HERE"
python3 make_target_goldens.py --out "$FX" >"$OUTDIR/targets.log" 2>&1 &
p0=$!
pids=()
for c in qwen3_b16 llama3_b8 qwen3_tied_swa_b4; do
  python3 make_dflash_goldens.py --out "$FX" --only "$c" >"$OUTDIR/$c.log" 2>&1 &
  pids+=($!)
done
for c in d2_qwen3_b16_k3 d2_llama3_b8_k2 d2_tied_swa_noncausal_b8_k4 d2_qwen3_causal_swa_b16_k2; do
  python3 make_dflash2_goldens.py --out "$FX" --only "$c" >"$OUTDIR/$c.log" 2>&1 &
  pids+=($!)
done
rc=0
wait $p0 || rc=1
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for f in "$OUTDIR"/*.log; do echo "=== $f"; tail -n 40 "$f"; done
tar czf "$OUTDIR/fixtures.tgz" -C "$FX" .
du -sh "$FX"; find "$FX" -type f | sort | xargs ls -l
exit $rc
