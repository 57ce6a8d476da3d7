#!/usr/bin/env bash
# Device side of carrying generated training data and a returned draft into a later session,
# one call per part beside the tree (each part ~15 MB):
#   data:  carry=[".device/data/SHA256", ".device/data/sequences.part-NN"] (the parts and the
#          `sha256sum` line of `PHASE=pack demo-train.sh`); whole, it is unpacked to
#          /root/work/t-staged/sequences.jsonl, where demo-train.sh's train phase picks it up
#          with any newly generated passes.
#   draft: carry=[".device/draft/SHA256", ".device/draft/config.json",
#          ".device/draft/model.safetensors.part-NN"] (what `PHASE=eval` returned); whole, it is
#          /root/work/init, which `INIT=/root/work/init PHASE=train demo-train.sh` trains on from.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
# keep NAME: .device/NAME's carried parts into /root/stage-NAME; prints the whole file's path
# once its parts check against .device/NAME/SHA256
keep() {
  local name=$1 stage=/root/stage-$1
  mkdir -p "$stage"
  for p in "$root/.device/$name"/*.part-*; do
    [ -f "$p" ] && cp "$p" "$stage/" && echo "kept $name/$(basename "$p")" >&2
  done
  [ -f "$root/.device/$name/config.json" ] && cp "$root/.device/$name/config.json" "$stage/"
  [ -f "$root/.device/$name/SHA256" ] || return 1
  ls "$stage"/*.part-* > /dev/null 2>&1 || return 1
  cat "$stage"/*.part-* > "$stage/whole"
  if [ "$(sha256sum "$stage/whole" | cut -d' ' -f1)" = "$(cut -d' ' -f1 "$root/.device/$name/SHA256")" ]; then
    echo "$stage/whole"
  else
    echo "$name: $(ls "$stage" | grep -c '\.part-') parts so far (not whole yet)" >&2
    rm -f "$stage/whole"
    return 1
  fi
}
if w=$(keep data); then
  mkdir -p /root/work/t-staged
  gunzip -c "$w" > /root/work/t-staged/sequences.jsonl && rm -f "$w" &&
    echo "whole: $(wc -l < /root/work/t-staged/sequences.jsonl) sequences in /root/work/t-staged (sha256 ok)"
fi
if w=$(keep draft); then
  mkdir -p /root/work/init
  mv "$w" /root/work/init/model.safetensors && cp /root/stage-draft/config.json /root/work/init/ &&
    echo "whole: the draft in /root/work/init (sha256 ok)"
fi
exit 0
