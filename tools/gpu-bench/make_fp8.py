"""An FP8 block-quantized copy of a float safetensors checkpoint (the DeepSeek-V3 / Qwen `-FP8`
layout): every 2-D `*.weight` of a linear layer (attention, MLP; not the embedding table, the
norms or the LM head, which those checkpoints keep in bf16) becomes float8 e4m3 with
`.weight_scale_inv` (f32, one per block: amax / 448); config.json gets `quantization_config:
{quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [B, B]}`.
Run on the device machine (torch, GPU):

    python3 make_fp8.py SRC_DIR DST_DIR [--block 128]
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def quantize(w: torch.Tensor, b: int):
    n, k = w.shape
    sn, sk = -(-n // b), -(-k // b)
    pad = torch.zeros(sn * b, sk * b, device=w.device, dtype=torch.float32)
    pad[:n, :k] = w.float()
    blocks = pad.reshape(sn, b, sk, b)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).reshape(sn * b, sk * b)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale.float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--block", type=int, default=128)
    a = ap.parse_args()
    os.makedirs(a.dst, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n_q = 0
    for f in sorted(os.listdir(a.src)):
        p = os.path.join(a.src, f)
        if f.endswith(".safetensors"):
            t = load_file(p)
            out = {}
            for name, w in t.items():
                linear = (name.endswith(".weight") and w.dim() == 2 and "embed_tokens" not in name
                          and "norm" not in name and not name.startswith("lm_head"))
                if not linear:
                    out[name] = w
                    continue
                q, s = quantize(w.to(dev), a.block)
                out[name] = q.cpu().contiguous()
                out[name + "_scale_inv"] = s.cpu().contiguous()
                n_q += 1
            save_file(out, os.path.join(a.dst, f))
        elif f == "config.json":
            cfg = json.load(open(p))
            cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                          "activation_scheme": "dynamic",
                                          "weight_block_size": [a.block, a.block]}
            json.dump(cfg, open(os.path.join(a.dst, f), "w"), indent=1)
        elif f.endswith(".index.json"):
            idx = json.load(open(p))
            wm = idx.get("weight_map", {})
            for name in list(wm):
                if (name.endswith(".weight") and "embed_tokens" not in name and "norm" not in name
                        and not name.startswith("lm_head")):
                    wm[name + "_scale_inv"] = wm[name]
            json.dump(idx, open(os.path.join(a.dst, f), "w"), indent=1)
        elif os.path.isfile(p):
            shutil.copy(p, os.path.join(a.dst, f))
    print(f"{a.dst}: {n_q} matrices at fp8 e4m3 {a.block}x{a.block}", flush=True)


if __name__ == "__main__":
    main()
