#!/usr/bin/env python3
"""Random-weight targets at the published widths of each supported family, each with a z-lab
format DFlash draft, for the family sweep (families.sh). Speed does not depend on weight values,
so nothing here controls acceptance: transformers' own random init, bf16, saved with
save_pretrained. Large models keep their per-layer shapes and lose layers (`layers` of
`published_layers` below); the summary states both.

  families.py build --models DIR [--only fam[,fam]] [--tiny] [--device cuda] [--dtype bfloat16]
      -> DIR/<fam>/{target,draft}/ (config.json, *.safetensors, tensors.json = every tensor's
         dtype/shape/bytes from the safetensors headers) and DIR/<fam>/manifest.json (shapes,
         layers used, bytes, build/save seconds). A family whose DIR/<fam>/manifest.json exists
         is skipped. A family whose transformers class is missing is reported and skipped.
  families.py bandwidth --device cuda --out FILE.json
      -> the copy bandwidth: a 2 GiB device-to-device copy (256 MiB on the CPU), median of 10;
         copy_Bps = (bytes read + bytes written) / t, as docs/perf.md's "measured copy".
  families.py list [--tiny]   -> the families and their shapes
  --small: narrow test models whose head dims the CUDA kernels take, every family feature on
           (tests/fused_cuda.rs reads them from DFLASH_FAMILY_MODELS)

Published configs (config.json on the hub, cross-checked against the registry rows in
crates/dflash/tests/{registry_rows,hybrid}.rs): Qwen3-8B, Qwen3.5-9B (transformers'
Qwen3_5TextConfig defaults), Qwen3-Coder-30B-A3B, Qwen3.5-35B-A3B, Qwen3-Coder-Next,
gpt-oss-20b, gemma-4-31B (text_config), Kimi-K2.5 (text_config, as deepseek_v3).
Draft widths: the published draft's where one is known (z-lab Qwen3-8B / Qwen3-Coder-30B-A3B /
Qwen3.5 drafts, z-lab gpt-oss-20b-DFlash's heads and intermediate size, RedHatAI's gemma-4-31B
speculator's), else 3x hidden with 32/8 heads of 128 (what tests/hybrid.rs assumes); always 5
Qwen3 layers, block 16, the target's vocabulary.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import time

S, F = "sliding_attention", "full_attention"
LIN = "linear_attention"
NOIDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def hybrid_types(n):
    """Qwen3.5 / Qwen3-Next schedule: 3 Gated DeltaNet layers, then one full attention."""
    return [F if (i + 1) % 4 == 0 else LIN for i in range(n)]


def alternating(n):
    """gpt-oss: sliding, full, sliding, full, ..."""
    return [S if i % 2 == 0 else F for i in range(n)]


def gemma_types(n):
    """Gemma 4: five sliding layers, then one full."""
    return [F if (i + 1) % 6 == 0 else S for i in range(n)]


# Each family: transformers classes, the published target config at `layers` layers (a function
# of the layer count, so layer_types follow the depth), and the draft's widths.
# "moe": the config keys that give (experts, top-k), for the summary.
FAMILIES = {
    "qwen3": dict(
        published="Qwen3-8B", published_layers=36, layers=12,
        cls="Qwen3ForCausalLM", cfg_cls="Qwen3Config",
        target=lambda n: dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=n,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                              vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                              rms_norm_eps=1e-6, tie_word_embeddings=False),
        draft=dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                   intermediate_size=12288, rope_theta=1000000.0, max_position_embeddings=40960),
        mask=151669, taps=[1, 9, 17, 25, 33],
        tiny=lambda n: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=n,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            vocab_size=512, max_position_embeddings=4096, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=False),
        tiny_layers=4,
    ),
    "qwen3_5": dict(
        published="Qwen3.5-9B", published_layers=32, layers=8,
        cls="Qwen3_5ForCausalLM", cfg_cls="Qwen3_5TextConfig",
        target=lambda n: dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=n,
                              num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                              linear_num_key_heads=16, linear_num_value_heads=32,
                              linear_key_head_dim=128, linear_value_head_dim=128,
                              linear_conv_kernel_dim=4, layer_types=hybrid_types(n),
                              vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                               "partial_rotary_factor": 0.25},
                              tie_word_embeddings=False),
        draft=dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                   intermediate_size=12288, rope_theta=10000000.0, max_position_embeddings=262144),
        mask=248070, taps=[1, 8, 15, 22, 29],
        tiny=lambda n: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=n,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4,
                            layer_types=hybrid_types(n), vocab_size=512, max_position_embeddings=4096,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25},
                            tie_word_embeddings=False),
        tiny_layers=4,
    ),
    "qwen3_moe": dict(
        published="Qwen3-Coder-30B-A3B", published_layers=48, layers=12,
        cls="Qwen3MoeForCausalLM", cfg_cls="Qwen3MoeConfig", moe=True,
        target=lambda n: dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                              num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=n,
                              num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              vocab_size=151936, max_position_embeddings=262144,
                              rope_theta=10000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
        draft=dict(num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                   intermediate_size=6144, rope_theta=10000000.0, max_position_embeddings=262144),
        mask=151669,
        tiny=lambda n: dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                            decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=n,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            vocab_size=512, max_position_embeddings=4096, rope_theta=10000000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=False),
        tiny_layers=3,
    ),
    "qwen3_5_moe": dict(
        published="Qwen3.5-35B-A3B", published_layers=40, layers=8,
        cls="Qwen3_5MoeForCausalLM", cfg_cls="Qwen3_5MoeTextConfig", moe=True,
        target=lambda n: dict(hidden_size=2048, num_hidden_layers=n, num_attention_heads=16,
                              num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                              linear_num_value_heads=32, linear_key_head_dim=128,
                              linear_value_head_dim=128, linear_conv_kernel_dim=4,
                              layer_types=hybrid_types(n), num_experts=256, num_experts_per_tok=8,
                              moe_intermediate_size=512, shared_expert_intermediate_size=512,
                              vocab_size=248320, max_position_embeddings=262144, rms_norm_eps=1e-6,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                               "partial_rotary_factor": 0.25},
                              tie_word_embeddings=False),
        draft=dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                   intermediate_size=6144, rope_theta=10000000.0, max_position_embeddings=262144),
        mask=248070,
        tiny=lambda n: dict(hidden_size=64, num_hidden_layers=n, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            linear_conv_kernel_dim=4, layer_types=hybrid_types(n), num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, vocab_size=512,
                            max_position_embeddings=4096,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25},
                            tie_word_embeddings=False),
        tiny_layers=4,
    ),
    "qwen3_next": dict(
        published="Qwen3-Coder-Next", published_layers=48, layers=8,
        cls="Qwen3NextForCausalLM", cfg_cls="Qwen3NextConfig", moe=True,
        target=lambda n: dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=n,
                              num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                              linear_num_key_heads=16, linear_num_value_heads=32,
                              linear_key_head_dim=128, linear_value_head_dim=128,
                              linear_conv_kernel_dim=4, layer_types=hybrid_types(n),
                              num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                              shared_expert_intermediate_size=512, decoder_sparse_step=1,
                              mlp_only_layers=[], norm_topk_prob=True, vocab_size=151936,
                              max_position_embeddings=262144, rms_norm_eps=1e-6,
                              rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                               "partial_rotary_factor": 0.25},
                              tie_word_embeddings=False),
        draft=dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                   intermediate_size=6144, rope_theta=5000000.0, max_position_embeddings=262144),
        mask=151669,
        tiny=lambda n: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=n,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_conv_kernel_dim=4,
                            layer_types=hybrid_types(n), num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, shared_expert_intermediate_size=32,
                            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                            vocab_size=512, max_position_embeddings=4096,
                            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                             "partial_rotary_factor": 0.25},
                            tie_word_embeddings=False),
        tiny_layers=4,
    ),
    "gpt_oss": dict(
        published="gpt-oss-20b", published_layers=24, layers=8,
        cls="GptOssForCausalLM", cfg_cls="GptOssConfig", moe=True,
        # float experts (transformers' own layout); the published checkpoint's are MXFP4
        target=lambda n: dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=n,
                              num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                              vocab_size=201088, num_local_experts=32, num_experts_per_tok=4,
                              sliding_window=128, layer_types=alternating(n), attention_bias=True,
                              swiglu_limit=7.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                              max_position_embeddings=131072,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                               "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                               "truncate": False,
                                               "original_max_position_embeddings": 4096}),
        # z-lab/gpt-oss-20b-DFlash: 64/8 heads of 64, intermediate 7680 (8 layers, block 8
        # there; 5 Qwen3 layers, block 16 here)
        draft=dict(num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   intermediate_size=7680, rope_theta=150000.0, max_position_embeddings=131072,
                   rms_norm_eps=1e-5),
        mask=200000,
        tiny=lambda n: dict(hidden_size=64, intermediate_size=32, num_hidden_layers=n,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            vocab_size=512, num_local_experts=4, num_experts_per_tok=2,
                            sliding_window=8, layer_types=alternating(n), attention_bias=True,
                            rms_norm_eps=1e-5, tie_word_embeddings=False,
                            max_position_embeddings=4096,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                             "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False,
                                             "original_max_position_embeddings": 128}),
        tiny_layers=4,
    ),
    "gemma4": dict(
        published="gemma-4-31B", published_layers=60, layers=6, unit_qk_scores=True,
        cls="Gemma4ForCausalLM", cfg_cls="Gemma4TextConfig",
        target=lambda n: dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=n,
                              num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                              global_head_dim=512, num_global_key_value_heads=4,
                              attention_k_eq_v=True, sliding_window=1024, layer_types=gemma_types(n),
                              vocab_size=262144, hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                              enable_moe_block=False, use_double_wide_mlp=False,
                              final_logit_softcapping=30.0, rms_norm_eps=1e-6,
                              max_position_embeddings=262144, tie_word_embeddings=True,
                              hidden_activation="gelu_pytorch_tanh",
                              rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                               F: {"rope_type": "proportional",
                                                   "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1000000.0}}),
        # RedHatAI/gemma-4-31B-it-speculator.dflash: 32/16 heads of 128, intermediate 21504
        draft=dict(num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                   intermediate_size=21504, rope_theta=1000000.0, max_position_embeddings=262144),
        mask=4,
        tiny=lambda n: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=n,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                            sliding_window=8, layer_types=gemma_types(n), vocab_size=512,
                            hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                            final_logit_softcapping=30.0, max_position_embeddings=4096,
                            tie_word_embeddings=True),
        tiny_layers=6,
    ),
    "deepseek_v3": dict(
        published="Kimi-K2.5 (text)", published_layers=61, layers=2,
        cls="DeepseekV3ForCausalLM", cfg_cls="DeepseekV3Config", moe=True,
        target=lambda n: dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                              num_hidden_layers=n, num_attention_heads=64, num_key_value_heads=64,
                              n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
                              first_k_dense_replace=1, q_lora_rank=1536, kv_lora_rank=512,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                              n_group=1, topk_group=1, routed_scaling_factor=2.827,
                              norm_topk_prob=True, vocab_size=163840, rms_norm_eps=1e-6,
                              max_position_embeddings=262144, tie_word_embeddings=False,
                              rope_interleave=True, attention_bias=False,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0,
                                               "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                               "original_max_position_embeddings": 4096,
                                               "beta_fast": 32.0, "beta_slow": 1.0}),
        # z-lab/Kimi-K2.5-DFlash: 6 layers, block 8; heads / intermediate as the project's
        # registry test assumes (64/8 heads of 128, 18432)
        draft=dict(num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                   intermediate_size=18432, rope_theta=50000.0, max_position_embeddings=262144),
        mask=163838,
        tiny=lambda n: dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16,
                            num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4,
                            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                            first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=32,
                            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=1,
                            topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
                            vocab_size=512, rms_norm_eps=1e-6, max_position_embeddings=4096,
                            tie_word_embeddings=False, rope_interleave=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 50000.0}),
        tiny_layers=2,
    ),
}
ORDER = list(FAMILIES)
TINY_DRAFT = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                  max_position_embeddings=4096)

# Small models for the CUDA tests (tests/fused_cuda.rs, DFLASH_FAMILY_MODELS): narrow, few
# layers, but head dims the kernels are built for (attention 64/128/256/512, Gated DeltaNet
# 128) and every feature of the family switched on (gemma4: per-layer inputs, KV sharing, keys
# as values, the MoE block; deepseek: grouped routing, yarn mscale).
ROPE_HYBRID = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
SMALL = {
    "qwen3": (3, lambda n: dict(hidden_size=256, intermediate_size=512, num_hidden_layers=n,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                vocab_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-6,
                                tie_word_embeddings=False)),
    "qwen3_5": (4, lambda n: dict(hidden_size=256, intermediate_size=512, num_hidden_layers=n,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                  linear_num_key_heads=2, linear_num_value_heads=4,
                                  linear_key_head_dim=128, linear_value_head_dim=128,
                                  linear_conv_kernel_dim=4, layer_types=hybrid_types(n),
                                  vocab_size=1024, max_position_embeddings=4096,
                                  rope_parameters=ROPE_HYBRID, tie_word_embeddings=False)),
    "qwen3_moe": (3, lambda n: dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                    num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                                    decoder_sparse_step=1, mlp_only_layers=[0], num_hidden_layers=n,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                    vocab_size=1024, max_position_embeddings=4096,
                                    tie_word_embeddings=False)),
    "qwen3_5_moe": (4, lambda n: dict(hidden_size=256, num_hidden_layers=n, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=256, linear_num_key_heads=2,
                                      linear_num_value_heads=4, linear_key_head_dim=128,
                                      linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                      layer_types=hybrid_types(n), num_experts=16,
                                      num_experts_per_tok=4, moe_intermediate_size=128,
                                      shared_expert_intermediate_size=128, vocab_size=1024,
                                      max_position_embeddings=4096, rope_parameters=ROPE_HYBRID,
                                      tie_word_embeddings=False)),
    "qwen3_next": (4, lambda n: dict(hidden_size=256, intermediate_size=512, num_hidden_layers=n,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                     linear_num_key_heads=2, linear_num_value_heads=4,
                                     linear_key_head_dim=128, linear_value_head_dim=128,
                                     linear_conv_kernel_dim=4, layer_types=hybrid_types(n),
                                     num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                                     shared_expert_intermediate_size=128, decoder_sparse_step=1,
                                     mlp_only_layers=[1], norm_topk_prob=True, vocab_size=1024,
                                     max_position_embeddings=4096, rope_parameters=ROPE_HYBRID,
                                     tie_word_embeddings=False)),
    "gpt_oss": (4, lambda n: dict(hidden_size=256, intermediate_size=128, num_hidden_layers=n,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                  vocab_size=1024, num_local_experts=8, num_experts_per_tok=2,
                                  sliding_window=16, layer_types=alternating(n), attention_bias=True,
                                  rms_norm_eps=1e-5, tie_word_embeddings=False,
                                  max_position_embeddings=4096,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                                   "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                   "truncate": False,
                                                   "original_max_position_embeddings": 128})),
    "gemma4": (6, lambda n: dict(hidden_size=256, intermediate_size=512, num_hidden_layers=n,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=256,
                                 global_head_dim=512, num_global_key_value_heads=1,
                                 attention_k_eq_v=True, sliding_window=16,
                                 layer_types=[S, S, F, S, S, F][:n], vocab_size=1024,
                                 hidden_size_per_layer_input=64, vocab_size_per_layer_input=1024,
                                 num_kv_shared_layers=2, enable_moe_block=True, num_experts=8,
                                 top_k_experts=2, moe_intermediate_size=128,
                                 final_logit_softcapping=30.0, max_position_embeddings=4096,
                                 tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
                                 rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                                                  F: {"rope_type": "proportional",
                                                      "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1000000.0}})),
    "deepseek_v3": (2, lambda n: dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                                      num_hidden_layers=n, num_attention_heads=4, num_key_value_heads=4,
                                      n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
                                      first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=512,
                                      qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                      n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                      norm_topk_prob=True, vocab_size=1024, max_position_embeddings=4096,
                                      tie_word_embeddings=False, rope_interleave=True,
                                      rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0,
                                                       "factor": 8.0, "mscale": 1.0,
                                                       "mscale_all_dim": 1.0,
                                                       "original_max_position_embeddings": 512,
                                                       "beta_fast": 32.0, "beta_slow": 1.0})),
}
SMALL_DRAFT = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                   max_position_embeddings=4096)


def spread_taps(n_layers, n_taps=5):
    """Draft taps over the (reduced) target depth: evenly spread over layers 1..L-2 when that
    gives distinct layers (the published drafts span about 1..L-3), else over 0..L-1."""
    n = min(n_taps, n_layers)
    if n == 1:
        return [n_layers // 2]
    if n_layers >= n + 2:
        taps = [round(1 + i * (n_layers - 3) / (n - 1)) for i in range(n)]
        if len(set(taps)) == n:
            return taps
    return sorted({round(i * (n_layers - 1) / (n - 1)) for i in range(n)})


def shape_line(fam, cfg):
    """A short description of the target's widths for the table."""
    g = lambda k, d=None: cfg.get(k, d)
    h = g("hidden_size")
    heads = f"{g('num_attention_heads')}/{g('num_key_value_heads')}x{g('head_dim', h // max(1, g('num_attention_heads', 1)))}"
    parts = [f"H{h}"]
    if fam == "deepseek_v3":
        parts.append(f"MLA {g('num_attention_heads')}h q{g('q_lora_rank')} kv{g('kv_lora_rank')} "
                     f"{g('qk_nope_head_dim')}+{g('qk_rope_head_dim')}/{g('v_head_dim')}")
    else:
        parts.append(heads)
    if g("global_head_dim"):
        parts.append(f"full {g('num_global_key_value_heads')}kvx{g('global_head_dim')}")
    if g("linear_num_key_heads"):
        parts.append(f"GDN {g('linear_num_key_heads')}/{g('linear_num_value_heads')}x{g('linear_key_head_dim')}")
    e = g("num_experts") or g("num_local_experts") or g("n_routed_experts")
    k = g("num_experts_per_tok") or g("top_k_experts")
    if e:
        mi = g("moe_intermediate_size") or g("intermediate_size")
        parts.append(f"E{e} top{k} I{mi}")
        sh = g("shared_expert_intermediate_size") or (g("n_shared_experts") and g("moe_intermediate_size") * g("n_shared_experts"))
        if sh:
            parts.append(f"shared {sh}")
        if fam == "deepseek_v3":
            parts.append(f"dense I{g('intermediate_size')} x{g('first_k_dense_replace')}")
    else:
        parts.append(f"I{g('intermediate_size')}")
    parts.append(f"V{g('vocab_size')}")
    return " ".join(parts)


def read_headers(d):
    """Every tensor of the *.safetensors files in d: {name: [dtype, shape, bytes]}."""
    out = {}
    for fn in sorted(os.listdir(d)):
        if not fn.endswith(".safetensors"):
            continue
        with open(os.path.join(d, fn), "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h = json.loads(f.read(n))
        for k, v in h.items():
            if k == "__metadata__":
                continue
            a, b = v["data_offsets"]
            out[k] = [v["dtype"], v["shape"], b - a]
    return out


def dir_bytes(d):
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if f.endswith(".safetensors"))


# Variants of a small model with one feature changed (`build --small --only NAME`), to locate a
# difference between the fused and the portable path (tests/fused_cuda.rs names the failing
# model): (base family, config overrides).
VARIANTS = {
    "gemma4-noshare": ("gemma4", dict(num_kv_shared_layers=0)),
    "gemma4-nokeqv": ("gemma4", dict(attention_k_eq_v=False)),
    "gemma4-global256": ("gemma4", dict(global_head_dim=256)),
    "gemma4-wide-window": ("gemma4", dict(sliding_window=128)),
    "gemma4-nople-nomoe": ("gemma4", dict(hidden_size_per_layer_input=0, enable_moe_block=False)),
}


def build_one(fam, a, torch, transformers):
    base, overrides = VARIANTS.get(fam, (fam, {}))
    if overrides and not a.small:
        raise ValueError(f"{fam}: variants are small models (--small)")
    spec = FAMILIES[base]
    root = os.path.join(a.models, fam)
    man_path = os.path.join(root, "manifest.json")
    if os.path.exists(man_path):
        print(f"{fam}: exists ({man_path}), skipped", flush=True)
        return "skipped"
    cls = getattr(transformers, spec["cls"], None)
    cfg_cls = getattr(transformers, spec["cfg_cls"], None)
    if cls is None or cfg_cls is None:
        print(f"{fam}: SKIPPED: transformers {transformers.__version__} has no "
              f"{spec['cls'] if cls is None else spec['cfg_cls']}", flush=True)
        return "missing-class"
    from dflash.model import DFlashDraftModel

    if a.small:
        n, make = SMALL[base]
        kw = {**make(n), **overrides}
    else:
        n = spec["tiny_layers"] if a.tiny else spec["layers"]
        kw = (spec["tiny"] if a.tiny else spec["target"])(n)
    dtype = getattr(torch, a.dtype)
    if os.path.exists(root):
        shutil.rmtree(root)  # a half-written earlier attempt
    t0 = time.time()
    torch.manual_seed(0)
    cfg = cfg_cls(**json.loads(json.dumps(kw)), **NOIDS, dtype=a.dtype)
    with torch.device(a.device):
        target = cls._from_config(cfg, dtype=dtype).eval()
    if spec.get("unit_qk_scores"):
        # Attention scale 1.0 over unit-RMS q/k norms (gemma4): with the init's norm weights of
        # one, a score is a sum of head_dim unit products (std ~22 at 512) and softmax is
        # one-hot, so bf16 rounding flips rows (the bf16 portable path alone is ~50% off f32).
        # A trained model's norm weights keep scores O(1); head_dim**-0.25 on each does that.
        with torch.no_grad():
            for name, m in target.named_modules():
                if name.endswith(("q_norm", "k_norm")) and getattr(m, "weight", None) is not None:
                    m.weight.mul_(m.weight.shape[0] ** -0.25)
    if a.device.startswith("cuda"):
        torch.cuda.synchronize()
    t_build = time.time() - t0
    t0 = time.time()
    tdir = os.path.join(root, "target")
    target.save_pretrained(tdir, max_shard_size="5GB")
    t_save = time.time() - t0
    tcfg = json.load(open(os.path.join(tdir, "config.json")))
    n_params = sum(p.numel() for p in target.parameters())
    del target
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()

    # The draft: Qwen3 layers at the target's hidden size, the target's vocabulary.
    from transformers import Qwen3Config

    small = a.tiny or a.small
    # the published draft's taps when the target keeps its published depth
    taps = spec.get("taps") if not small and n == spec["published_layers"] else None
    taps = taps or spread_taps(n)
    dkw = dict(SMALL_DRAFT if a.small else TINY_DRAFT if a.tiny else spec["draft"])
    dkw.setdefault("rms_norm_eps", 1e-6)
    mask = min(spec["mask"], cfg.vocab_size - 2) if small else spec["mask"]
    assert mask < cfg.vocab_size and max(taps) < n
    t0 = time.time()
    dcfg = Qwen3Config(**dkw, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                       num_hidden_layers=2 if small else 5, tie_word_embeddings=False,
                       dtype=a.dtype, **NOIDS)
    dcfg.architectures = ["DFlashDraftModel"]
    dcfg.num_target_layers = n
    dcfg.block_size = 16
    dcfg.dflash_config = {"mask_token_id": mask, "target_layer_ids": taps}
    with torch.device(a.device):
        draft = DFlashDraftModel(dcfg).to(dtype).eval()
    ddir = os.path.join(root, "draft")
    draft.save_pretrained(ddir)
    del draft
    t_draft = time.time() - t0
    for d in (tdir, ddir):
        gen = os.path.join(d, "generation_config.json")
        if os.path.exists(gen):
            os.remove(gen)
        with open(os.path.join(d, "tensors.json"), "w") as f:
            json.dump(read_headers(d), f)
    man = {
        "family": fam, "published": spec["published"] + (" (tiny widths)" if a.tiny else " (small widths)" if a.small else ""),
        "published_layers": spec["published_layers"], "layers": n, "tiny": a.tiny,
        "model_type": tcfg.get("model_type"), "class": spec["cls"], "shape": shape_line(fam, kw),
        "target_params": n_params, "target_bytes": dir_bytes(tdir), "draft_bytes": dir_bytes(ddir),
        "draft": {"layers": dcfg.num_hidden_layers, "taps": taps, "mask_token_id": mask,
                  "block_size": 16, **{k: v for k, v in dkw.items() if k != "rms_norm_eps"}},
        "build_s": round(t_build, 2), "save_s": round(t_save, 2), "draft_s": round(t_draft, 2),
        "dtype": a.dtype, "device": a.device,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    with open(man_path, "w") as f:
        json.dump(man, f, indent=1)
    print(f"{fam}: {man['shape']}, {n}/{spec['published_layers']} layers, target "
          f"{man['target_bytes'] / 1e9:.2f} GB, draft {man['draft_bytes'] / 1e9:.2f} GB; "
          f"init {t_build:.1f}s, save {t_save:.1f}s, draft {t_draft:.1f}s", flush=True)
    return "built"


def cmd_build(a):
    import torch
    import transformers

    if not a.device.startswith("cuda"):
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    fams = ORDER if not a.only else [f for f in a.only.split(",") if f]
    bad = [f for f in fams if f not in FAMILIES and f not in VARIANTS]
    if bad:
        sys.exit(f"unknown families {bad}; known: {', '.join(ORDER)}")
    os.makedirs(a.models, exist_ok=True)
    status = {}
    for fam in fams:
        try:
            status[fam] = build_one(fam, a, torch, transformers)
        except Exception as e:  # one family's failure must not stop the others
            import traceback

            traceback.print_exc()
            print(f"{fam}: BUILD FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  flush=True)
            status[fam] = "failed"
            shutil.rmtree(os.path.join(a.models, fam), ignore_errors=True)
    return 0 if all(s in ("built", "skipped") for s in status.values()) else 1


def cmd_bandwidth(a):
    import torch

    dev = a.device
    cuda = dev.startswith("cuda")
    n = (2 << 30) if cuda else (256 << 20)
    x = torch.empty(n, dtype=torch.uint8, device=dev)
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ts = []
    for _ in range(10):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            y.copy_(x)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            y.copy_(x)
            ts.append(time.perf_counter() - t)
    t = statistics.median(ts)
    res = {"device": dev, "bytes_per_buffer": n, "median_s": t, "copy_Bps": 2 * n / t, "read_Bps": n / t,
           "definition": "copy_Bps = (bytes read + bytes written) / t of one device-to-device copy "
                         "(docs/perf.md's 'measured copy'); floors divide the bytes a step must "
                         "read by copy_Bps",
           "name": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"copy bandwidth ({res['name']}): {res['copy_Bps'] / 1e12:.3f} TB/s read+written "
          f"({n / 2**20:.0f} MiB buffers, median {t * 1e3:.3f} ms)", flush=True)


def cmd_list(a):
    for fam in ORDER:
        s = FAMILIES[fam]
        n = s["tiny_layers"] if a.tiny else s["layers"]
        kw = (s["tiny"] if a.tiny else s["target"])(n)
        print(f"{fam:12s} {s['published']:22s} {n:3d}/{s['published_layers']:<3d} layers  "
              f"{shape_line(fam, kw)}  taps {s.get('taps') if not a.tiny and s.get('taps') else spread_taps(n)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--models", required=True)
    b.add_argument("--only", default="")
    b.add_argument("--tiny", action="store_true")
    b.add_argument("--small", action="store_true",
                   help="kernel-sized test models (head dims the CUDA kernels take)")
    b.add_argument("--device", default="cuda")
    b.add_argument("--dtype", default="bfloat16")
    w = sub.add_parser("bandwidth")
    w.add_argument("--device", default="cuda")
    w.add_argument("--out", required=True)
    li = sub.add_parser("list")
    li.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    return {"build": cmd_build, "bandwidth": cmd_bandwidth, "list": cmd_list}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
