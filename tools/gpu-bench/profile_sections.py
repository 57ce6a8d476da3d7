"""Median per-section GPU times from a `DFLASH_PROFILE=gpu dflash bench --micro` log.

usage: profile_sections.py LOG SKIP_TARGET SKIP_DRAFT  (skip the first lines of each kind:
prefill and warm-up calls). Prints one line for the target's sections, one for the draft's.
"""
import re, statistics, sys
# usage: prof.py log skip_target skip_draft
log, st, sd = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = {"target": [], "draft": []}
for l in open(log):
    m = re.match(r"profile (\w+): total ([\d.]+) ms = (.*)", l.strip())
    if not m: continue
    secs = dict((p.rsplit(" ", 1)[0], float(p.rsplit(" ", 1)[1])) for p in m.group(3).split(", "))
    secs["total"] = float(m.group(2))
    rows[m.group(1)].append(secs)
for what, skip in (("target", st), ("draft", sd)):
    r = rows[what][skip:]
    if not r: continue
    keys = list(r[0].keys())
    print(f"  {what} ({len(r)} calls): " + ", ".join(f"{k} {statistics.median(x.get(k, 0) for x in r):.3f}" for k in keys))
