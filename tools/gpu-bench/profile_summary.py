#!/usr/bin/env python3
"""Average the `profile NAME: total T ms = a 1.0, b 2.0` lines (DFLASH_PROFILE) of a log per
NAME and section, skipping empty lines and the first --skip of each name (warm-up)."""
import re
import sys
from collections import defaultdict

skip = int(sys.argv[2]) if len(sys.argv) > 2 else 5
seen = defaultdict(int)
acc = defaultdict(lambda: defaultdict(float))
cnt = defaultdict(int)
for line in open(sys.argv[1]):
    m = re.match(r"profile (.+?): total ([-\d.]+) ms = (.*)", line.strip())
    if not m or not m.group(3):
        continue
    name = m.group(1)
    seen[name] += 1
    if seen[name] <= skip:
        continue
    cnt[name] += 1
    acc[name]["total"] += float(m.group(2))
    for part in m.group(3).split(", "):
        label, _, v = part.rpartition(" ")
        acc[name][label] += float(v)
for name, parts in acc.items():
    n = cnt[name]
    print(f"{name} (n={n}): " + ", ".join(f"{k} {v / n:.3f}" for k, v in parts.items()))
