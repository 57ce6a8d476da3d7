"""torch / transformers helpers shared by the golden generators (CPU, float32)."""

from __future__ import annotations

import json
import os

import torch

from gold_common import normalized_rope, rewrite_config_spelling

STD_MATRIX = 0.12
STD_EMBED = 0.3
STD_BIAS = 0.1


def setup() -> None:
    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)  # tiny matrices; deterministic; cases run as parallel processes
    torch.manual_seed(0)


def model_class(name: str):
    import transformers

    return getattr(transformers, name)


def config_class(model_cls_name: str):
    from transformers import LlamaConfig, Qwen3Config

    return {"Qwen3ForCausalLM": Qwen3Config, "LlamaForCausalLM": LlamaConfig}[model_cls_name]


@torch.no_grad()
def reinit_(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter with values much larger than HF's 0.02 default.

    matrices N(0, 0.12), embeddings N(0, 0.3), biases N(0, 0.1), norm weights U[0.5, 1.5].
    Tied parameters appear once in named_parameters(), so ties survive.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 1 and "norm" in name:
            v = torch.rand(p.shape, generator=g) + 0.5
        elif p.ndim == 1:
            v = torch.randn(p.shape, generator=g) * STD_BIAS
        elif "embed_tokens" in name:
            v = torch.randn(p.shape, generator=g) * STD_EMBED
        else:
            v = torch.randn(p.shape, generator=g) * STD_MATRIX
        p.copy_(v.to(p.dtype))


def build_target(cls_name: str, cfg_kwargs: dict, seed: int):
    cfg = config_class(cls_name)(**json.loads(json.dumps(cfg_kwargs)))
    torch.manual_seed(seed)
    model = model_class(cls_name)._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.eval()
    reinit_(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "tie lost"
    return model


def save_target(model, out_dir: str, spelling: str, drop_head_dim: bool = False):
    """save_pretrained (safetensors, f32), rewrite config.json into `spelling`, reload and
    check that the files load back to the identical model. Returns the reloaded model."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    gen = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    cpath = os.path.join(out_dir, "config.json")
    with open(cpath) as f:
        written = json.load(f)
    cfg = rewrite_config_spelling(written, spelling, drop_head_dim)
    with open(cpath, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    st = os.path.join(out_dir, "model.safetensors")
    assert os.path.exists(st), os.listdir(out_dir)
    with safe_open(st, "pt") as f:
        names = sorted(f.keys())
        dtypes = {str(f.get_tensor(k).dtype) for k in names}
    assert dtypes == {"torch.float32"}, dtypes

    reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="sdpa")
    reloaded.eval()
    # identical config where it matters
    a, b = model.config, reloaded.config
    assert normalized_rope(a.rope_parameters) == normalized_rope(b.rope_parameters), (
        a.rope_parameters,
        b.rope_parameters,
    )
    for k in ("head_dim", "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "attention_bias",
              "hidden_size", "num_hidden_layers", "vocab_size", "rms_norm_eps", "max_position_embeddings"):
        assert getattr(a, k, None) == getattr(b, k, None), (k, getattr(a, k, None), getattr(b, k, None))
    sa, sb = model.state_dict(), reloaded.state_dict()
    assert sa.keys() == sb.keys(), (sa.keys() ^ sb.keys())
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    ids = torch.arange(0, 40, dtype=torch.long)[None] * 5 % a.vocab_size
    with torch.inference_mode():
        la = model(ids).logits
        lb = reloaded(ids).logits
    assert torch.equal(la, lb), (la - lb).abs().max()
    info = {
        "config_written_by_transformers": written,
        "tensor_names": names,
        "rope_parameters_loaded": normalized_rope(b.rope_parameters),
    }
    return reloaded, info


@torch.inference_mode()
def forward_checked(model, ids: torch.Tensor):
    """Full forward with output_hidden_states; verifies that hidden_states[k+1] is the output of
    decoder layer k for k < L-1 and that hidden_states[L] is the FINAL-NORMED output of layer L-1."""
    layers = model.model.layers
    L = len(layers)
    captured = {}

    def mk(i):
        def hook(_m, _a, o):
            captured[i] = (o[0] if isinstance(o, tuple) else o).detach().clone()

        return hook

    hs_ = [layers[i].register_forward_hook(mk(i)) for i in range(L)]
    try:
        out = model(ids, output_hidden_states=True)
    finally:
        for h in hs_:
            h.remove()
    hs = out.hidden_states
    assert len(hs) == L + 1, len(hs)
    for k in range(L - 1):
        assert torch.equal(hs[k + 1], captured[k]), k
    normed = model.model.norm(captured[L - 1])
    assert torch.allclose(hs[L], normed, atol=1e-6, rtol=0), "last hidden state is not the final-normed output"
    assert not torch.allclose(hs[L], captured[L - 1]), "last hidden state unexpectedly equals the raw layer output"
    return out, captured
