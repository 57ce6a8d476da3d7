#!/usr/bin/env python3
"""Checks of the torch-free logic in gold_common.py (runs anywhere: python3 selftest.py)."""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gold_common import (  # noqa: E402
    build_steps,
    candidate_grid,
    choose_stop_variant,
    dflash_cases,
    leading_accept,
    normalized_rope,
    rewrite_config_spelling,
    score,
    target_configs,
)


def fake_target(seq):
    """Deterministic 'greedy target': next id from the last two ids (small alphabet)."""
    return (seq[-1] * 7 + (seq[-2] if len(seq) > 1 else 0) * 3 + 1) % 5


def simulate_reference(prompt, max_new, block, draft_quality, stop=None, seed=0):
    """Python re-statement of dflash_generate at T=0 with fake models; returns the recorded
    calls in the same shape make_dflash_goldens records them, and the final output."""
    rng = random.Random(seed)
    P = len(prompt)
    max_length = P + max_new
    out = list(prompt) + [fake_target(prompt)]
    start = P
    ctx_len = P
    verify_calls, draft_calls, produced_list = [], [], []
    stopped = stop is not None and out[start] in stop
    while start + 1 < max_length and not stopped:
        q = min(block, max_length - start)
        blk = [out[start]]
        # draft: proposes the true continuation with probability draft_quality, else garbage
        seq = list(out[: start + 1])
        for _ in range(q - 1):
            t = fake_target(seq)
            if rng.random() > draft_quality:
                t = (t + 1) % 5
            blk.append(t)
            seq.append(t)
        if q > 1:
            draft_calls.append({"positions": list(range(start - ctx_len, start + q)), "ctx_len": ctx_len,
                                "draft_ids": blk[1:]})
        post = []
        seq = list(out[:start])
        for i in range(q):
            seq.append(blk[i])
            post.append(fake_target(seq))
        verify_calls.append({"ids": blk, "positions": list(range(start, start + q)), "posterior": post})
        a = leading_accept(blk, post)
        new = blk[1 : a + 1] + [post[a]]
        produced = min(a + 1, max_length - start - 1)
        if stop is not None:
            for j, t in enumerate(new[:produced]):
                if t in stop:
                    produced = j + 1
                    stopped = True
                    break
        out = out[: start + 1] + new[:produced]
        start += produced
        ctx_len = produced
        produced_list.append(produced)
    return out[P:], verify_calls, draft_calls, produced_list


def greedy_fake(prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(fake_target(seq))
    return seq[len(prompt):]


def main():
    # spelling rewrite
    tc = target_configs()
    for name, spec in tc.items():
        written = dict(spec["config"])
        written["architectures"] = [spec["cls"]]
        cfg = rewrite_config_spelling(written, spec["spelling"], spec["drop_head_dim"])
        if spec["spelling"] == "tf5":
            assert "rope_parameters" in cfg and "rope_theta" not in cfg and "rope_scaling" not in cfg
        else:
            assert "rope_parameters" not in cfg and "rope_theta" in cfg
        rebuilt = dict(cfg.get("rope_scaling") or {})
        rebuilt["rope_theta"] = cfg.get("rope_theta")
        if spec["spelling"] != "tf5":
            rebuilt.setdefault("rope_type", rebuilt.get("type", "default"))
            assert normalized_rope(rebuilt) == normalized_rope(spec["config"]["rope_parameters"]), name
        assert ("head_dim" in cfg) == (not spec["drop_head_dim"] and "head_dim" in written)
        print(name, {k: cfg[k] for k in cfg if k.startswith("rope")})
    legacy = rewrite_config_spelling(dict(tc["llama_linear_tied"]["config"]), "tf4_legacy_type")
    assert legacy["rope_scaling"] == {"type": "linear", "factor": 2.0}, legacy["rope_scaling"]
    assert "rope_scaling" not in rewrite_config_spelling(dict(tc["qwen3"]["config"]), "tf4")

    # acceptance
    assert leading_accept([9, 1, 2, 3], [1, 2, 7, 5]) == 2
    assert leading_accept([9, 1, 2, 3], [0, 2, 3, 5]) == 0
    assert leading_accept([9, 1, 2, 3], [1, 2, 3, 5]) == 3

    # loop reconstruction vs a Python re-statement of the reference loop
    n_cases = 0
    for seed in range(200):
        rng = random.Random(seed)
        prompt = [rng.randrange(5) for _ in range(rng.randrange(2, 9))]
        max_new = rng.randrange(1, 40)
        block = rng.choice([1, 2, 4, 8, 16])
        quality = rng.choice([0.0, 0.5, 0.9, 1.0])
        stop = [rng.randrange(5)] if rng.random() < 0.3 else None
        gen, vc, dc, produced = simulate_reference(prompt, max_new, block, quality, stop, seed)
        steps, committed = build_steps(len(prompt), max_new, block, vc, dc, stop)
        assert [gen[0]] + committed == gen
        assert [s["produced"] for s in steps] == produced
        g = greedy_fake(prompt, max_new)
        if stop is None:
            assert gen == g, (gen, g)
            assert len(gen) == max_new
        else:
            cut = next((i for i, t in enumerate(g) if t in stop), None)
            assert gen == (g if cut is None else g[: cut + 1]), (gen, g, stop)
        if stop is None and block > 1 and len(gen) > 8:
            ch = choose_stop_variant(gen, steps, len(prompt))
            if ch is not None:
                tok, j, inside = ch
                assert tok not in gen[:j] and gen[j] == tok
                g2, vc2, dc2, _ = simulate_reference(prompt, max_new, block, quality, [tok], seed)
                assert g2 == gen[: j + 1]
        n_cases += 1
    print("simulated loops:", n_cases)

    # cases sanity
    for name, c in dflash_cases().items():
        d = c["draft"]
        assert c["mask_token_id"] < d["vocab_size"]
        L = c["target"]["num_hidden_layers"]
        taps = d["dflash_config"]["target_layer_ids"]
        assert all(0 <= k <= L - 2 for k in taps), (name, taps)
        assert d["hidden_size"] == c["target"]["hidden_size"]
        bs = d["dflash_config"].get("block_size", d.get("block_size"))
        assert bs == c["block_size"], name
        print(name, "taps", taps, "block", bs, "layers", d["num_hidden_layers"], d.get("layer_types"))
    print("grid size", len(candidate_grid()))
    s1 = score([{"accepted": 0, "verify_size": 4}, {"accepted": 3, "verify_size": 4},
                {"accepted": 1, "verify_size": 4}], 4, True, 0.5, [1, 2, 3])
    s2 = score([{"accepted": 0, "verify_size": 4}], 4, True, 0.5, [1, 2, 3])
    assert s1 > s2
    print("selftest OK")


if __name__ == "__main__":
    main()
