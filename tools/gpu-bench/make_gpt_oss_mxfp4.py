"""A random-weight checkpoint in gpt-oss's published layout: MXFP4 routed experts
(`*_blocks` uint8 [E, rows, cols / 32, 16], `*_scales` uint8 [E, rows, cols / 32], bf16 biases),
everything else bf16, `quantization_config: {quant_method: mxfp4}`; the shapes of
openai/gpt-oss-120b (36 layers, 128 experts, top 4) or -20b (--published 20b). One safetensors
shard per layer plus the index, written with torch on the GPU (random bytes; scales near 2^-7 so
activations stay O(1)). gpt-oss-120b's ~65 GB do not fit the device machine's disk: write it to
/dev/shm (host memory; the loader's memory map shares those pages).

    python3 make_gpt_oss_mxfp4.py OUT_DIR [--published 120b|20b] [--layers N] [--twin DIR]

--twin DIR also writes the same model with the experts dequantized (exactly) to bf16 in
transformers' float layout (gate_up_proj [E, H, 2I], down_proj [E, I, H]): the bf16 baseline.
"""
import argparse
import json
import os
import time

import torch
from safetensors.torch import save_file
from spill import shard_path

SHAPES = {
    "120b": dict(num_hidden_layers=36, num_local_experts=128),
    "20b": dict(num_hidden_layers=24, num_local_experts=32),
}


def config(published, layers):
    c = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880,
             intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
             vocab_size=201088, num_experts_per_tok=4, experts_per_token=4, sliding_window=128,
             attention_bias=True, swiglu_limit=7.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
             max_position_embeddings=131072, torch_dtype="bfloat16",
             rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "truncate": False, "original_max_position_embeddings": 4096},
             rope_theta=150000.0, quantization_config={"quant_method": "mxfp4"},
             eos_token_id=200002, pad_token_id=199999)
    c.update(SHAPES[published])
    if layers:
        c["num_hidden_layers"] = layers
    n = c["num_hidden_layers"]
    c["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--published", default="120b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--twin", default="")
    a = ap.parse_args()
    t0 = time.time()
    os.makedirs(a.out, exist_ok=True)
    c = config(a.published, a.layers)
    h, i, e = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    nh, nkv, hd, v = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["vocab_size"]
    n = c["num_hidden_layers"]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def normal(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device=dev) * std).to(torch.bfloat16).cpu()

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, device=dev, dtype=torch.uint8)

    def scales(*shape):
        return torch.randint(119, 122, shape, generator=g, device=dev, dtype=torch.uint8)

    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], device=dev)

    def dequant(q, s):
        """[E, rows, G, 16] codes, [E, rows, G] scales -> [E, rows, 32 G] f32 (exact)."""
        lo, hi = (q & 15).long(), (q >> 4).long()
        vals = torch.stack([lut[lo], lut[hi]], dim=-1).flatten(-2)  # value 2j, 2j + 1
        vals = vals * torch.exp2(s.float() - 127.0)[..., None]
        return vals.flatten(-2)

    if a.twin:
        os.makedirs(a.twin, exist_ok=True)

    shards = n + 1
    maps = {a.out: {}, a.twin: {}}
    totals = {a.out: 0, a.twin: 0}

    def save(tensors, k, out=a.out):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {key: t.cpu().contiguous() for key, t in tensors.items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, shard_path(out, name, nbytes), metadata={"format": "pt"})
        for key, t in tensors.items():
            maps[out][key] = name
            totals[out] += t.numel() * t.element_size()

    for l in range(n):
        p = f"model.layers.{l}"
        t = {
            f"{p}.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}.self_attn.q_proj.weight": normal(nh * hd, h),
            f"{p}.self_attn.q_proj.bias": normal(nh * hd),
            f"{p}.self_attn.k_proj.weight": normal(nkv * hd, h),
            f"{p}.self_attn.k_proj.bias": normal(nkv * hd),
            f"{p}.self_attn.v_proj.weight": normal(nkv * hd, h),
            f"{p}.self_attn.v_proj.bias": normal(nkv * hd),
            f"{p}.self_attn.o_proj.weight": normal(h, nh * hd),
            f"{p}.self_attn.o_proj.bias": normal(h),
            f"{p}.self_attn.sinks": normal(nh, std=1.0),
            f"{p}.mlp.router.weight": normal(e, h),
            f"{p}.mlp.router.bias": normal(e),
            f"{p}.mlp.experts.gate_up_proj_blocks": codes(e, 2 * i, h // 32, 16),
            f"{p}.mlp.experts.gate_up_proj_scales": scales(e, 2 * i, h // 32),
            f"{p}.mlp.experts.gate_up_proj_bias": normal(e, 2 * i),
            f"{p}.mlp.experts.down_proj_blocks": codes(e, h, i // 32, 16),
            f"{p}.mlp.experts.down_proj_scales": scales(e, h, i // 32),
            f"{p}.mlp.experts.down_proj_bias": normal(e, h),
        }
        if a.twin:
            x = f"{p}.mlp.experts."
            f = {key: val for key, val in t.items() if not key.endswith(("_blocks", "_scales"))}
            gu = dequant(t[x + "gate_up_proj_blocks"], t[x + "gate_up_proj_scales"])  # [E, 2I, H]
            dn = dequant(t[x + "down_proj_blocks"], t[x + "down_proj_scales"])  # [E, H, I]
            f[x + "gate_up_proj"] = gu.transpose(1, 2).to(torch.bfloat16)
            f[x + "down_proj"] = dn.transpose(1, 2).to(torch.bfloat16)
            del gu, dn
            save(f, l, a.twin)
        save(t, l)
        print(f"layer {l} written, {time.time() - t0:.0f}s", flush=True)
    last = {
        "model.embed_tokens.weight": normal(v, h),
        "lm_head.weight": normal(v, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    for out in [a.out] + ([a.twin] if a.twin else []):
        save(last, n, out)
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": totals[out]}, "weight_map": maps[out]}, f)
        cfg = dict(c)
        if out == a.twin:
            del cfg["quantization_config"]
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        print(f"{out}: {a.published} layout, {n} layers, {e} experts: {totals[out] / 1e9:.2f} GB "
              f"in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
