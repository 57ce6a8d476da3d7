"""An MLX affine-quantized copy of a float safetensors checkpoint (the mlx-community layout):
every 2-D `*.weight` of a linear layer (attention, MLP, LM head; not the embedding table or the
norms) becomes `.weight` (uint32 words, value i at bit i * bits, little-endian), `.scales` and
`.biases` (bf16, one per group of inputs); config.json gets `quantization: {group_size, bits}`
and `model.embed_tokens: false`. Affine per group: scale = (max - min) / (2^bits - 1), bias =
min, q = round((w - bias) / scale). Run on the device machine (torch, GPU):

    python3 make_mlx.py SRC_DIR DST_DIR [--bits 4] [--group 64]
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def quantize(w: torch.Tensor, bits: int, group: int):
    out, cols = w.shape
    g = w.float().reshape(out, cols // group, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8)
    scale_b, bias_b = scale.to(torch.bfloat16), lo.to(torch.bfloat16)
    q = torch.round((g - bias_b.float()) / scale_b.float()).clamp(0, 2**bits - 1).to(torch.int64)
    q = q.reshape(out, cols)
    per = 32 // bits
    q = q.reshape(out, cols // per, per)
    shifts = torch.arange(per, device=w.device, dtype=torch.int64) * bits
    words = (q << shifts).sum(-1)  # < 2^32
    words = words.to(torch.int64).bitwise_and(0xFFFFFFFF)
    # uint32 as int32 bits (safetensors/torch have no uint32 arithmetic on every version)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.view(torch.uint32), scale_b.squeeze(-1), bias_b.squeeze(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
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
                          and "norm" not in name and w.shape[1] % a.group == 0)
                if not linear:
                    out[name] = w
                    continue
                qw, s, b = quantize(w.to(dev), a.bits, a.group)
                m = name[: -len(".weight")]
                out[name] = qw.cpu().contiguous()
                out[m + ".scales"] = s.cpu().contiguous()
                out[m + ".biases"] = b.cpu().contiguous()
                n_q += 1
            save_file(out, os.path.join(a.dst, f), metadata={"format": "mlx"})
        elif f == "config.json":
            cfg = json.load(open(p))
            cfg["quantization"] = {"group_size": a.group, "bits": a.bits, "model.embed_tokens": False}
            json.dump(cfg, open(os.path.join(a.dst, f), "w"), indent=1)
        elif f.endswith(".index.json"):
            idx = json.load(open(p))
            wm = idx.get("weight_map", {})
            for name in list(wm):
                if name.endswith(".weight") and "embed_tokens" not in name and "norm" not in name:
                    m = name[: -len(".weight")]
                    wm[m + ".scales"] = wm[name]
                    wm[m + ".biases"] = wm[name]
            json.dump(idx, open(os.path.join(a.dst, f), "w"), indent=1)
        elif os.path.isfile(p):
            shutil.copy(p, os.path.join(a.dst, f))
    print(f"{a.dst}: {n_q} matrices at {a.bits}-bit g{a.group}", flush=True)


if __name__ == "__main__":
    main()
