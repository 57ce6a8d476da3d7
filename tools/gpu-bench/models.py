#!/usr/bin/env python3
"""Random-weight target + DFlash drafts at real shapes, with controlled acceptance.

Speed does not depend on weight values; acceptance does. The weights are random (transformers'
own init) except for three tensors that pin what the models predict, with margins large enough
that bf16 rounding in two different engines cannot flip a greedy argmax:
  - every embedding row (the mask token's too) gets a large component on dim 0, so the residual
    stream's dim 0 dominates at every position of the target and of the draft;
  - the target's final norm weight is e0 and the LM head has W[A] = e0, W[B] = beta*e0 (other
    rows small), so target logits are hn_0 * (1, beta) for (A, B): greedy, the target always
    says A; at temperature 1, beta is calibrated so that p(A) = 0.8;
  - the draft's final norm weight picks what it proposes (it borrows the target's head):
      agree: 10*e0 -> A with a logit gap 10x the target's (q(A) ~ 1 at temperature 1)
      zero:  -e0   -> always B: nothing is accepted (tau = 1)
Three acceptance levels: high = agree at T=0 (tau = block size), mid = agree at T=1 (each draft
token accepted with probability p(A) = 0.8: tau ~ 4.6 for block 16), zero = zero at T=0.
Shapes: qwen3-8b (the issue's Qwen3-8B + z-lab/Qwen3-8B-DFlash-b16 shapes) and tiny (a CPU smoke
test of this script and the ones after it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

SHAPES = {
    "qwen3-8b": dict(
        target=dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=False),
        draft_layers=5, taps=[1, 9, 17, 25, 33], block=16, mask=151669,
    ),
    # Qwen3.5-9B (hybrid: 3 Gated DeltaNet layers per full-attention layer; transformers'
    # Qwen3_5TextConfig defaults are this shape) with a Qwen3-layer draft of hidden 4096.
    "qwen3.5-9b": dict(
        arch="qwen3_5",
        target=dict(),
        draft=dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=248320,
                   max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=False),
        draft_layers=5, taps=[1, 8, 15, 22, 29], block=16, mask=248000,
    ),
    # SmolLM2-135M's widths (the demo target, llama with qwen3's q/k norms added) for a
    # target-only timing of the self-generation's batch step (issue 26): --target-only.
    "smollm2-135m": dict(
        target=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    rms_norm_eps=1e-5, tie_word_embeddings=True),
        draft_layers=4, taps=[1, 10, 19, 28], block=16, mask=0,
    ),
    "tiny-hybrid": dict(
        arch="qwen3_5",
        target=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, vocab_size=1024),
        draft=dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, vocab_size=1024,
                   max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
                   tie_word_embeddings=False),
        draft_layers=2, taps=[1, 2], block=16, mask=1000,
    ),
    "tiny": dict(
        target=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    vocab_size=1024, max_position_embeddings=4096, rope_theta=1000000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=False),
        draft_layers=2, taps=[1, 4], block=16, mask=1000,
    ),
}
TOKEN_A, TOKEN_B = 11, 12
P_GAP = 1.3862943611198906  # ln 4: p(A) = 0.8 at temperature 1
EMBED_DIM0 = 1000.0  # >> the ~N(0, 13) that 36 random layers add to a residual dim
NORM_C = 1.0


def build(shape: str, device: str, dtype_name: str, target_only: bool = False):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    s = SHAPES[shape]
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    if s.get("arch") == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(**s["target"], torch_dtype=dtype_name, bos_token_id=None,
                                eos_token_id=None, pad_token_id=None)
        cls = Qwen3_5ForCausalLM
    else:
        cfg = Qwen3Config(**s["target"], torch_dtype=dtype_name, bos_token_id=None,
                          eos_token_id=None, pad_token_id=None)
        cls = Qwen3ForCausalLM
    t0 = time.time()
    with torch.device(device):
        target = cls(cfg).to(dtype).eval()
    with torch.no_grad():
        emb = target.model.embed_tokens.weight
        emb[:, 0] = EMBED_DIM0
        target.model.norm.weight.zero_()
        target.model.norm.weight[0] = NORM_C
        head = target.lm_head.weight
        head[:, 0] *= 0.01
        head[TOKEN_A, :] = 0
        head[TOKEN_B, :] = 0
        head[TOKEN_A, 0] = 1.0
        # Calibrate beta: with B's row zero, the logit of A is hn_0 at each position.
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=g).to(device)
        hn0 = target(ids).logits[0, :, TOKEN_A].float().median().item()
        head[TOKEN_B, 0] = 1.0 - P_GAP / hn0
    print(f"target built in {time.time() - t0:.1f}s (hn_0 ~ {hn0:.1f})", flush=True)
    if target_only:
        return target, None

    from dflash.model import DFlashDraftModel

    dcfg = Qwen3Config(**{**s.get("draft", s["target"]), "num_hidden_layers": s["draft_layers"]},
                       torch_dtype=dtype_name, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)
    dcfg.architectures = ["DFlashDraftModel"]
    dcfg.num_target_layers = cfg.num_hidden_layers
    dcfg.block_size = s["block"]
    dcfg.dflash_config = {"mask_token_id": s["mask"], "target_layer_ids": s["taps"]}
    with torch.device(device):
        draft = DFlashDraftModel(dcfg).to(dtype).eval()
    return target, draft


def set_draft_mode(draft, mode: str):
    import torch

    with torch.no_grad():
        w = draft.norm.weight
        w.zero_()
        if mode == "agree":
            w[0] = 10 * NORM_C
        elif mode == "zero":
            w[0] = -NORM_C
        else:
            raise ValueError(mode)


def save(target, draft, out: str, modes):
    t0 = time.time()
    target.save_pretrained(os.path.join(out, "target"), max_shard_size="4GB")
    for m in modes if draft is not None else []:
        set_draft_mode(draft, m)
        draft.save_pretrained(os.path.join(out, f"draft-{m}"))
    print(f"saved in {time.time() - t0:.1f}s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target-only", action="store_true", help="no drafts (no dflash package needed)")
    a = ap.parse_args()
    target, draft = build(a.shape, a.device, a.dtype, a.target_only)
    save(target, draft, a.out, ["agree", "zero"])
    json.dump({"shape": a.shape, **SHAPES[a.shape], "token_a": TOKEN_A},
              open(os.path.join(a.out, "shape.json"), "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
