#!/usr/bin/env python3
"""DFlash2 reference traces from the authors' PyPI package `dflash` (dflash/model.py,
DFlash2DraftModel: grouped dynamic causal convolutions + the candidate selector).

For each case: a tiny random target (made low-entropy) and a tiny random DFlash2 draft whose
selector codebooks are scaled up (so the walk's pair scores overrule the logits' argmax on some
rows); runs `dflash.model.dflash_generate` at temperature 0, records every target call, every
draft call's logits and every selector path, and writes <out>/dflash2/<case>/{target/, draft/,
trace.json, trace.safetensors}.

One patch to the reference, recorded in trace.json: `_grouped_dynamic_convolve` fails when a
block has fewer rows than the kernel (`blocks[:, :-offset]` is empty and the pad makes it
`offset` rows long); the patched version gives such offsets nothing, which is what a causal
convolution with zero padding computes. It is bit-identical to the original wherever the
original runs (checked on every call).

Usage: python3 make_dflash2_goldens.py --out DIR   (dflash importable, e.g. via PYTHONPATH)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gold_common import (  # noqa: E402
    MIN_MARGIN,
    VOCAB,
    _SMALL,
    build_steps,
    candidate_grid,
    choose_stop_variant,
    score,
    versions,
    write_json,
)
from gold_common import LLAMA3_CASE_ROPE, YARN_CASE_ROPE  # noqa: E402
import make_dflash_goldens as mdg  # noqa: E402

# Codebook rows are N(0, 0.12) after reinit; this gain makes pair scores comparable to logits.
CODEBOOK_GAIN = 3.0


def _draft(**kw) -> dict:
    d = dict(
        architectures=["DFlash2DraftModel"],
        model_type="qwen3",
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        attention_bias=False,
        max_position_embeddings=512,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    d.update(kw)
    return d


def cases() -> dict:
    out = {}
    # (1) qwen3 target, 2 draft layers, kernel 3, group 8, rank 8, top-8, block 16
    out["d2_qwen3_b16_k3"] = dict(
        target_cls="Qwen3ForCausalLM",
        target=dict(_SMALL, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, tie_word_embeddings=False, attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        target_spelling="tf4",
        draft=_draft(num_hidden_layers=2, num_target_layers=4, block_size=16,
                     dflash_config={"mask_token_id": 255, "target_layer_ids": [0, 1, 2],
                                    "conv_kernel_size": 3, "conv_group_size": 8,
                                    "selector_rank": 8, "selector_top_k": 8}),
        block_size=16, mask_token_id=255, prompt_len=20, max_new_tokens=37,
    )
    # (2) llama3 target, 1 draft layer, kernel 2, one group per 16 channels, rank 16, top-4,
    #     block 8; the DFlash2 keys at the top level (the reference reads both places)
    out["d2_llama3_b8_k2"] = dict(
        target_cls="LlamaForCausalLM",
        target=dict(_SMALL, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                    tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                    rope_parameters=dict(LLAMA3_CASE_ROPE)),
        target_spelling="tf4",
        target_drop_head_dim=True,
        draft=_draft(num_hidden_layers=1, head_dim=8, num_target_layers=3, block_size=8,
                     rope_theta=LLAMA3_CASE_ROPE["rope_theta"],
                     rope_scaling={k: v for k, v in LLAMA3_CASE_ROPE.items() if k != "rope_theta"},
                     conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=4,
                     dflash_config={"mask_token_id": 200, "target_layer_ids": [0, 1]}),
        block_size=8, mask_token_id=200, prompt_len=16, max_new_tokens=45,
    )
    # (3) tied yarn target; draft [sliding(8), full] with is_causal false (the published
    #     DFlash2 layout: non-causal sliding window), kernel 4, group 4, top-16, block 8
    out["d2_tied_swa_noncausal_b8_k4"] = dict(
        target_cls="Qwen3ForCausalLM",
        target=dict(_SMALL, num_hidden_layers=3, max_position_embeddings=256,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    tie_word_embeddings=True, attention_bias=False,
                    rope_parameters=dict(YARN_CASE_ROPE)),
        target_spelling="tf5",
        draft=_draft(num_hidden_layers=2, max_position_embeddings=256, tie_word_embeddings=True,
                     rope_theta=None, rope_parameters=dict(YARN_CASE_ROPE),
                     layer_types=["sliding_attention", "full_attention"],
                     use_sliding_window=True, sliding_window=8, max_window_layers=0,
                     is_causal=False, num_target_layers=3, block_size=8,
                     dflash_config={"mask_token_id": 3, "target_layer_ids": [0, 1], "block_size": 8,
                                    "conv_kernel_size": 4, "conv_group_size": 4,
                                    "selector_rank": 8, "selector_top_k": 16}),
        block_size=8, mask_token_id=3, prompt_len=26, max_new_tokens=42,
    )
    # (4) qwen3 target; draft [sliding(6) causal, full], kernel 2, a single group (group = H),
    #     rank 4, top-2, block 16
    out["d2_qwen3_causal_swa_b16_k2"] = dict(
        target_cls="Qwen3ForCausalLM",
        target=dict(_SMALL, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, tie_word_embeddings=False, attention_bias=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        target_spelling="tf4",
        draft=_draft(num_hidden_layers=2, num_target_layers=4, block_size=16,
                     layer_types=["sliding_attention", "full_attention"],
                     use_sliding_window=True, sliding_window=6, max_window_layers=0,
                     dflash_config={"mask_token_id": 250, "target_layer_ids": [0, 2],
                                    "conv_kernel_size": 2, "conv_group_size": 32,
                                    "selector_rank": 4, "selector_top_k": 2}),
        block_size=16, mask_token_id=250, prompt_len=18, max_new_tokens=57,
    )
    for c in out.values():
        if c["draft"].get("rope_theta", 0) is None:
            del c["draft"]["rope_theta"]
    return out


def patch_convolve(dm, torch):
    """Replace `_grouped_dynamic_convolve` by the zero-padded version; where the original runs,
    check both agree bit for bit. Returns a dict of call counts."""
    import torch.nn.functional as F

    orig = dm._grouped_dynamic_convolve
    stats = {"calls": 0, "short_blocks": 0, "compared": 0}

    def fixed(hidden, dynamic, base, group_size):
        batch, length, hidden_size = hidden.shape
        groups = hidden_size // group_size
        blocks = hidden.view(batch, length, groups, group_size)
        dyn = dynamic.view(batch, length, base.shape[0], groups, 1)
        output = torch.zeros_like(blocks)
        for offset in range(base.shape[0]):
            if offset >= length:
                continue
            values = blocks if offset == 0 else F.pad(blocks[:, :-offset], (0, 0, 0, 0, offset, 0))
            kernel = base[offset].view(1, 1, groups, group_size).to(hidden.dtype)
            output = output + kernel * values
            output = torch.addcmul(output, dyn[:, :, offset], values)
        return output.view_as(hidden)

    def wrapped(hidden, dynamic, base, group_size):
        stats["calls"] += 1
        y = fixed(hidden, dynamic, base, group_size)
        if hidden.shape[1] >= base.shape[0]:
            y0 = orig(hidden, dynamic, base, group_size)
            assert torch.equal(y, y0), "patched convolution differs from the reference"
            stats["compared"] += 1
        else:
            stats["short_blocks"] += 1
        return y

    dm._grouped_dynamic_convolve = wrapped
    return stats


def walk_margins(sel, hidden, logits, anchor, torch):
    """Re-walk the selector's greedy path; per row the top-1 minus top-2 score and the gap
    between the k-th and (k+1)-th logit (candidate-set stability)."""
    k = sel.top_k
    unary, cand = torch.topk(logits, k, dim=-1, sorted=False)
    hp = sel.hidden_projection(hidden)
    prev = anchor
    margins, kgaps, path = [], [], []
    srt = logits.sort(dim=-1, descending=True).values
    for p in range(hidden.shape[1]):
        sc = unary[:, p] + torch.einsum(
            "br,bkr->bk", sel.predecessor_codebook(prev) * hp[:, p], sel.successor_codebook(cand[:, p]))
        t2 = sc[0].topk(min(2, k)).values
        margins.append(float(t2[0] - t2[1]) if k > 1 else float("inf"))
        if k < logits.shape[-1]:
            kgaps.append(float(srt[0, p, k - 1] - srt[0, p, k]))
        idx = sc.argmax(-1)
        chosen = cand[:, p].gather(-1, idx[:, None])[:, 0]
        # The candidate set matters only where a near tie at its boundary could change the
        # choice: the chosen id is the k-th largest logit, or the (k+1)-th would win the walk.
        if k < logits.shape[-1]:
            order = logits[0, p].argsort(descending=True)
            nxt = order[k : k + 1]
            s_next = logits[0, p, nxt] + torch.einsum(
                "br,bkr->bk", sel.predecessor_codebook(prev) * hp[:, p], sel.successor_codebook(nxt[None]))
            at_edge = int(chosen[0]) == int(order[k - 1]) or float(s_next[0, 0]) > float(sc[0].max())
            kgaps.append(float(srt[0, p, k - 1] - srt[0, p, k]) if at_edge else float("inf"))
        prev = chosen
        path.append(int(prev[0]))
    return path, min(margins), min(kgaps) if kgaps else float("inf")


def run_reference(dm, torch, draft, target, prompt, max_new, stop=None, block_size=None):
    rec_t, rec_d, rec_p = [], [], []

    def t_hook(_m, args, kwargs, out):
        ids = args[0] if args else kwargs["input_ids"]
        rec_t.append({
            "ids": ids[0].tolist(),
            "positions": kwargs["position_ids"][0].tolist(),
            "logits": out.logits[0].detach().clone(),
            "hidden": None if out.hidden_states is None else [h[0].detach().clone() for h in out.hidden_states],
        })

    def d_hook(_m, _args, kwargs, out):
        rec_d.append({
            "positions": kwargs["position_ids"][0].tolist(),
            "ctx_len": int(kwargs["target_hidden"].shape[1]),
            "target_hidden": kwargs["target_hidden"][0].detach().clone(),
            "out": out[0].detach().clone(),
        })

    orig_propose = draft.propose

    def propose(hidden, anchor_ids, head, temperature):
        tokens, cand, q = orig_propose(hidden, anchor_ids, head, temperature)
        logits = draft.compute_logits(hidden, head)
        path, m, kg = walk_margins(draft.candidate_selector, hidden, logits, anchor_ids, torch)
        assert path == tokens[0].tolist(), (path, tokens)
        rec_p.append({
            "hidden": hidden[0].detach().clone(),
            "logits": logits[0].detach().clone(),
            "path": tokens[0].tolist(),
            "argmax": logits[0].argmax(-1).tolist(),
            "walk_margin": m,
            "topk_gap": kg,
        })
        return tokens, cand, q

    h1 = target.register_forward_hook(t_hook, with_kwargs=True)
    h2 = draft.register_forward_hook(d_hook, with_kwargs=True)
    draft.propose = propose
    try:
        res = dm.dflash_generate(draft, target, prompt[None], max_new, stop, 0.0,
                                 block_size=block_size, return_stats=True)
    finally:
        h1.remove()
        h2.remove()
        del draft.propose

    P = prompt.shape[0]
    bs = draft.block_size if block_size is None else block_size
    gen = res.output_ids[0].tolist()[P:]
    pre = rec_t[0]
    verify = [{"ids": r["ids"], "positions": r["positions"], "posterior": r["logits"].argmax(-1).tolist()}
              for r in rec_t[1:]]
    drafts = [{"positions": d["positions"], "ctx_len": d["ctx_len"], "draft_ids": rec_p[i]["path"]}
              for i, d in enumerate(rec_d)]
    steps, committed = build_steps(P, max_new, bs, verify, drafts, stop)
    assert [gen[0]] + committed == gen
    assert [s["produced"] for s in steps] == list(res.acceptance_lengths)
    vmargin = float("inf")
    for s, r in zip(steps, rec_t[1:]):
        top2 = r["logits"][: s["accepted"] + 1].topk(2, dim=-1).values
        vmargin = min(vmargin, float((top2[:, 0] - top2[:, 1]).min()))
    top2 = pre["logits"][-1].topk(2).values
    vmargin = min(vmargin, float(top2[0] - top2[1]))
    wmargin = min((p["walk_margin"] for p in rec_p), default=float("inf"))
    kgap = min((p["topk_gap"] for p in rec_p), default=float("inf"))
    overruled = sum(sum(int(a != b) for a, b in zip(p["path"], p["argmax"])) for p in rec_p)
    return dict(gen=gen, steps=steps, res=res, rec_t=rec_t, rec_d=rec_d, rec_p=rec_p, vmargin=vmargin,
                wmargin=wmargin, kgap=kgap, overruled=overruled, bs=bs)


def build_draft(dm, gt, torch, draft_cfg, seed):
    import tempfile

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as td:
        mdg.write_draft_config(td, draft_cfg)
        cfg = AutoConfig.from_pretrained(td)
    torch.manual_seed(seed)
    draft = dm.DFlash2DraftModel(cfg).to(torch.float32).eval()
    gt.reinit_(draft, seed)
    with torch.no_grad():
        draft.candidate_selector.predecessor_codebook.weight.mul_(CODEBOOK_GAIN)
        draft.candidate_selector.successor_codebook.weight.mul_(CODEBOOK_GAIN)
    return draft


def make_case(dm, gt, torch, idx, name, case, out_root, vers, conv_stats):
    from safetensors.torch import save_file

    t0 = time.time()
    V = case["target"]["vocab_size"]
    mask_id = case["mask_token_id"]
    N = case["max_new_tokens"]
    prompt = mdg.make_prompt(torch, V, mask_id, case["prompt_len"], 5252 + idx)
    spelling = case["target_spelling"]
    drop_hd = case.get("target_drop_head_dim", False)

    best, tried = None, []
    for cand in candidate_grid():
        target = gt.build_target(case["target_cls"], case["target"], 200 + cand["seed"])
        mdg.boost_target(torch, target, mask_id, cand)
        draft = build_draft(dm, gt, torch, case["draft"], 300 + cand["seed"])
        r = run_reference(dm, torch, draft, target, prompt, N)
        g, gm = mdg.greedy(torch, target, prompt, N)
        # Target argmaxes need MIN_MARGIN (as in the DFlash goldens); the selector's choices a
        # fifth of it (its scores are sums of a few products: f32 rounding differs by ~1e-6).
        m = min(gm, r["vmargin"], 5 * r["wmargin"], 5 * r["kgap"])
        sc = score(r["steps"], r["bs"], r["gen"] == g, m, r["gen"])
        # the selector must overrule the argmax somewhere, else it is not being tested
        sc = sc[:2] + (int(r["overruled"] > 0),) + sc[2:]
        tried.append({**cand, "score": list(sc), "overruled": r["overruled"]})
        if best is None or sc > best[0]:
            best = (sc, cand)
        if (sc[:4] == (1, 1, 1, 3) and sc[4] >= 3 and sc[5] >= 4 and sc[6] >= 6) or time.time() - t0 > 240:
            break
    sc, cand = best
    print(f"[{name}] selected {cand} score={sc} ({len(tried)} tried, {time.time() - t0:.1f}s)", flush=True)

    d = os.path.join(out_root, "dflash2", name)
    target = gt.build_target(case["target_cls"], case["target"], 200 + cand["seed"])
    boosted = mdg.boost_target(torch, target, mask_id, cand)
    target, tinfo = gt.save_target(target, os.path.join(d, "target"), spelling, drop_hd)
    draft_mem = build_draft(dm, gt, torch, case["draft"], 300 + cand["seed"])
    ddir = os.path.join(d, "draft")
    mdg.write_draft_config(ddir, case["draft"])
    sd = {k: v.detach().contiguous() for k, v in draft_mem.state_dict().items()}
    # The published checkpoints name the codebooks without `.weight` (the reference's
    # from_pretrained maps them back): store them that way.
    for cb in ("predecessor_codebook", "successor_codebook"):
        sd[f"candidate_selector.{cb}"] = sd.pop(f"candidate_selector.{cb}.weight")
    save_file(sd, os.path.join(ddir, "model.safetensors"), metadata={"format": "pt"})
    draft = dm.DFlash2DraftModel.from_pretrained(ddir, attn_implementation="sdpa", dtype=torch.float32).eval()
    sd2 = draft.state_dict()
    for k, v in draft_mem.state_dict().items():
        assert torch.equal(v, sd2[k]), k
    taps = list(draft.target_layer_ids)

    r = run_reference(dm, torch, draft, target, prompt, N)
    gen, steps = r["gen"], r["steps"]
    g, gm = mdg.greedy(torch, target, prompt, N)
    stop_info = None
    ch = choose_stop_variant(gen, steps, prompt.shape[0], min_index=2)
    if ch is not None:
        tok, j, inside = ch
        rs = run_reference(dm, torch, draft, target, prompt, N, stop=[tok])
        stop_info = {
            "stop_token_ids": [tok],
            "first_stop_generated_index": j,
            "cut_inside_accepted_run": inside,
            "output_ids": rs["gen"],
            "expected_output_ids": gen[: j + 1],
            "equals_expected": rs["gen"] == gen[: j + 1],
            "acceptance_lengths": list(rs["res"].acceptance_lengths),
        }

    pre = r["rec_t"][0]
    ctx_prefill = torch.cat([pre["hidden"][k + 1] for k in taps], dim=-1)
    assert torch.equal(ctx_prefill, r["rec_d"][0]["target_hidden"])
    n_draft = len(r["rec_p"])
    tensors = {
        "prompt_ids": prompt.clone(),
        "output_ids": torch.tensor(gen, dtype=torch.long),
        "target_ctx_prefill": ctx_prefill.float().contiguous(),
        "draft_rows_step0": r["rec_p"][0]["hidden"].float().contiguous(),
        "draft_logits_step0": r["rec_p"][0]["logits"].float().contiguous(),
        "draft_logits_step1": r["rec_p"][min(1, n_draft - 1)]["logits"].float().contiguous(),
        "draft_logits_last": r["rec_p"][n_draft - 1]["logits"].float().contiguous(),
    }
    save_file(tensors, os.path.join(d, "trace.safetensors"), metadata={"format": "pt"})
    for s, p in zip(steps, r["rec_p"]):
        s["selector_path"] = p["path"]
        s["logits_argmax"] = p["argmax"]
    accs = [s["accepted"] for s in steps]
    trace = {
        "case": name,
        "architecture": "DFlash2DraftModel",
        "temperature": 0.0,
        "block_size": r["bs"],
        "mask_token_id": mask_id,
        "target_layer_ids": taps,
        "max_new_tokens": N,
        "prompt_ids": prompt.tolist(),
        "output_ids": gen,
        "greedy_ids": g,
        "output_equals_greedy": gen == g,
        "first_token": gen[0],
        "steps": steps,
        "acceptance_lengths": list(r["res"].acceptance_lengths),
        "tau": sum(s["produced"] for s in steps) / max(1, len(steps)),
        "selector_rows_overruling_argmax": r["overruled"],
        "min_greedy_top2_margin": gm,
        "min_verify_top2_margin": r["vmargin"],
        "min_walk_top2_margin": r["wmargin"],
        "min_topk_boundary_gap": r["kgap"],
        "margin_floor": MIN_MARGIN,
        "stop_variant": stop_info,
        "draft_layers_effective": [
            {"layer": i, "is_causal": bool(l.self_attn.is_causal), "sliding_window": l.self_attn.sliding_window}
            for i, l in enumerate(draft.layers)
        ],
        "dflash2": {k: int(dm._draft_value(draft.config, k)) for k in
                    ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")},
        "codebook_gain": CODEBOOK_GAIN,
        "reference_patch": {
            "what": "_grouped_dynamic_convolve: offsets >= block rows contribute nothing (the original raises)",
            "calls_so_far": dict(conv_stats),
        },
        "draft_weight_names": sorted(sd.keys()),
        "target_weight_names": tinfo["tensor_names"],
        "low_entropy": {"boosted_token_ids": boosted, "boost": cand["boost"], "seed": cand["seed"],
                        "selection_score": list(sc), "candidates_tried": len(tried)},
        "tensors": {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in tensors.items()},
        "versions": vers,
        "notes": (
            "Recorded from dflash.model.dflash_generate (temperature 0) on CPU float32 with the models "
            "loaded from target/ and draft/ (DFlash2DraftModel.from_pretrained). steps as in the DFlash "
            "goldens; block_ids[1:] = selector_path (the candidate selector's greedy walk), logits_argmax "
            "= each row's argmax for comparison. draft_rows_step0 = the draft's final-normed rows 1..Q-1 "
            "of the first call (the selector's input); draft_logits_* = compute_logits of those rows."
        ),
    }
    write_json(os.path.join(d, "trace.json"), trace)
    print(f"[{name}] bs={r['bs']} accepted={accs} tau={trace['tau']:.2f} out==greedy={gen == g} "
          f"overruled={r['overruled']} margins g={gm:.4f} v={r['vmargin']:.4f} w={r['wmargin']:.4f} "
          f"k={r['kgap']:.4f} conv={conv_stats} ({time.time() - t0:.1f}s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None)
    args = ap.parse_args()
    import torch

    import gold_torch as gt

    gt.setup()
    import dflash.model as dm

    dm._cuda_time = time.perf_counter
    conv_stats = patch_convolve(dm, torch)
    vers = versions()
    failed = []
    for idx, (name, case) in enumerate(cases().items()):
        if args.only and name not in args.only.split(","):
            continue
        try:
            make_case(dm, gt, torch, idx, name, case, args.out, vers, conv_stats)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            failed.append(name)
    if failed:
        print("FAILED cases:", failed, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
