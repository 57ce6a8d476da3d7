"""Pure-Python helpers shared by the golden generators (no torch import here).

Everything in this module is testable without torch: config dictionaries, the
rewriting of a transformers-5 config.json into the transformers-4 RoPE spelling,
the reconstruction of DFlash decode steps from recorded calls, and the choice
of the stop-token variant. `selftest.py` exercises it.
"""

from __future__ import annotations

import json
import os
import platform
import sys

VOCAB = 256

# ---------------------------------------------------------------------------
# Part 1: target configs (built in transformers-5 form, written as "spelling")
# ---------------------------------------------------------------------------

_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def target_configs() -> dict:
    """name -> {"cls", "config" (kwargs, tf5 spelling), "spelling", "drop_head_dim"}."""
    return {
        "qwen3": dict(
            cls="Qwen3ForCausalLM",
            config=dict(
                _BASE,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,  # deliberately != hidden/heads = 16
                tie_word_embeddings=False,
                attention_bias=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            ),
            spelling="tf4",  # top-level rope_theta, no rope_scaling
            drop_head_dim=False,
        ),
        "qwen3_yarn_tied": dict(
            cls="Qwen3ForCausalLM",
            config=dict(
                _BASE,
                max_position_embeddings=256,  # 256/32 = 8 != factor 4
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=32,
                tie_word_embeddings=True,
                attention_bias=False,
                rope_parameters={
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                },
            ),
            spelling="tf5",  # rope_parameters as written by transformers 5
            drop_head_dim=False,
        ),
        "llama3": dict(
            cls="LlamaForCausalLM",
            config=dict(
                _BASE,
                num_attention_heads=4,
                num_key_value_heads=1,
                tie_word_embeddings=False,
                attention_bias=False,
                mlp_bias=False,
                # original_max_position_embeddings 64 (not 16): with head_dim 16 and
                # theta 5e5 the wavelengths are 6.3, 32.5, 168, ...; thresholds
                # 64/4=16 and 64 put one frequency in each llama3 regime
                # (unscaled, smoothed, divided by factor).
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            spelling="tf4",  # rope_theta + rope_scaling{"rope_type": "llama3", ...}
            drop_head_dim=True,  # head_dim derived = 64/4 = 16
        ),
        "llama_linear_tied": dict(
            cls="LlamaForCausalLM",
            config=dict(
                _BASE,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=16,
                tie_word_embeddings=True,
                attention_bias=True,
                mlp_bias=False,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            ),
            spelling="tf4_legacy_type",  # rope_scaling{"type": "linear", "factor": 2.0}
            drop_head_dim=False,
        ),
    }


def rewrite_config_spelling(cfg: dict, spelling: str, drop_head_dim: bool = False) -> dict:
    """Return a copy of a transformers-5 config.json dict in the requested RoPE spelling.

    tf5: keep `rope_parameters` (drop any `rope_theta` / `rope_scaling`).
    tf4: `rope_theta` top level + `rope_scaling` {"rope_type": ..., ...} (absent for default).
    tf4_legacy_type: same, but the scaling dict uses the old key `type`.
    """
    out = dict(cfg)
    rp = out.pop("rope_parameters", None)
    legacy_scaling = out.pop("rope_scaling", None)
    legacy_theta = out.pop("rope_theta", None)
    if rp is None:
        rp = dict(legacy_scaling or {})
        if legacy_theta is not None:
            rp.setdefault("rope_theta", legacy_theta)
    rp = dict(rp)
    if spelling == "tf5":
        rp.setdefault("rope_type", rp.pop("type", "default"))
        out["rope_parameters"] = rp
    elif spelling in ("tf4", "tf4_legacy_type"):
        theta = rp.pop("rope_theta")
        rtype = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
        rp.pop("type", None)
        out["rope_theta"] = theta
        if rtype != "default":
            key = "type" if spelling == "tf4_legacy_type" else "rope_type"
            out["rope_scaling"] = {key: rtype, **rp}
    else:
        raise ValueError(spelling)
    if drop_head_dim:
        out.pop("head_dim", None)
    return out


def normalized_rope(rp: dict) -> dict:
    """Rope params without the legacy duplicate `type` key, for comparisons."""
    d = dict(rp or {})
    if "type" in d:
        d.setdefault("rope_type", d["type"])
        d.pop("type")
    return {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v) for k, v in d.items()}


# ---------------------------------------------------------------------------
# Part 2: DFlash cases
# ---------------------------------------------------------------------------

_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

LLAMA3_CASE_ROPE = {
    # head_dim 8 -> wavelengths 6.3, 167, 4450, 118000; thresholds 256/4=64 and 256
    # give one unscaled, one smoothed, two divided frequencies.
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

YARN_CASE_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def dflash_cases() -> dict:
    """name -> case description (target kwargs, draft config.json dict, run params)."""
    cases = {}

    # (1) qwen3 target 4 layers, draft 2 layers, 3 taps, block 16 (top-level block_size)
    cases["qwen3_b16"] = dict(
        target_cls="Qwen3ForCausalLM",
        target=dict(
            _SMALL,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,  # != 32/4
            tie_word_embeddings=False,
            attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        target_spelling="tf4",
        draft=dict(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            attention_bias=False,
            max_position_embeddings=512,
            vocab_size=VOCAB,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            num_target_layers=4,
            block_size=16,
            dflash_config={"mask_token_id": 255, "target_layer_ids": [0, 1, 2]},
        ),
        block_size=16,
        mask_token_id=255,
        prompt_len=20,
        max_new_tokens=64,
    )

    # (2) llama3-rope llama target, draft 1 layer, 2 taps, block 8 inside dflash_config
    #     (top-level block_size says 16 on purpose: dflash_config takes precedence)
    cases["llama3_b8"] = dict(
        target_cls="LlamaForCausalLM",
        target=dict(
            _SMALL,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            rope_parameters=dict(LLAMA3_CASE_ROPE),
        ),
        target_spelling="tf4",
        target_drop_head_dim=True,
        draft=dict(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            rms_norm_eps=1e-6,
            attention_bias=False,
            max_position_embeddings=512,
            vocab_size=VOCAB,
            tie_word_embeddings=False,
            rope_theta=LLAMA3_CASE_ROPE["rope_theta"],
            rope_scaling={k: v for k, v in LLAMA3_CASE_ROPE.items() if k != "rope_theta"},
            num_target_layers=3,
            block_size=16,
            dflash_config={"mask_token_id": 200, "target_layer_ids": [0, 1], "block_size": 8},
        ),
        block_size=8,
        mask_token_id=200,
        prompt_len=16,
        max_new_tokens=48,
    )

    # (3) tied qwen3 (yarn) target, draft 2 layers (sliding window 8, then full), block 4
    cases["qwen3_tied_swa_b4"] = dict(
        target_cls="Qwen3ForCausalLM",
        target=dict(
            _SMALL,
            num_hidden_layers=3,
            max_position_embeddings=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            attention_bias=False,
            rope_parameters=dict(YARN_CASE_ROPE),
        ),
        target_spelling="tf5",
        draft=dict(
            architectures=["DFlashDraftModel"],
            model_type="qwen3",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            attention_bias=False,
            max_position_embeddings=256,
            vocab_size=VOCAB,
            tie_word_embeddings=True,
            rope_parameters=dict(YARN_CASE_ROPE),
            layer_types=["sliding_attention", "full_attention"],
            use_sliding_window=True,  # transformers' Qwen3Config nulls sliding_window without it
            sliding_window=8,
            max_window_layers=0,
            num_target_layers=3,
            block_size=4,
            dflash_config={"mask_token_id": 3, "target_layer_ids": [0, 1], "block_size": 4},
        ),
        block_size=4,
        mask_token_id=3,
        prompt_len=26,
        max_new_tokens=48,
    )
    return cases


# Selection grid: the target is made low-entropy by scaling a few lm_head rows.
def candidate_grid() -> list:
    grid = []
    for seed in range(10):
        for n_boost in (1, 2, 3, 4, 6):
            for boost in (1.5, 2.0, 3.0, 5.0, 8.0):
                grid.append(dict(seed=seed, n_boost=n_boost, boost=boost))
    return grid


# top-1 minus top-2 logit along every argmax the loop uses: no near ties. f32 engines differ from
# torch by ~1e-4 at most on these logits; bf16 would need far more.
MIN_MARGIN = 0.005


# ---------------------------------------------------------------------------
# Trace logic (mirrors the reference's temperature-0 loop)
# ---------------------------------------------------------------------------


def leading_accept(block_ids: list, posterior: list) -> int:
    """Number of leading i in 1..Q-1 with block[i] == posterior[i-1]."""
    a = 0
    for i in range(1, len(block_ids)):
        if block_ids[i] == posterior[i - 1]:
            a += 1
        else:
            break
    return a


def build_steps(prompt_len: int, max_new_tokens: int, block_size: int, verify_calls: list,
                draft_calls: list, stop_token_ids=None) -> tuple:
    """Rebuild decode steps from recorded calls.

    verify_calls: [{"ids": [Q], "positions": [Q], "posterior": [Q]}] (target calls after prefill)
    draft_calls:  [{"positions": [ctx+Q], "ctx_len": int, "draft_ids": [Q-1]}] (same count)
    Returns (steps, committed_generated_ids_after_first) where steps hold
    start, ctx_len, verify_size, block_ids, posterior_ids, accepted, bonus, produced.
    """
    max_length = prompt_len + max_new_tokens
    steps = []
    committed = []
    start = prompt_len
    for i, vc in enumerate(verify_calls):
        block = list(vc["ids"])
        post = list(vc["posterior"])
        q = len(block)
        assert vc["positions"] == list(range(start, start + q)), (vc["positions"], start, q)
        assert q == min(block_size, max_length - start), (q, block_size, start)
        a = leading_accept(block, post)
        bonus = post[a]
        new = block[1:a + 1] + [bonus]
        produced = min(a + 1, max_length - start - 1)
        new = new[:produced]
        stopped = False
        if stop_token_ids:
            for j, t in enumerate(new):
                if t in stop_token_ids:
                    produced = j + 1
                    new = new[:produced]
                    stopped = True
                    break
        step = dict(
            start=start,
            verify_size=q,
            block_ids=block,
            posterior_ids=post,
            accepted=a,
            bonus=bonus,
            produced=produced,
        )
        if i < len(draft_calls):
            dc = draft_calls[i]
            step["ctx_len"] = dc["ctx_len"]
            step["ctx_start"] = dc["positions"][0]
            assert dc["positions"] == list(range(start - dc["ctx_len"], start + q)), (dc["positions"], start)
            assert dc["draft_ids"] == block[1:], (dc["draft_ids"], block)
        steps.append(step)
        committed.extend(new)
        start += produced
        if stopped:
            break
    return steps, committed


def choose_stop_variant(generated: list, steps: list, prompt_len: int, min_index: int = 6):
    """Pick a stop token that first appears at generated index j >= min_index, preferring a j
    that is not the last token committed in its step (so later accepted tokens get cut).
    Returns (token, j, cut_inside_step) or None."""
    # step boundaries in generated-index space: generated[0] comes from the prefill
    owner = {}
    for s in steps:
        first = s["start"] + 1 - prompt_len
        for k in range(s["produced"]):
            owner[first + k] = (first, s["produced"])
    best = None
    for j in range(max(1, min_index), len(generated)):
        t = generated[j]
        if t in generated[:j]:
            continue
        first, produced = owner.get(j, (j, 1))
        inside = j < first + produced - 1
        cand = (0 if inside else 1, j, t, inside)
        if best is None or cand < best:
            best = cand
        if inside:
            break
    if best is None:
        return None
    return best[2], best[1], best[3]


def score(steps: list, block_size: int, equal_greedy: bool, min_margin: float, generated: list) -> tuple:
    """Higher is better: exactness and no near ties first, then a mix of accepted lengths
    (0, partial, full block), a varied output, varied accepted lengths, enough steps."""
    accs = [s["accepted"] for s in steps]
    full = any(s["accepted"] == s["verify_size"] - 1 and s["verify_size"] == block_size for s in steps)
    zero = any(a == 0 for a in accs)
    partial = any(0 < s["accepted"] < s["verify_size"] - 1 for s in steps)
    return (
        int(equal_greedy),
        int(min_margin >= MIN_MARGIN),
        int(zero) + int(partial) + int(full),
        min(len(set(generated)), 3),
        min(len(set(accs)), 6),
        min(len(steps), 12),
        round(min_margin, 4),
    )


def good_enough(sc: tuple) -> bool:
    return sc[:3] == (1, 1, 3) and sc[3] >= 3 and sc[4] >= 5 and sc[5] >= 8


# ---------------------------------------------------------------------------
# Misc
# ---------------------------------------------------------------------------


def versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform(), "machine": platform.machine()}
    try:
        from importlib.metadata import version

        for pkg in ("torch", "transformers", "safetensors", "numpy", "dflash"):
            try:
                out[pkg] = version(pkg)
            except Exception:  # noqa: BLE001
                out[pkg] = None
    except Exception:  # noqa: BLE001
        pass
    return out


def dumps_compact(obj) -> str:
    """JSON with one top-level key per line; lists of dicts one element per line; the rest compact."""
    c = dict(separators=(", ", ": "))
    if not isinstance(obj, dict):
        return json.dumps(obj, **c)
    lines = []
    for k, v in obj.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            inner = ",\n".join("  " + json.dumps(x, **c) for x in v)
            lines.append(f"{json.dumps(k)}: [\n{inner}\n ]")
        else:
            lines.append(f"{json.dumps(k)}: {json.dumps(v, **c)}")
    return "{\n " + ",\n ".join(lines) + "\n}\n"


def write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = dumps_compact(obj)
    assert json.loads(text) == json.loads(json.dumps(obj))
    with open(path, "w") as f:
        f.write(text)
