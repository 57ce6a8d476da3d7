#!/usr/bin/env python3
"""Goldens for the hybrid (Gated DeltaNet + gated attention) families: qwen3_5, qwen3_5_moe,
qwen3_next. CPU float32, eager attention, torch's own fallbacks for the conv and the delta rule
(no fla / causal-conv1d kernels are installed).

Output per case: <out>/targets/<name>/{config.json, model.safetensors, golden.safetensors,
golden.json}. golden.safetensors holds:
  input_ids [T] int64, logits [T, V] (one full causal forward), hidden_{k} [T, H] for the taps
  (output_hidden_states[k + 1] = output of decoder layer k);
  decode_logits [T - P0, V]: transformers' own cached decoding (prefill P0 tokens, then one token
    at a time, so the single-token recurrent path and the conv-state update are exercised);
  for each rollback scenario s (golden.json "rollback"): verify_ids_s [Q], verify_logits_s [Q, V]
    = full forward of input_ids[:P] + verify_ids (its last Q rows), after_ids_s [E],
    after_logits_s [E, V] = full forward of input_ids[:P] + verify_ids[:a + 1] + after_ids (its
    last E rows): what a cache must give after a verify of Q rows, a rollback to the a + 1
    accepted rows and more decoding. Every expected row comes from a FRESH forward of the
    committed sequence, so a cache that keeps rejected rows in its state fails.

Usage: /work/pyenv/bin/python tools/goldens/make_hybrid_goldens.py --out DIR [--only NAME]
(transformers 5.17.0, torch 2.9.1; about 20 s on one core).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gold_common import versions, write_json  # noqa: E402

V = 256
T = 80  # > 64: the prompt spans two chunks of transformers' chunked delta rule
P0 = 50  # cached decoding: prefill P0, then one token at a time
# (prefix length P, verify rows Q, accepted draft tokens a, tokens decoded after E)
ROLLBACK = [(30, 8, 3, 6), (41, 16, 0, 5), (12, 5, 4, 4), (70, 16, 11, 7)]

F, L = "full_attention", "linear_attention"


def configs():
    base = dict(vocab_size=V, hidden_size=64, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=None, pad_token_id=None, hidden_act="silu",
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    tiny_vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                       patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    return {
        # The published layout: Qwen3_5ForConditionalGeneration, text config nested under
        # text_config, tensors under model.language_model., partial_rotary_factor removed from
        # config.json (the family default 0.25 applies), untied head.
        "qwen3_5": dict(cls="Qwen3_5ForConditionalGeneration", cfg_cls="Qwen3_5Config",
                        text_cls="Qwen3_5TextConfig", vision=tiny_vision,
                        text=dict(base, intermediate_size=96, num_hidden_layers=4,
                                  layer_types=[L, F, L, F], tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "mrope_section": [1, 1, 0], "mrope_interleaved": True}),
                        drop_partial_rotary=True),
        # Text-only Qwen3_5ForCausalLM, tied embeddings, explicit partial_rotary_factor 0.5,
        # schedule from full_attention_interval (layer_types removed from config.json).
        "qwen3_5_text_tied": dict(cls="Qwen3_5ForCausalLM", cfg_cls="Qwen3_5TextConfig",
                                  text=dict(base, intermediate_size=80, num_hidden_layers=5,
                                            full_attention_interval=3, tie_word_embeddings=True,
                                            linear_num_value_heads=2,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                             "partial_rotary_factor": 0.5}),
                                  drop_layer_types=True, final_norm=(-0.75, -0.25)),
        "qwen3_5_moe": dict(cls="Qwen3_5MoeForConditionalGeneration", cfg_cls="Qwen3_5MoeConfig",
                            text_cls="Qwen3_5MoeTextConfig", vision=tiny_vision,
                            text=dict(base, num_hidden_layers=4, layer_types=[L, L, F, L],
                                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "mrope_section": [1, 1, 0], "mrope_interleaved": True})),
        # in_proj_qkvz / in_proj_ba, a dense layer among MoE layers, 3 value heads per key head.
        "qwen3_next": dict(cls="Qwen3NextForCausalLM", cfg_cls="Qwen3NextConfig",
                           text=dict(base, intermediate_size=72, num_hidden_layers=4,
                                     layer_types=[L, F, L, F], linear_num_value_heads=6,
                                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                     shared_expert_intermediate_size=24, norm_topk_prob=True,
                                     decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                      "partial_rotary_factor": 0.25})),
    }


def reinit_(model, seed, final_norm=(-0.5, 0.5)):
    """matrices N(0, 0.12), embeddings N(0, 0.3), conv1d N(0, 0.3); (1 + w) RMSNorm weights
    U[-0.5, 0.5] (the final norm: U[final_norm]); the gated norm's plain weight U[0.5, 1.5];
    A = exp(A_log) U[0.05, 2] (slow and fast decays); dt_bias N(0, 0.5). Vision tower
    untouched (text-only input)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("A_log"):
                v = (torch.rand(p.shape, generator=g) * 1.95 + 0.05).log()
            elif name.endswith("dt_bias"):
                v = torch.randn(p.shape, generator=g) * 0.5
            elif name.endswith("linear_attn.norm.weight"):
                v = torch.rand(p.shape, generator=g) + 0.5
            elif name.endswith("model.norm.weight") or name.endswith("language_model.norm.weight"):
                lo, hi = final_norm
                v = torch.rand(p.shape, generator=g) * (hi - lo) + lo
            elif p.ndim == 1 and "norm" in name:
                v = torch.rand(p.shape, generator=g) - 0.5
            elif "conv1d" in name:
                v = torch.randn(p.shape, generator=g) * 0.3
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, generator=g) * 0.3
            else:
                v = torch.randn(p.shape, generator=g) * 0.12
            p.copy_(v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only")
    args = ap.parse_args()

    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import save_file

    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    vers = versions()
    print("versions:", vers, flush=True)
    for idx, (name, c) in enumerate(configs().items()):
        if args.only and name != args.only:
            continue
        seed = 500 + idx
        text = json.loads(json.dumps(c["text"]))
        if "text_cls" in c:
            tc = getattr(transformers, c["text_cls"])(**text)
            cfg = getattr(transformers, c["cfg_cls"])(text_config=tc.to_dict(), vision_config=c["vision"],
                                                       tie_word_embeddings=text["tie_word_embeddings"])
        else:
            cfg = getattr(transformers, c["cfg_cls"])(**text)
        cls = getattr(transformers, c["cls"])
        torch.manual_seed(seed)
        model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
        # the tied case has large logits (the 0.3-std embedding is its head): a smaller final
        # norm keeps them in the range of the others, so f32 rounding stays well under 1e-4
        reinit_(model, seed, c.get("final_norm", (-0.5, 0.5)))
        d = os.path.join(args.out, "targets", name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d)
        for e in os.listdir(d):
            if e not in ("config.json", "model.safetensors"):
                os.remove(os.path.join(d, e))
        cpath = os.path.join(d, "config.json")
        with open(cpath) as f:
            written = json.load(f)
        if c.get("drop_layer_types"):
            # keep only the interval: transformers rebuilds the same schedule from it
            assert written.pop("layer_types") == cfg.layer_types
            written["full_attention_interval"] = text["full_attention_interval"]
        if c.get("drop_partial_rotary"):
            # no partial_rotary_factor anywhere: the family default (0.25) applies
            tw = written["text_config"]
            tw.pop("partial_rotary_factor", None)
            tw["rope_parameters"].pop("partial_rotary_factor", None)
        with open(cpath, "w") as f:
            json.dump(written, f, indent=2, sort_keys=True)
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            tensor_names = {k: list(f.get_tensor(k).shape) for k in sorted(f.keys())}
        m = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        text_cfg = m.config.get_text_config()
        nl = text_cfg.num_hidden_layers
        taps = [0, nl - 2]
        g = torch.Generator().manual_seed(seed + 7)
        ids = torch.randint(0, V, (T,), generator=g, dtype=torch.long)

        def full(seq):
            with torch.inference_mode():
                return m(input_ids=seq[None], output_hidden_states=True)

        out = full(ids)
        with torch.inference_mode():
            ref = model(input_ids=ids[None]).logits
        assert torch.allclose(out.logits, ref, atol=1e-5), "reload changed the model"
        assert len(out.hidden_states) == nl + 1
        tensors = {"input_ids": ids.contiguous(), "logits": out.logits[0].contiguous()}
        for k in taps:
            tensors[f"hidden_{k}"] = out.hidden_states[k + 1][0].contiguous()

        # transformers' own cached decoding: prefill P0, then one token per call
        with torch.inference_mode():
            o = m(input_ids=ids[None, :P0], use_cache=True)
            cache = o.past_key_values
            rows = []
            for i in range(P0, T):
                o = m(input_ids=ids[None, i:i + 1], past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                rows.append(o.logits[0, -1])
        dec = torch.stack(rows)
        dec_err = float((dec - out.logits[0, P0:]).abs().max())
        assert dec_err < 1e-4, f"transformers cached decoding differs from the full forward: {dec_err}"
        tensors["decode_logits"] = dec.contiguous()

        scenarios = []
        for s, (p, q, a, e) in enumerate(ROLLBACK):
            vids = torch.randint(0, V, (q,), generator=g, dtype=torch.long)
            aids = torch.randint(0, V, (e,), generator=g, dtype=torch.long)
            vl = full(torch.cat([ids[:p], vids])).logits[0, -q:]
            al = full(torch.cat([ids[:p], vids[:a + 1], aids])).logits[0, -e:]
            # the rejected rows matter: keeping them would change what follows
            wrong = full(torch.cat([ids[:p], vids, aids])).logits[0, -e:]
            sens = float((wrong - al).abs().max()) if a + 1 < q else None
            tensors[f"verify_ids_{s}"] = vids
            tensors[f"verify_logits_{s}"] = vl.contiguous()
            tensors[f"after_ids_{s}"] = aids
            tensors[f"after_logits_{s}"] = al.contiguous()
            scenarios.append(dict(prefix=p, q=q, accepted=a, after=e, rejected_rows_change_logits_by=sens))
        save_file(tensors, os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})
        with open(cpath) as f:
            written = json.load(f)
        write_json(os.path.join(d, "golden.json"), {
            "taps": taps, "T": T, "P0": P0, "rollback": scenarios, "model_class": c["cls"],
            "layer_types": list(text_cfg.layer_types),
            "weight_names": tensor_names, "config_written": written, "versions": vers,
            "cached_decoding_vs_full_max_abs": dec_err,
            "notes": "made by tools/goldens/make_hybrid_goldens.py; CPU float32, eager attention, torch "
                     "fallbacks for conv1d and the gated delta rule (chunk 64 for multi-token calls, the "
                     "recurrent form for single tokens); hidden_k = output_hidden_states[k+1]; init: see reinit_",
        })
        print(f"{name}: ok taps={taps} layer_types={list(text_cfg.layer_types)} "
              f"logits_std={float(out.logits.std()):.3f} decode_err={dec_err:.2e} "
              f"rollback_sensitivity={[s['rejected_rows_change_logits_by'] for s in scenarios]} "
              f"tensors={len(tensor_names)}", flush=True)


if __name__ == "__main__":
    main()
