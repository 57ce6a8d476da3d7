#!/usr/bin/env python3
"""Make the models (models.py) and time the PyTorch side on them, in one process:
  - the authors' reference `dflash.model.dflash_generate` (PyPI dflash 0.1.0) with each draft,
    and with block_size=1 (its own plain-decoding loop);
  - transformers `generate` (greedy) as the everyday baseline;
  - the copy bandwidth (for the HBM floor).
Writes <out>/reference.json. The models are saved to <models> for the Rust engine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models as M  # noqa: E402


def sync(torch, dev):
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(torch, dev):
    if not dev.startswith("cuda"):
        return None
    n = 2 << 30  # 2 GiB per buffer, several times the L2
    a = torch.empty(n, dtype=torch.uint8, device=dev).random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(ts)  # bytes read + written per second


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models-only", action="store_true",
                    help="only make the model files (keeps the previous reference.json)")
    a = ap.parse_args()

    import torch
    import transformers
    import dflash.model as dm

    if not a.device.startswith("cuda"):
        dm._cuda_time = time.perf_counter
    res = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__},
           "shape": a.shape, "max_new": a.max_new, "prompt_len": a.prompt_len}
    res["copy_bandwidth_Bps"] = copy_bandwidth(torch, a.device)

    target, draft = M.build(a.shape, a.device, a.dtype)
    M.save(target, draft, a.models, ["agree", "zero"])
    s = M.SHAPES[a.shape]
    n_params = sum(p.numel() for p in target.parameters())
    emb = target.model.embed_tokens.weight.numel()
    res["target_params"] = n_params
    res["weight_bytes_all"] = n_params * target.model.embed_tokens.weight.element_size()
    res["weight_bytes_per_step"] = (n_params - emb) * target.model.embed_tokens.weight.element_size()

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size - 1000, (1, a.prompt_len), generator=g)
    with open(os.path.join(a.models, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"prompt_ids": ids[0].tolist()}) + "\n")
    if a.models_only:
        with open(os.path.join(a.out, "reference.json"), "w") as f:
            json.dump(res, f, indent=1)
        return
    ids = ids.to(a.device)

    def timed(fn):
        fn()  # warm-up
        out = []
        for _ in range(a.repeat):
            if a.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(torch, a.device)
            t = time.perf_counter()
            r = fn()
            sync(torch, a.device)
            out.append((time.perf_counter() - t, r))
        return out

    # transformers generate: greedy, exactly max_new tokens.
    runs = timed(lambda: target.generate(ids, max_new_tokens=a.max_new, min_new_tokens=a.max_new,
                                         do_sample=False, pad_token_id=0))
    dts = [dt for dt, _ in runs]
    res["hf_generate"] = {"total_s": statistics.median(dts),
                          "tok_s": a.max_new / statistics.median(dts),
                          "peak_bytes": torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else None}
    hf_out = runs[0][1][0, a.prompt_len:].tolist()

    rows = {}
    # (row, draft, temperature); "ar" is the reference's own loop at block size 1.
    plan = [("ar", "agree", 0.0), ("high", "agree", 0.0), ("mid", "agree", 1.0),
            ("zero", "zero", 0.0)]
    for mode, dmode, temp in plan:
        M.set_draft_mode(draft, dmode)
        bs = 1 if mode == "ar" else s["block"]
        torch.manual_seed(0)
        runs = timed(lambda: dm.dflash_generate(draft, target, ids, a.max_new, None,
                                                temperature=temp, block_size=bs,
                                                return_stats=True))
        st = [r for _, r in runs]
        tpot = statistics.median(r.time_per_output_token for r in st)
        acc = st[0].acceptance_lengths
        out = st[0].output_ids[0, a.prompt_len:].tolist()
        rows[mode] = {"tok_s": 1.0 / tpot, "ms_per_token": tpot * 1e3,
                      "ttft_ms": statistics.median(r.time_to_first_token for r in st) * 1e3,
                      "tau": sum(acc) / len(acc), "cycles": len(acc),
                      "ms_per_cycle": tpot * sum(acc) / len(acc) * 1e3,
                      "tokens": len(out), "temperature": temp,
                      "same_as_hf": out[: len(hf_out)] == hf_out[: len(out)] if temp == 0 else None,
                      "frac_a": out.count(M.TOKEN_A) / max(1, len(out)),
                      "peak_bytes": torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else None}
        print(mode, rows[mode], flush=True)
    res["reference"] = rows
    with open(os.path.join(a.out, "reference.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
