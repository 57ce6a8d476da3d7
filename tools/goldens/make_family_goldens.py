#!/usr/bin/env python3
"""Goldens for the families added after the first four: qwen3_moe, gemma3 (text), gemma4 (text,
dense and MoE). Same fixture format as make_target_goldens.py: <out>/targets/<name>/
{config.json, model.safetensors, golden.safetensors, golden.json}; CPU float32.

Beyond the logits and two taps, each golden.json lists the tensor names as saved by
transformers (the Rust loader must read exactly these) and the config as written.
Usage: python3 make_family_goldens.py --out DIR [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gold_common import versions, write_json  # noqa: E402

T = 41
V = 256


def configs():
    base = dict(vocab_size=V, hidden_size=64, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return {
        "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
            base, intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "qwen3_moe_nonorm": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
            base, intermediate_size=96, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=3,
            norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
            base, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
            tie_word_embeddings=True)),
        "gemma4": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
            base, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
            sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=8, vocab_size_per_layer_input=V, num_kv_shared_layers=2,
            final_logit_softcapping=30.0, tie_word_embeddings=True)),
        "gemma4_moe": ("Gemma4ForCausalLM", "Gemma4TextConfig", dict(
            base, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=16, final_logit_softcapping=None, tie_word_embeddings=True)),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only")
    args = ap.parse_args()

    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    import gold_torch as gt

    gt.setup()
    vers = versions()
    print("versions:", vers, flush=True)
    for idx, (name, (cls, cfg_cls, kw)) in enumerate(configs().items()):
        if args.only and name != args.only:
            continue
        try:
            seed = 300 + idx
            cfg = getattr(transformers, cfg_cls)(**json.loads(json.dumps(kw)))
            torch.manual_seed(seed)
            model = getattr(transformers, cls)._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
            model.eval()
            gt.reinit_(model, seed)
            g = torch.Generator().manual_seed(seed + 7)
            with torch.no_grad():
                for bname, b in model.named_buffers():
                    if bname.endswith("layer_scalar"):
                        b.copy_(torch.rand(b.shape, generator=g) + 0.5)
            d = os.path.join(args.out, "targets", name)
            os.makedirs(d, exist_ok=True)
            model.save_pretrained(d)
            gen = os.path.join(d, "generation_config.json")
            if os.path.exists(gen):
                os.remove(gen)
            with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
                tensor_names = {k: list(f.get_tensor(k).shape) for k in sorted(f.keys())}
            reloaded = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                                         attn_implementation="eager")
            reloaded.eval()
            L = reloaded.config.num_hidden_layers
            taps = [0, L - 2]
            ids = torch.randint(0, V, (T,), generator=g, dtype=torch.long)
            with torch.inference_mode():
                out = reloaded(ids[None], output_hidden_states=True)
                ref = model(ids[None]).logits
            assert torch.allclose(out.logits, ref, atol=1e-5), "reload changed the model"
            tensors = {"input_ids": ids.contiguous(), "logits": out.logits[0].float().contiguous()}
            for k in taps:
                tensors[f"hidden_{k}"] = out.hidden_states[k + 1][0].float().contiguous()
            save_file(tensors, os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})
            with open(os.path.join(d, "config.json")) as f:
                written = json.load(f)
            write_json(os.path.join(d, "golden.json"), {
                "taps": taps, "T": T, "model_class": cls, "config_class": cfg_cls,
                "weight_names": tensor_names, "config_written": written, "versions": vers,
                "notes": "CPU float32, eager attention, one full forward of input_ids at positions 0..T-1; "
                         "hidden_k = output_hidden_states[k+1]; layer_scalar buffers randomised U[0.5,1.5]; "
                         "matrices N(0,0.12), embeddings N(0,0.3), 1-D norm weights U[0.5,1.5].",
            })
            print(f"{name}: ok taps={taps} logits_std={float(out.logits.std()):.3f} tensors={len(tensor_names)}",
                  flush=True)
        except Exception as e:  # keep going: report which family failed and why
            import traceback
            traceback.print_exc()
            print(f"{name}: FAILED {e!r}", flush=True)


if __name__ == "__main__":
    main()
