#!/usr/bin/env python3
"""Make a DFlash2 draft from a DFlash draft directory (random-weight benchmarks): the same
layers plus, per layer, the two grouped dynamic causal convolutions and the candidate selector,
with the published z-lab/Qwen3.8-27B-DFlash2 sizes by default (kernel 2, group 16, rank 256,
top-16). Random values at the scales of a trained draft are irrelevant to timing; the base
kernels start as the identity so the draft still proposes what the DFlash one does.

Usage: make_dflash2.py SRC_DIR DST_DIR [--kernel 2 --group 16 --rank 256 --top-k 16]
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

ap = argparse.ArgumentParser()
ap.add_argument("src")
ap.add_argument("dst")
ap.add_argument("--kernel", type=int, default=2)
ap.add_argument("--group", type=int, default=16)
ap.add_argument("--rank", type=int, default=256)
ap.add_argument("--top-k", type=int, default=16)
a = ap.parse_args()
os.makedirs(a.dst, exist_ok=True)
cfg = json.load(open(os.path.join(a.src, "config.json")))
cfg["architectures"] = ["DFlash2DraftModel"]
dc = cfg.setdefault("dflash_config", {})
dc.update(conv_kernel_size=a.kernel, conv_group_size=a.group, selector_rank=a.rank,
          selector_top_k=a.top_k)
json.dump(cfg, open(os.path.join(a.dst, "config.json"), "w"), indent=2)
w = load_file(os.path.join(a.src, "model.safetensors"))
dt = next(iter(w.values())).dtype
h, L, V = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
g = torch.Generator().manual_seed(0)
for i in range(L):
    for conv in ("attention_conv", "mlp_conv"):
        base = torch.zeros(2, a.kernel, h)
        base[:, 0] = 1.0
        base[:, 1:] = torch.randn(2, a.kernel - 1, h, generator=g) * 0.05
        w[f"layers.{i}.{conv}.base_kernel"] = base.to(dt)
        w[f"layers.{i}.{conv}.kernel_projection.weight"] = (
            torch.randn(2 * a.kernel * (h // a.group), h, generator=g) * 0.01).to(dt)
w["candidate_selector.predecessor_codebook"] = (torch.randn(V, a.rank, generator=g) * 0.05).to(dt)
w["candidate_selector.successor_codebook"] = (torch.randn(V, a.rank, generator=g) * 0.05).to(dt)
w["candidate_selector.hidden_projection.weight"] = (torch.randn(a.rank, h, generator=g) * 0.02).to(dt)
save_file({k: v.contiguous() for k, v in w.items()}, os.path.join(a.dst, "model.safetensors"),
          metadata={"format": "pt"})
for f in os.listdir(a.src):
    if f not in ("config.json", "model.safetensors"):
        p = os.path.join(a.src, f)
        if os.path.isfile(p):
            shutil.copy(p, a.dst)
print("dflash2 draft:", a.dst, {k: dc[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")})
