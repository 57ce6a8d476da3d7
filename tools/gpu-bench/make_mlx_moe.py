"""A random-weight MLX 4-bit checkpoint of a Qwen3.5 MoE target in the layout mlx-lm writes:
the routed experts stacked per projection (`mlp.switch_mlp.{gate,up,down}_proj`, uint32 words
[E, rows, cols / 8] + bf16 `.scales` / `.biases` [E, rows, cols / 64]), every other linear
matrix 4-bit g64, the routers and shared-expert gates 8-bit g64 (mlx-lm's qwen3_5
`quant_predicate`), the embedding, norms, convolutions and gates bf16 (the embedding kept in
float by a `false` entry). Tensor names and shapes come from transformers' Qwen3_5MoeForCausalLM
built on the meta device, so nothing is allocated but one layer at a time. Shapes of
Qwen/Qwen3.5-122B-A10B (48 layers; hidden 3072, 256 experts of 1024, top 8) or -35B-A3B.

One safetensors shard per layer plus the index, written with torch on the GPU: random words,
scales near 2^-8 and biases of -7.5 scales, so weights are O(0.03) and activations stay O(1).

    python3 make_mlx_moe.py OUT_DIR [--published 122b|35b] [--layers N]
"""
import argparse
import json
import os
import time

import torch
from safetensors.torch import save_file
from spill import shard_path

SHAPES = {
    "122b": dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
                 linear_num_value_heads=64, moe_intermediate_size=1024,
                 shared_expert_intermediate_size=1024),
    "35b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                linear_num_value_heads=32, moe_intermediate_size=512,
                shared_expert_intermediate_size=512),
}


def text_config(published, layers):
    c = dict(model_type="qwen3_5_moe_text", num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, vocab_size=248320,
             max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
             rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                              "partial_rotary_factor": 0.25})
    c.update(SHAPES[published])
    if layers:
        c["num_hidden_layers"] = layers
    n = c["num_hidden_layers"]
    c["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--published", default="122b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0)
    a = ap.parse_args()
    t0 = time.time()
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    c = text_config(a.published, a.layers)
    cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in c.items() if k != "model_type"})
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(cfg)
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    del model
    os.makedirs(a.out, exist_ok=True)
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    quant = {"group_size": 64, "bits": 4, "model.embed_tokens": False}

    def words(shape):
        w = torch.randint(-2**31, 2**31, shape, dtype=torch.int64, device=dev, generator=gen)
        return w.to(torch.int32).view(torch.uint32).cpu()

    def sides(shape, bits):
        # weights s q + b centred on 0: b = -(2^bits - 1) / 2 s
        s = (1.0 + torch.rand(shape, device=dev, generator=gen)) * (2.0 ** -8) * (16 / 2**bits)
        b = -s * (2**bits - 1) / 2
        return s.to(torch.bfloat16).cpu(), b.to(torch.bfloat16).cpu()

    def quantized(out, module, shape, bits):
        *lead, cols = shape
        out[module + ".weight"] = words((*lead, cols * bits // 32))
        out[module + ".scales"], out[module + ".biases"] = sides((*lead, cols // 64), bits)

    def floating(name, shape):
        if name.endswith("norm.weight") or "layernorm" in name:
            return torch.zeros(shape, dtype=torch.bfloat16)  # (1 + w) norms: weight 1
        if name.endswith("A_log"):
            return torch.log(torch.empty(shape).uniform_(1, 16)).to(torch.float32)
        if name.endswith("dt_bias"):
            return torch.ones(shape, dtype=torch.bfloat16)
        std = 0.1 if "conv1d" in name else 0.02
        return (torch.randn(shape, device=dev, generator=gen) * std).to(torch.bfloat16).cpu()

    by_layer = {}
    for name, shape in params:
        parts = name.split(".")
        key = int(parts[2]) if parts[1] == "layers" else -1
        by_layer.setdefault(key, []).append((name, shape))
    weight_map = {}
    total = 0
    n_q = 0
    for key in sorted(by_layer):
        out = {}
        for name, shape in by_layer[key]:
            if name.endswith("mlp.experts.gate_up_proj"):
                e, two_i, h = shape
                sw = name[: -len("experts.gate_up_proj")] + "switch_mlp"
                quantized(out, sw + ".gate_proj", (e, two_i // 2, h), 4)
                quantized(out, sw + ".up_proj", (e, two_i // 2, h), 4)
                n_q += 2
            elif name.endswith("mlp.experts.down_proj"):
                sw = name[: -len("experts.down_proj")] + "switch_mlp"
                quantized(out, sw + ".down_proj", shape, 4)
                n_q += 1
            elif (name.endswith(".weight") and len(shape) == 2 and "embed_tokens" not in name
                  and "norm" not in name and shape[1] % 64 == 0):
                module = name[: -len(".weight")]
                bits = 8 if module.endswith("mlp.gate") or module.endswith("shared_expert_gate") else 4
                if bits == 8:
                    quant[module] = {"group_size": 64, "bits": 8}
                quantized(out, module, shape, bits)
                n_q += 1
            else:
                out[name] = floating(name, shape)
        fname = f"model-{key + 1:05d}.safetensors"
        nbytes = sum(v.numel() * v.element_size() for v in out.values())
        save_file({k: v.contiguous() for k, v in out.items()}, shard_path(a.out, fname, nbytes),
                  metadata={"format": "mlx"})
        for k, v in out.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
              open(os.path.join(a.out, "model.safetensors.index.json"), "w"))
    cfg_out = dict(c, architectures=["Qwen3_5MoeForCausalLM"], torch_dtype="bfloat16",
                   quantization=quant)
    json.dump(cfg_out, open(os.path.join(a.out, "config.json"), "w"), indent=1)
    print(f"{a.out}: {c['num_hidden_layers']} layers, {n_q} matrices quantized, "
          f"{total / 1e9:.2f} GB in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
