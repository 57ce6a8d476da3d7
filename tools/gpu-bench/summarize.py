#!/usr/bin/env python3
"""Print the one table of a gpu-bench run from <out>/{reference.json, micro/micro.json,
e2e/summary.json, smi-*.txt}; also writes <out>/table.md."""
from __future__ import annotations

import glob
import json
import os
import sys


def load(p):
    try:
        return json.load(open(p))
    except (OSError, ValueError):
        return None


def peak_gb(out, tag):
    try:
        vals = [float(x) for x in open(os.path.join(out, f"smi-{tag}.txt")).read().split()]
        return max(vals) / 1024 if vals else None
    except (OSError, ValueError):
        return None


def f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def main(out):
    ref = load(os.path.join(out, "reference.json")) or {}
    micro = load(os.path.join(out, "micro", "micro.json")) or {}
    rows_ours = []
    for t in (0, 1):
        for row in (load(os.path.join(out, f"e2e-t{t}", "summary.json")) or {}).get("rows", []):
            row["_pk"] = peak_gb(out, f"e2e-t{t}")
            rows_ours.append(row)
    lines = []
    p = lines.append
    bw = ref.get("copy_bandwidth_Bps")
    wall = ref.get("weight_bytes_all")
    wstep = ref.get("weight_bytes_per_step")
    floor_ms = wall / bw * 1e3 if bw and wall else None
    p(f"shape {ref.get('shape')}, prompt {ref.get('prompt_len')} tokens, {ref.get('max_new')} new; "
      f"torch {ref.get('versions', {}).get('torch')}, transformers {ref.get('versions', {}).get('transformers')}")
    if bw:
        p(f"copy bandwidth {bw / 1e12:.2f} TB/s; weights {wall / 1e9:.2f} GB (all), "
          f"{wstep / 1e9:.2f} GB read per step (without the embedding table); "
          f"floor {floor_ms:.2f} ms/token (all weights), {wstep / bw * 1e3:.2f} ms (per-step bytes)")
    p("")
    res = {r["name"]: r for r in micro.get("results", [])}
    ar = res.get("verify forward Q=1", {}).get("median_us")
    p("| piece (ours, --micro) | median ms | x AR step |")
    p("|---|---|---|")
    for name, r in res.items():
        ms = r["median_us"] / 1e3
        p(f"| {name} | {ms:.3f} | {f(r['median_us'] / ar if ar else None)} |")
    # The same micro pieces in the A/B runs (run.sh AB_UNFUSED=1 / AB_MMA=1), side by side.
    ab = [("default", res)]
    for tag in ("unfused", "invariant"):
        m = load(os.path.join(out, f"micro-{tag}", "micro.json"))
        if m:
            ab.append((tag, {r["name"]: r for r in m.get("results", [])}))
    if len(ab) > 1:
        names = [n for n in res if n.startswith("verify") or n.startswith("draft")]
        p("")
        p("| micro A/B, ms | " + " | ".join(t for t, _ in ab) + " |")
        p("|---|" + "---|" * len(ab))
        for n in names:
            cells = [f(r.get(n, {}).get("median_us", 0) / 1e3 if n in r else None, "{:.3f}") for _, r in ab]
            p(f"| {n} | " + " | ".join(cells) + " |")
    if ar and floor_ms:
        p(f"\nAR step {ar / 1e3:.2f} ms = {floor_ms / (ar / 1e3) * 100:.0f}% of the floor "
          f"(target <= 5.5 ms, >= 70%)")
    p("")
    p("high = agreeing draft at T=0, mid = the same draft at T=1 (target p(A) = 0.8), "
      "zero = disagreeing draft at T=0; block 16")
    p("| engine | draft | tau | decode tok/s | ms/token | TTFT ms | peak GPU GB | lossless |")
    p("|---|---|---|---|---|---|---|---|")
    hf = ref.get("hf_generate")
    if hf:
        p(f"| transformers generate | - | 1 | {hf['tok_s']:.1f} | {1e3 / hf['tok_s']:.2f} | - | "
          f"{f((hf.get('peak_bytes') or 0) / 1e9)} | - |")
    rr = ref.get("reference", {})
    for mode, r in rr.items():
        p(f"| reference dflash | {mode if mode != 'ar' else 'none (block 1)'} | {r['tau']:.2f} | "
          f"{r['tok_s']:.1f} | {r['ms_per_token']:.2f} | {r['ttft_ms']:.1f} | "
          f"{f((r.get('peak_bytes') or 0) / 1e9)} | { {True: 'same as HF', False: 'DIFFERS from HF', None: 'T=1'}[r.get('same_as_hf')] } |")
    ours = {}
    for row in rows_ours:
        mode = row["name"].replace("draft-", "")
        ours[mode] = row
        if row.get("status") != "ok" and not row.get("dflash_tok_s"):
            p(f"| dflash (ours) | {mode} | FAILED: {json.dumps(row.get('failure'))[:120]} |")
            continue
        b = row.get("baseline_tok_s") or {}
        d = row.get("dflash_tok_s") or {}
        pk = row["_pk"]
        if mode == "high" and b:
            p(f"| dflash (ours) | none (plain) | 1 | {b['median']:.1f} | {1e3 / b['median']:.2f} | "
              f"{f(row.get('baseline_ttft_ms'), '{:.1f}')} | {f(pk)} | - |")
        if d:
            mm = row.get("greedy_mismatches")
            p(f"| dflash (ours) | {mode} | {f(row.get('tau'))} | {d['median']:.1f} | "
              f"{1e3 / d['median']:.2f} | {f(row.get('ttft_ms'), '{:.1f}')} | {f(pk)} | "
              f"{'T=1' if mm is None else '== plain' if mm == 0 else f'{mm} mismatches'} |")
    p("")
    p("| draft | tau ours / ref | ours tok/s / reference tok/s |")
    p("|---|---|---|")
    for mode, r in rr.items():
        row = ours.get(mode) or (ours.get("high") if mode == "ar" else None)
        if not row:
            continue
        mine = (row.get("baseline_tok_s") if mode == "ar" else row.get("dflash_tok_s")) or {}
        if mine:
            t = 1.0 if mode == "ar" else row.get("tau")
            p(f"| {mode} | {f(t)} / {r['tau']:.2f} | {mine['median'] / r['tok_s']:.2f}x |")
    # Where a decode cycle's time goes (ours): verify (target forward + choosing tokens), draft,
    # and the engine's own work between them.
    parts = []
    for t in (0, 1):
        for fn in sorted(glob.glob(os.path.join(out, f"e2e-t{t}", "[0-9]*.json"))):
            row = (load(fn) or {}).get("row", {})
            for mode in ("baseline", "dflash"):
                runs = [r for r in row.get("runs", []) if r.get("mode") == mode and r.get("cycles")]
                if not runs or "verify_ms" not in runs[0]:
                    continue
                med = lambda xs: sorted(xs)[len(xs) // 2]
                cyc = med([r["decode_ms"] / r["cycles"] for r in runs])
                ver = med([r["verify_ms"] / r["cycles"] for r in runs])
                dra = med([r["draft_ms"] / r["cycles"] for r in runs])
                rb = med([r.get("rollback_ms", 0.0) / r["cycles"] for r in runs])
                name = row.get("name", "?").replace("draft-", "") if mode == "dflash" else "plain"
                share = rb / max(1e-9, ver + dra + rb)
                parts.append(f"| {name} | {cyc:.2f} | {ver:.2f} | {dra:.2f} | {rb:.2f} ({share:.1%}) | {cyc - ver - dra - rb:.2f} |")
    if parts:
        p("")
        p("| ours, per cycle | total ms | verify ms | draft ms | rollback ms (share of verify+draft+rollback) | engine ms |")
        p("|---|---|---|---|---|---|")
        for x in dict.fromkeys(parts):
            p(x)
    try:
        probe = open(os.path.join(out, "probe.txt")).read().strip()
        p("")
        p("probe (cuda_probe):")
        p(probe)
    except OSError:
        pass
    txt = "\n".join(lines)
    open(os.path.join(out, "table.md"), "w").write(txt + "\n")
    print(txt)


if __name__ == "__main__":
    main(sys.argv[1])
