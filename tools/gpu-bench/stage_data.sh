#!/usr/bin/env bash
# Device side of carrying generated training data into a later session: keep the carried
# part(s) of .device/data/ (sequences.part-NN from `PHASE=pack demo-train.sh`, and SHA256,
# the `sha256sum` line it printed), and when the whole file checks, unpack it to
# /root/work/t-staged/sequences.jsonl, where demo-train.sh's train phase picks it up with
# any newly generated passes. One call per part: carry=[".device/data/SHA256",
# ".device/data/sequences.part-NN"] (each ~15 MB beside the tree).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p /root/stage-data /root/work/t-staged
for p in "$root"/.device/data/sequences.part-*; do
  [ -f "$p" ] && cp "$p" /root/stage-data/ && echo "kept $(basename "$p")"
done
sum=$(cut -d' ' -f1 "$root/.device/data/SHA256")
cat /root/stage-data/sequences.part-* > /root/stage-data/whole.gz
if [ "$(sha256sum /root/stage-data/whole.gz | cut -d' ' -f1)" = "$sum" ]; then
  gunzip -c /root/stage-data/whole.gz > /root/work/t-staged/sequences.jsonl &&
    echo "whole: $(wc -l < /root/work/t-staged/sequences.jsonl) sequences in /root/work/t-staged (sha256 ok)"
else
  echo "parts so far: $(ls /root/stage-data | grep -c '^sequences.part-') (not whole yet)"
fi
rm -f /root/stage-data/whole.gz
