#!/usr/bin/env bash
# Written at the end of session 27 and NOT run (the device time was spent): run it first next
# session. After the review tidy (the target's and the draft's graphs share
# archs::graphs::keyed; the delta rule op always writes into the ring; RecurrentCache::settle),
# the CUDA tests that cover it: graphs vs eager for every family's target and draft, verify
# rows with ring rollbacks == decode steps, DFlash2 on the device.
#   run(command="bash tools/gpu-bench/session27d.sh", carry=[".device", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda
HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error timeout 100 $PY "$here/families.py" build --models /root/small --small \
  --device cuda --dtype bfloat16 > /tmp/small.log 2>&1 || echo "small models: rc $?"
DFLASH_FAMILY_MODELS=/root/small timeout 150 /tmp/stash/fused_cuda --test-threads=1 --nocapture \
  graphs verify_rows dflash2_draft > /tmp/tests.txt 2>&1 || echo "!! fused_cuda rc $?"
grep -E "^test |test result|panicked|GraphReport" /tmp/tests.txt | cut -c1-160 | head -30
grep -A8 "panicked" /tmp/tests.txt | head -20
echo "done in $((SECONDS - T0)) s"
