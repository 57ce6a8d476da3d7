#!/usr/bin/env python3
"""Summarize `ncu --csv --page raw --metrics gpu__time_duration.sum` output: per kernel name
(template arguments cut), launches, total and mean microseconds, sorted by total; then the
total of all launches. ncu_summary.py FILE.csv"""
import csv
import re
import sys
from collections import defaultdict

rows = []
with open(sys.argv[1], newline="") as f:
    lines = [l for l in f if l.startswith('"')]
r = csv.reader(lines)
head = next(r)
name_i = head.index("Kernel Name")
t_i = head.index("gpu__time_duration.sum")
units = next(r)  # the units row
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(units[t_i].strip())
if scale is None:
    sys.exit(f"unknown unit {units[t_i]!r} of gpu__time_duration.sum")
agg = defaultdict(lambda: [0, 0.0])
total = 0.0
for row in r:
    try:
        t = float(row[t_i].replace(",", "")) * scale
    except ValueError:
        continue
    name = re.sub(r"[(<].*", "", row[name_i]).strip()
    agg[name][0] += 1
    agg[name][1] += t
    total += t
print(f"{'kernel':<48} {'launches':>8} {'total us':>10} {'mean us':>9}")
for name, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:48]:<48} {n:>8} {t:>10.1f} {t / n:>9.2f}")
print(f"{'all':<48} {sum(v[0] for v in agg.values()):>8} {total:>10.1f}")
