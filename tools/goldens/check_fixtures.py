#!/usr/bin/env python3
"""Torch-free consistency check of the committed fixtures.

python3 tools/goldens/check_fixtures.py [crates/dflash/tests/fixtures]
Reads safetensors headers (shapes / dtypes), re-derives every step of each trace.json from its
block_ids / posterior_ids with the temperature-0 rule, and checks output_ids against greedy_ids.
"""

from __future__ import annotations

import json
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gold_common import leading_accept  # noqa: E402

DT = {"F32": "float32", "I64": "int64"}


def header(path: str) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return {k: (DT.get(v["dtype"], v["dtype"]), v["shape"]) for k, v in h.items()}


def check_target(d: str) -> None:
    g = json.load(open(os.path.join(d, "golden.json")))
    cfg = json.load(open(os.path.join(d, "config.json")))
    h = header(os.path.join(d, "golden.safetensors"))
    for k, (dt, shape) in g["tensors"].items():
        assert h[k] == (dt, shape), (d, k, h[k], dt, shape)
    assert set(h) == set(g["tensors"]), (d, set(h) ^ set(g["tensors"]))
    L = cfg["num_hidden_layers"]
    assert g["taps"] == [0, L - 2]
    w = header(os.path.join(d, "model.safetensors"))
    assert all(dt == "float32" for dt, _ in w.values())
    assert ("lm_head.weight" in w) == (not cfg.get("tie_word_embeddings", False)), d
    print(f"ok {d}: taps={g['taps']} weights={len(w)} tied={cfg.get('tie_word_embeddings')}")


def check_case(d: str) -> None:
    t = json.load(open(os.path.join(d, "trace.json")))
    h = header(os.path.join(d, "trace.safetensors"))
    for k, (dt, shape) in t["tensors"].items():
        assert h[k] == (dt, shape), (d, k)
    P, N, Q = len(t["prompt_ids"]), t["max_new_tokens"], t["block_size"]
    max_length = P + N
    out = [t["first_token"]]
    start = P
    for i, s in enumerate(t["steps"]):
        assert s["start"] == start, (i, s["start"], start)
        q = s["verify_size"]
        assert q == min(Q, max_length - start) == len(s["block_ids"]) == len(s["posterior_ids"])
        assert s["block_ids"][0] == out[-1]
        a = leading_accept(s["block_ids"], s["posterior_ids"])
        assert a == s["accepted"] and s["bonus"] == s["posterior_ids"][a]
        produced = min(a + 1, max_length - start - 1)
        assert produced == s["produced"]
        assert s["ctx_len"] == (P if i == 0 else t["steps"][i - 1]["produced"])
        assert s["ctx_start"] == start - s["ctx_len"]
        out += (s["block_ids"][1 : a + 1] + [s["bonus"]])[:produced]
        start += produced
    assert out == t["output_ids"], d
    assert len(out) == N
    assert t["output_equals_greedy"] == (t["output_ids"] == t["greedy_ids"])
    assert [s["produced"] for s in t["steps"]] == t["acceptance_lengths"]
    dl = h["draft_logits_step0"][1]
    assert dl == [t["steps"][0]["verify_size"] - 1, 256], dl
    sv = t["stop_variant"]
    if sv:
        assert sv["output_ids"] == sv["expected_output_ids"] == t["output_ids"][: sv["first_stop_generated_index"] + 1]
    draft_cfg = json.load(open(os.path.join(d, "draft", "config.json")))
    dw = header(os.path.join(d, "draft", "model.safetensors"))
    assert sorted(dw) == t["draft_weight_names"]
    K = len(t["target_layer_ids"])
    assert dw["fc.weight"][1] == [draft_cfg["hidden_size"], K * draft_cfg["hidden_size"]]
    hist = {}
    for s in t["steps"]:
        hist[s["accepted"]] = hist.get(s["accepted"], 0) + 1
    print(f"ok {d}: block={Q} steps={len(t['steps'])} accepted_hist={dict(sorted(hist.items()))} "
          f"tau={t['tau']:.2f} out==greedy={t['output_equals_greedy']} stop_variant={bool(sv)} "
          f"min_margin={min(t['min_greedy_top2_margin'], t['min_verify_top2_margin']):.4f}")


def main() -> None:
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "crates", "dflash", "tests", "fixtures")
    root = os.path.normpath(root)
    for name in sorted(os.listdir(os.path.join(root, "targets"))):
        check_target(os.path.join(root, "targets", name))
    for name in sorted(os.listdir(os.path.join(root, "dflash"))):
        check_case(os.path.join(root, "dflash", name))
    total = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(root) for f in fs)
    print(f"all fixtures consistent; {total} bytes")


if __name__ == "__main__":
    main()
