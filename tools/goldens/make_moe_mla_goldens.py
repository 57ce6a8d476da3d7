#!/usr/bin/env python3
"""Goldens for gpt_oss (float and MXFP4 experts) and deepseek_v3 / kimi_k25 (multi-head latent
attention, grouped sigmoid routing, shared experts). Same fixture format as
make_family_goldens.py: <out>/targets/<name>/{config.json, model.safetensors,
golden.safetensors, golden.json}; CPU float32, eager attention.

gpt_oss_mxfp4: the expert weights are drawn as MXFP4 codes and scales (so their float values
are exact), the golden is computed with those float values, and the checkpoint stores them
packed (`*_blocks` / `*_scales`, `quantization_config.quant_method = mxfp4`) exactly as the
published gpt-oss checkpoints do. transformers (without the Triton kernels on CPU) loads it by
dequantizing (to bf16, exact for MXFP4 values); the script checks that this independent
dequantization gives back the float experts bit for bit, so the Rust MXFP4 path, compared with
the golden, is compared with transformers' own reading of the packed file. (transformers would
then run those experts in bf16, hence the golden comes from the float model.)

Usage: /work/pyenv/bin/python tools/goldens/make_moe_mla_goldens.py --out DIR [--only NAME]
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

FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def configs():
    base = dict(vocab_size=V, hidden_size=64, max_position_embeddings=256, rms_norm_eps=1e-6,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    gpt_oss = dict(
        base, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        attention_bias=True, tie_word_embeddings=False, max_position_embeddings=128,
        # gpt-oss's published rope: yarn, truncate false (factor / original scaled down)
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
    mla = dict(
        base, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3, first_k_dense_replace=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=3,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        attention_bias=False, tie_word_embeddings=False, max_position_embeddings=128,
        # yarn with mscale / mscale_all_dim both set and different: the rope factor is their
        # ratio, the softmax scale gets mscale(mscale_all_dim)^2
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
                         "mscale_all_dim": 0.7, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                         "beta_slow": 1.0})
    mla_plain = dict(
        base, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4, first_k_dense_replace=2,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=2,
        n_group=1, topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False,
        attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kimi_text = dict(
        base, model_type="deepseek_v3", intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
        rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
        # Kimi-K2.5's published rope: yarn, mscale = mscale_all_dim = 1 (factor scaled down)
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                         "beta_slow": 1.0})
    kimi_vision = dict(patch_size=14, pos_emb_height=4, pos_emb_width=4, pos_emb_time=1, num_attention_heads=2,
                       num_hidden_layers=1, hidden_size=16, intermediate_size=32)
    return {
        "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", gpt_oss, {}),
        "gpt_oss_mxfp4": ("GptOssForCausalLM", "GptOssConfig", dict(gpt_oss, num_local_experts=3),
                          {"mxfp4": True}),
        "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", mla, {}),
        "deepseek_v3_plain": ("DeepseekV3ForCausalLM", "DeepseekV3Config", mla_plain, {}),
        "kimi_k25": ("Kimi_K25ForConditionalGeneration", "Kimi_K25Config",
                     dict(text_config=kimi_text, vision_config=kimi_vision, tie_word_embeddings=False), {}),
    }


def mxfp4_draw(shape, gen, torch):
    """Random MXFP4 data for a float tensor of `shape` [..., cols]: returns (values f32,
    blocks uint8 [..., cols/32, 16], scales uint8 [..., cols/32]). Scales 2^-5..2^-3 give
    values of the same size as the other matrices (|w| <= 6 * 2^-3 = 0.75, RMS about 0.24)."""
    *lead, cols = shape
    g = cols // 32
    codes = torch.randint(0, 16, (*lead, g, 32), generator=gen, dtype=torch.uint8)
    scales = torch.randint(122, 125, (*lead, g), generator=gen, dtype=torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float64)
    vals = lut[codes.long()] * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return vals.reshape(*lead, cols).float(), blocks.contiguous(), scales.contiguous()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--only")
    args = ap.parse_args()

    import torch
    import transformers
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    import gold_torch as gt

    gt.setup()
    vers = versions()
    print("versions:", vers, flush=True)
    for idx, (name, (cls, cfg_cls, kw, opts)) in enumerate(configs().items()):
        if args.only and name != args.only:
            continue
        seed = 500 + idx
        cfg = getattr(transformers, cfg_cls)(**json.loads(json.dumps(kw)))
        torch.manual_seed(seed)
        model = getattr(transformers, cls)._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        model.eval()
        gt.reinit_(model, seed)
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        packed = {}
        if opts.get("mxfp4"):
            with torch.no_grad():
                for mname, mod in model.named_modules():
                    if type(mod).__name__ != "GptOssExperts":
                        continue
                    # checkpoint orientation (out, in): gate_up [E, 2I, H], down [E, H, I]
                    e, h, two_i = mod.gate_up_proj.shape
                    vals, blk, sc = mxfp4_draw((e, two_i, h), g, torch)
                    mod.gate_up_proj.copy_(vals.transpose(1, 2))
                    packed[f"{mname}.gate_up_proj_blocks"] = blk
                    packed[f"{mname}.gate_up_proj_scales"] = sc
                    vals, blk, sc = mxfp4_draw((e, h, two_i // 2), g, torch)
                    mod.down_proj.copy_(vals.transpose(1, 2))
                    packed[f"{mname}.down_proj_blocks"] = blk
                    packed[f"{mname}.down_proj_scales"] = sc
        d = os.path.join(args.out, "targets", name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(d, extra)):
                os.remove(os.path.join(d, extra))
        st_path = os.path.join(d, "model.safetensors")
        if "Kimi" in cls:
            # transformers 5.17 saves the text layers as `language_model.model.blocks.N` (its
            # vision rename `blocks -> layers` applied in reverse to every name); the published
            # checkpoint says `language_model.model.layers.N`, which is what we store (the
            # reload check below proves transformers reads it as the same model).
            sd = load_file(st_path)
            sd = {k.replace("language_model.model.blocks.", "language_model.model.layers."): v
                  for k, v in sd.items()}
            save_file(sd, st_path, metadata={"format": "pt"})
        if packed:
            sd = load_file(st_path)
            for k in list(sd):
                if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
                    del sd[k]
            sd.update(packed)
            save_file(sd, st_path, metadata={"format": "pt"})
            cpath = os.path.join(d, "config.json")
            with open(cpath) as f:
                c = json.load(f)
            c["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}
            with open(cpath, "w") as f:
                json.dump(c, f, indent=2, sort_keys=True)
        with safe_open(st_path, "pt") as f:
            tensor_names = {k: [str(f.get_tensor(k).dtype), list(f.get_tensor(k).shape)] for k in sorted(f.keys())}
        load_kw = dict(dtype=torch.float32, attn_implementation="eager")
        if packed:
            load_kw["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
        auto = transformers.AutoModelForImageTextToText if "Kimi" in cls else transformers.AutoModelForCausalLM
        reloaded = auto.from_pretrained(d, **load_kw)
        reloaded.eval()
        # The files hold exactly the model: every tensor transformers reads back (the MXFP4
        # experts through its own dequantization, to bf16) equals the float model's.
        sa, sb = model.state_dict(), reloaded.state_dict()
        assert sa.keys() == sb.keys(), sa.keys() ^ sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k].to(sa[k].dtype)), k
        # transformers computes dequantized experts in bf16; the golden is the float model.
        gold_model = model if packed else reloaded
        text_cfg = reloaded.config.get_text_config()
        L = text_cfg.num_hidden_layers
        taps = [0, L - 2] if L > 2 else [0, 1]
        ids = torch.randint(0, V, (T,), generator=g, dtype=torch.long)
        with torch.inference_mode():
            out = gold_model(input_ids=ids[None], output_hidden_states=True)
            ref = model(input_ids=ids[None])
        err = float((out.logits - ref.logits).abs().max())
        assert err == 0.0, f"reload changed the model: {err}"
        # incremental decoding in transformers agrees with the full forward
        with torch.inference_mode():
            cache = transformers.DynamicCache(config=gold_model.config)
            gold_model(input_ids=ids[None, :20], past_key_values=cache, use_cache=True)
            steps = [gold_model(input_ids=ids[None, i:i + 1], past_key_values=cache, use_cache=True).logits[0, -1]
                     for i in range(20, T)]
        inc_err = float((torch.stack(steps) - out.logits[0, 20:]).abs().max())
        assert inc_err < 1e-4, f"transformers incremental != full: {inc_err}"
        tensors = {"input_ids": ids.contiguous(), "logits": out.logits[0].float().contiguous()}
        for k in taps:
            tensors[f"hidden_{k}"] = out.hidden_states[k + 1][0].float().contiguous()
        save_file(tensors, os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "config.json")) as f:
            written = json.load(f)
        rope = getattr(text_cfg, "rope_parameters", None)
        write_json(os.path.join(d, "golden.json"), {
            "taps": taps, "T": T, "model_class": cls, "config_class": cfg_cls,
            "weight_names": tensor_names, "config_written": written,
            "rope_parameters_as_loaded": rope,
            "transformers_incremental_max_abs_error": inc_err, "versions": vers,
            "notes": "CPU float32, eager attention, one full forward of input_ids at positions 0..T-1; "
                     "hidden_k = output_hidden_states[k+1]; matrices N(0,0.12), embeddings N(0,0.3), "
                     "biases N(0,0.1), 1-D norm weights U[0.5,1.5], e_score_correction_bias N(0,0.1); "
                     "MXFP4 experts: random e2m1 codes, scales 2^-5..2^-3; transformers' own dequantization "
                     "(Mxfp4Config(dequantize=True)) of the packed file equals the float experts bit for "
                     "bit; the golden is the float model's forward (transformers would run the "
                     "dequantized experts in bf16).",
        })
        print(f"{name}: ok taps={taps} logits_std={float(out.logits.std()):.3f} tensors={len(tensor_names)} "
              f"inc_err={inc_err:.2e}", flush=True)


if __name__ == "__main__":
    main()
