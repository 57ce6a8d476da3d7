#!/usr/bin/env bash
# Device side of tools/train/stage_gguf.sh: keep the carried part(s) of .device/gguf/ in
# /root/stage, and when every part of the MANIFEST is there, join them into
# /root/stash/NAME and check its sha256. Prints what it has.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
read -r name parts sum < "$root/.device/gguf/MANIFEST"
mkdir -p /root/stage /root/stash
for p in "$root"/.device/gguf/part-*; do
  [ -f "$p" ] && cp "$p" /root/stage/ && echo "kept $(basename "$p") ($(stat -c %s "$p") bytes)"
done
have=$(ls /root/stage | grep -c '^part-' || true)
echo "parts: $have of $parts"
if [ "$have" = "$parts" ] && [ ! -f "/root/stash/$name" ]; then
  cat /root/stage/part-* > "/root/stash/$name.tmp"
  if [ "$(sha256sum "/root/stash/$name.tmp" | cut -d' ' -f1)" = "$sum" ]; then
    mv "/root/stash/$name.tmp" "/root/stash/$name" && rm -rf /root/stage && echo "whole: /root/stash/$name (sha256 ok)"
  else
    echo "!! sha256 mismatch: parts corrupt; stage again"; rm -f "/root/stash/$name.tmp"
  fi
fi
[ -f "$root/.device/dflash.xz" ] && xz -dc "$root/.device/dflash.xz" > /root/stash/dflash && chmod +x /root/stash/dflash && echo "dflash unpacked"
ls -la /root/stash
