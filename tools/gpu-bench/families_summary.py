#!/usr/bin/env python3
"""The family sweep's table (families.sh): one row per family from RES/<fam>/, written to
RES/table.md and printed.

Reads: RES/bandwidth.json (families.py bandwidth), and per family RES/<fam>/manifest.json,
target/{config.json,tensors.json}, draft/tensors.json (copied there by families.sh),
micro/micro.json (`dflash bench --micro --out RES/<fam>/micro`), micro.err and rc (the engine's
stderr and exit status), build.log.

Floors (bytes a step must read / the measured copy bandwidth), from the safetensors headers:
  - every non-expert tensor: attention, dense MLPs, shared experts, norms, routers, the LM head
    (a tied embedding counts as the head); the embedding table is left out (a step reads one
    row of it per token), so are per-layer embedding tables;
  - expert tensors (`.experts.` in the name, not `shared_expert`): per MoE layer, one expert's
    bytes times the experts a step touches: top_k for one row; for q rows the expected union
    under uniform routing, E * (1 - (1 - k/E)^q) (the "union floor" of verify(q));
  - the KV cache / recurrent state a step reads is left out (context 128: < 1% of the weights).
Draft floor: the draft's weights + the target's LM head (the draft borrows it).
Projected speedup at tau 6.5 = 6.5 * plain step / (verify(16) + draft): tokens per cycle over a
cycle's cost relative to plain decoding (ignores the engine's own work between the calls).
Usage: families_summary.py RES [--tau 6.5]
"""
from __future__ import annotations

import json
import os
import re
import sys

ORDER = ["qwen3", "qwen3_5", "qwen3_moe", "qwen3_5_moe", "qwen3_next", "gpt_oss", "gemma4",
         "deepseek_v3"]
QS = (4, 8, 16)


def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def read_text(p):
    try:
        with open(p, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def is_expert(name):
    return ".experts." in name and "shared_expert" not in name


def text_cfg(cfg):
    return cfg.get("text_config") or cfg


def moe_k(cfg):
    t = text_cfg(cfg)
    for key in ("num_experts_per_tok", "top_k_experts", "experts_per_token"):
        if t.get(key):
            return int(t[key])
    return None


def moe_e(cfg):
    t = text_cfg(cfg)
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if t.get(key):
            return int(t[key])
    return None


def union(e, k, q):
    """Expected number of distinct experts that q rows touch, each picking k of e uniformly."""
    return e * (1.0 - (1.0 - k / e) ** q)


def account(cfg, tensors):
    """Bytes a target step reads: {"other", "head", "embed", "moe_layers": {layer: (E,
    bytes per expert)}}."""
    t = text_cfg(cfg)
    tied = bool(cfg.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    has_head = any(n.endswith("lm_head.weight") for n in tensors)
    acc = {"other": 0, "head": 0, "embed": 0}
    layers = {}
    for name, (_dt, shape, nb) in tensors.items():
        if is_expert(name):
            m = re.search(r"layers\.(\d+)\.", name)
            lay = int(m.group(1)) if m else -1
            d = layers.setdefault(lay, {"stacked": 0.0, "E": None, "idx": {}})
            j = re.search(r"\.experts\.(\d+)\.", name)
            if j:
                d["idx"][int(j.group(1))] = d["idx"].get(int(j.group(1)), 0) + nb
            else:  # all experts stacked in one tensor [E, ...]
                d["stacked"] += nb / shape[0]
                d["E"] = shape[0]
        elif name.endswith("lm_head.weight"):
            acc["head"] += nb
        elif re.search(r"embed_tokens(\.weight)?$", name) and tied and not has_head:
            acc["head"] += nb  # tied: the head reads the whole table
        elif "embed_tokens" in name:
            acc["embed"] += nb
        else:
            acc["other"] += nb
            m = re.search(r"layers\.(\d+)\.", name)
            if m:
                acc.setdefault("layer_other", {}).setdefault(int(m.group(1)), 0)
                acc["layer_other"][int(m.group(1))] += nb
    acc["moe_layers"] = {}
    for lay, d in layers.items():
        e = len(d["idx"]) or d["E"]
        per = d["stacked"] + (sum(d["idx"].values()) / len(d["idx"]) if d["idx"] else 0.0)
        acc["moe_layers"][lay] = (e, per)
    return acc


def floor_bytes(acc, k, q):
    b = acc["other"] + acc["head"]
    for e, per in acc["moe_layers"].values():
        b += (union(e, k, q) if k else e) * per
    return b


def full_depth_floor_bytes(acc, k, q, used, published):
    """Bytes a step reads at the published depth: the head and the other non-layer weights
    once, the dense layers' mean per dense layer, the MoE layers' mean per MoE layer (q rows'
    union), the MoE layers' share of the depth kept (a model with a fixed number of leading
    dense layers, deepseek's first_k_dense_replace, keeps that number)."""
    lo = acc.get("layer_other", {})
    moe = acc["moe_layers"]
    fixed = acc["other"] - sum(lo.values()) + acc["head"]
    dense = [l for l in lo if l not in moe]
    if not moe:
        return fixed + sum(lo.values()) / max(1, used) * published
    n_moe_pub = published - len(dense)  # the dense layers are a fixed few
    moe_b = sum(lo.get(l, 0) + (union(e, k, q) if k else e) * per for l, (e, per) in moe.items())
    return fixed + sum(lo[l] for l in dense) + moe_b / len(moe) * n_moe_pub


def first_error(err, rc):
    lines = [x.strip() for x in err.splitlines() if x.strip()]
    for x in lines:
        if re.search(r"error|panicked|failed|refused|Killed", x, re.I):
            return x[:160]
    if rc in (124, 137):
        return f"timed out (rc {rc})" + (f"; last line: {lines[-1][:120]}" if lines else "")
    return (lines[-1][:160] if lines else f"rc {rc}")


def fmt(x, f="{:.2f}"):
    return "-" if x is None else f.format(x)


def hb(b):
    """Bytes, compact: 15.14G, 9.4M, 12K."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f}{unit}" if unit == "G" else f"{b / scale:.1f}{unit}"
    return f"{b:.0f}B"


def main(res, tau=6.5):
    bw = load(os.path.join(res, "bandwidth.json")) or {}
    bps = bw.get("copy_Bps")
    fams = [f for f in ORDER if os.path.isdir(os.path.join(res, f))]
    fams += sorted(f for f in os.listdir(res) if os.path.isdir(os.path.join(res, f)) and f not in fams
                   and any(os.path.exists(os.path.join(res, f, x)) for x in ("manifest.json", "status", "rc")))
    lines = []
    p = lines.append
    machine, opts = None, None
    rows, floors, notes, full_notes = [], [], [], []
    for fam in fams:
        d = os.path.join(res, fam)
        man = load(os.path.join(d, "manifest.json")) or {}
        cfg = load(os.path.join(d, "target", "config.json")) or {}
        tens = load(os.path.join(d, "target", "tensors.json")) or {}
        dtens = load(os.path.join(d, "draft", "tensors.json")) or {}
        micro = load(os.path.join(d, "micro", "micro.json"))
        rc_txt = read_text(os.path.join(d, "rc")).strip()
        rc = int(rc_txt) if rc_txt.lstrip("-").isdigit() else None
        status = read_text(os.path.join(d, "status")).strip()
        name = f"{fam}: {man.get('published', '?')}, {man.get('layers', '?')}/{man.get('published_layers', '?')} layers"
        shape = man.get("shape", "?")
        if not micro:
            if status.startswith("build"):
                why = status + ": " + first_error(read_text(os.path.join(d, "build.log")), None)
            elif status.startswith("skipped"):
                why = status
            else:
                why = f"FAILED (rc {rc}): " + first_error(read_text(os.path.join(d, "micro.err")), rc)
            rows.append(f"| {name} | {shape} | {why.replace('|', '/')} |" + " |" * 8)
            continue
        machine = machine or (micro.get("machine") or {})
        opts = opts or micro.get("options")
        r = {x["name"]: x for x in micro.get("results", [])}
        ms = lambda key: r[key]["median_us"] / 1e3 if key in r else None
        step = ms("verify forward Q=1")
        ver = {q: ms(f"verify forward Q={q}") for q in QS}
        dname = next((n for n in r if n.startswith("draft forward Q=")), None)
        draft = ms(dname) if dname else None
        k = moe_k(cfg) if any(is_expert(n) for n in tens) else None
        acc = account(cfg, tens) if tens else None
        fl = {q: floor_bytes(acc, k, q) / bps * 1e3 for q in (1,) + QS} if acc and bps else {}
        f1 = fl.get(1)
        pct = f"{f1 / step * 100:.0f}%" if f1 and step else "-"
        cells = []
        for q in QS:
            v = ver[q]
            if v is None or not step:
                cells.append("-")
                continue
            c = f"{v:.2f} ({v / step:.2f}x"
            if k and fl.get(q):
                c += f"; {v / fl[q]:.2f}x fl{q}"
            cells.append(c + ")")
        dfloor = None
        if dtens and acc and bps:
            dfloor = (sum(x[2] for x in dtens.values()) + acc["head"]) / bps * 1e3
        dcell = "-"
        if draft is not None and step:
            dcell = f"{draft:.2f} ({draft / step:.2f}x"
            dcell += f"; {dfloor / draft * 100:.0f}% fl)" if dfloor else ")"
        sp = tau * step / (ver[16] + draft) if step and ver.get(16) and draft else None
        # At the published depth, each piece at the same fraction of its floor as measured.
        lu, lp = man.get("layers"), man.get("published_layers")
        spf = None
        if acc and step and ver.get(16) and draft and lu and lp and lu != lp:
            step_f = step * full_depth_floor_bytes(acc, k, 1, lu, lp) / floor_bytes(acc, k, 1)
            ver_f = ver[16] * full_depth_floor_bytes(acc, k, 16, lu, lp) / floor_bytes(acc, k, 16)
            spf = tau * step_f / (ver_f + draft)
            full_notes.append(f"- {fam}: at {lp} layers, step {step_f:.2f} ms, verify(16) {ver_f:.2f} ms, "
                              f"draft {draft:.2f} ms = {draft / step_f:.2f}x the step")
        rows.append(f"| {name} | {shape} | {fmt(step)} | {fmt(f1)} | {pct} | " + " | ".join(cells)
                    + f" | {dcell} | {fmt(sp, '{:.2f}x')} | {fmt(spf if spf else sp, '{:.2f}x')} |")
        if acc:
            gb = lambda q: hb(floor_bytes(acc, k, q))
            moe = acc["moe_layers"]
            if moe:
                e = next(iter(moe.values()))[0]
                un = " / ".join(f"{union(e, k, q):.1f}" for q in (1,) + QS)
                per = sum(v[1] for v in moe.values()) / len(moe)
                ex = f"{len(moe)} MoE layers, E={e} k={k}, {hb(per)} per expert; union at q=1/4/8/16: {un}"
            else:
                ex = "dense"
            gpu = ms("verify Q=1: GPU only")
            build = "/".join(fmt(man.get(x), "{:.1f}") for x in ("build_s", "save_s", "draft_s"))
            floors.append(f"| {fam} | {hb(acc['other'] + acc['head'])} | {hb(acc['head'])} | "
                          f"{hb(acc['embed'])} | {ex} | "
                          + " / ".join(gb(q) for q in (1,) + QS) + " | "
                          + " / ".join(fmt(fl.get(q), "{:.3f}") for q in (1,) + QS) + f" | {fmt(gpu, '{:.3f}')} | "
                          f"{hb(man.get('target_bytes') or 0)} / {hb(man.get('draft_bytes') or 0)} | {build} |")
        if rc not in (0, None):
            notes.append(f"- {fam}: the engine exited with rc {rc} after writing micro.json: "
                         + first_error(read_text(os.path.join(d, "micro.err")), rc))
    p("## Family sweep: `dflash bench --micro` per family (random weights, published widths)")
    p("")
    if machine:
        m = machine
        sw = ", ".join(f"{a}={b}" for a, b in (m.get("switches") or {}).items())
        p(f"Machine: {m.get('gpu') or m.get('cpu')} ({m.get('threads')} host threads); device "
          f"{m.get('device')}, dtype {m.get('dtype')}; commit {m.get('git_commit')}"
          + (f"; switches {sw}" if sw else ""))
    if opts:
        p(f"Micro: context {opts.get('context')}, {opts.get('iters')} iterations, medians (wall, "
          f"synchronized); q = verify rows.")
    if bps:
        p(f"Copy bandwidth {bps / 1e12:.3f} TB/s on {bw.get('name')} (bytes read + written per second "
          f"of a {bw.get('bytes_per_buffer', 0) / 2**30:.2f} GiB device-to-device copy, as docs/perf.md); "
          f"floor = bytes a step must read / that bandwidth.")
    else:
        p("No bandwidth.json: floors not computed.")
    p("")
    p(f"| family (shape, layers used/published) | widths | plain step ms | floor ms | % of floor | "
      f"verify(4) ms (x step; x union floor) | verify(8) | verify(16) | draft ms (x step; % of draft floor) "
      f"| projected speedup at tau {tau} | same, at the published depth |")
    p("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines.extend(rows)
    p("")
    p(f"Projected speedup = {tau} x step / (verify(16) + draft). Dense families: floor(q) = floor(1). "
      f"`x flq` = verify(q) / its union floor (top_k experts per row, union of E(1-(1-k/E)^q) "
      f"per MoE layer under uniform routing). At the published depth: the measured step and verify(16) "
      f"scaled by their floors at the published layer count (each piece at the fraction of its floor "
      f"it ran at here; the draft does not change with the target's depth):")
    lines.extend(full_notes)
    if floors:
        p("")
        p("| family | bytes read per step w/o experts (incl. head) | LM head | embedding (not counted) | experts | "
          "bytes read at q=1/4/8/16 | floor ms at q=1/4/8/16 | step GPU-only ms | files: target / draft | "
          "init / save / draft s |")
        p("|---|---:|---:|---:|---|---|---|---:|---|---|")
        lines.extend(floors)
    if notes:
        p("")
        lines.extend(notes)
    txt = "\n".join(lines)
    with open(os.path.join(res, "table.md"), "w") as f:
        f.write(txt + "\n")
    print(txt)


if __name__ == "__main__":
    args = sys.argv[1:]
    tau = 6.5
    if "--tau" in args:
        i = args.index("--tau")
        tau = float(args[i + 1])
        del args[i:i + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    main(args[0], tau)
