#!/usr/bin/env bash
# Split a GGUF into parts small enough for one device call each (the call carries at most
# 64 MiB with the tree, ~48 MB since session 51's 21.9 MB draft: 15 MB parts), for the GPU machine, which has no network (issue 26):
#   tools/train/stage_gguf.sh ~/.cache/dflash/models/SmolLM2-135M-Instruct.Q4_1.gguf [PART_MB]
# writes .device/gguf/part-00 .. and .device/gguf/MANIFEST (name, parts, sha256). Then one call
# per part, back to back (a machine stays warm 30 s):
#   run(command="bash tools/gpu-bench/stage.sh", carry=[".device/gguf/MANIFEST", ".device/gguf/part-00"])
# ... and one call with ".device/dflash.xz" (and the MANIFEST) alone: a part and the binary
# together would pass 64 MiB with the tree. stage.sh reports when the file is whole.
set -euo pipefail
src=${1:?GGUF}
mb=${2:-15}
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$root/.device/gguf
rm -rf "$out" && mkdir -p "$out"
split -b "${mb}M" -d -a 2 "$src" "$out/part-"
n=$(ls "$out" | grep -c '^part-')
printf '%s %s %s\n' "$(basename "$src")" "$n" "$(sha256sum "$src" | cut -d' ' -f1)" > "$out/MANIFEST"
ls -la "$out"; cat "$out/MANIFEST"
