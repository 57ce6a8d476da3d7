"""Table of tools/eval-demo/run.sh results: one row per bench run (name = set, T, block)."""
import json
import os
import sys

out = sys.argv[1]
rows = []
for name in sorted(os.listdir(out)):
    p = os.path.join(out, name, "summary.json")
    if not os.path.isfile(p):
        continue
    s = json.load(open(p))
    for r in s["rows"]:
        if r.get("status") != "ok":
            rows.append((name, None, r))
            continue
        rows.append((name, s, r))

print("| run | T | block | tau | acceptance | plain tok/s | DFlash tok/s | speedup (min-max) | greedy mismatches |")
print("|---|---|---|---|---|---|---|---|---|")
for name, s, r in rows:
    if s is None:
        print(f"| {name} | - | - | - | - | - | - | {r.get('status')} | - |")
        continue
    o = s["options"]
    # --block-size pins the size (options.block_size set); otherwise adaptive up to the draft's
    pinned = o.get("block_size") is not None or not o["adaptive"]
    block = f"{r['block_size']} fixed" if pinned else f"adaptive (max {r['block_size']})"
    b, d = r["baseline_tok_s"], r["dflash_tok_s"]
    gm = r.get("greedy_mismatches")
    print(
        f"| {name} | {o['temperature']:g} | {block} | {r['tau']:.2f} | {r['acceptance_ratio']:.3f} | "
        f"{b['median']:.1f} | {d['median']:.1f} | {r['speedup']:.2f}x ({r['speedup_min']:.2f}-{r['speedup_max']:.2f}) | "
        f"{'-' if gm is None else gm} |"
    )
m = next(iter(rows), None)
if m and m[1]:
    s = m[1]
    print()
    print(f"machine: {s['machine']['cpu']} x{s['machine']['threads']}, {s['machine']['device']}, "
          f"commit {s['machine']['git_commit']}; prompts: {s['options']['prompt_source']}; "
          f"max_tokens {s['options']['max_tokens']}, repeat {s['options']['repeat']}")
