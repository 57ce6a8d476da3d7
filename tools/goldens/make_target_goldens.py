#!/usr/bin/env python3
"""Part 1: tiny random HF targets + full-forward goldens (logits and two hidden-state taps).

Writes <out>/targets/<name>/{config.json, model.safetensors, golden.safetensors, golden.json}.
Runs on CPU in float32. Usage: python3 make_target_goldens.py --out DIR
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gold_common import target_configs, versions, write_json  # noqa: E402

T = 41


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    import gold_torch as gt

    gt.setup()
    vers = versions()
    print("versions:", vers, flush=True)

    for idx, (name, spec) in enumerate(target_configs().items()):
        seed = 100 + idx
        model = gt.build_target(spec["cls"], spec["config"], seed)
        d = os.path.join(args.out, "targets", name)
        model, info = gt.save_target(model, d, spec["spelling"], spec["drop_head_dim"])

        L = model.config.num_hidden_layers
        taps = [0, L - 2]
        g = torch.Generator().manual_seed(1000 + idx)
        input_ids = torch.randint(0, model.config.vocab_size, (T,), generator=g, dtype=torch.long)
        out, _ = gt.forward_checked(model, input_ids[None])
        logits = out.logits[0].float().contiguous()
        tensors = {"input_ids": input_ids.contiguous(), "logits": logits}
        for k in taps:
            tensors[f"hidden_{k}"] = out.hidden_states[k + 1][0].float().contiguous()
        save_file(tensors, os.path.join(d, "golden.safetensors"), metadata={"format": "pt"})

        probs = torch.softmax(logits, -1)
        ent = float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean())
        write_json(
            os.path.join(d, "golden.json"),
            {
                "taps": taps,
                "T": T,
                "model_class": spec["cls"],
                "config_spelling": spec["spelling"],
                "head_dim_in_config": not spec["drop_head_dim"],
                "rope_parameters_as_loaded_by_transformers": info["rope_parameters_loaded"],
                "weight_names": info["tensor_names"],
                "tensors": {
                    "input_ids": ["int64", [T]],
                    "logits": ["float32", [T, model.config.vocab_size]],
                    **{f"hidden_{k}": ["float32", [T, model.config.hidden_size]] for k in taps},
                },
                "stats": {
                    "mean_entropy_nats": round(ent, 4),
                    "uniform_entropy_nats": round(float(torch.log(torch.tensor(float(model.config.vocab_size)))), 4),
                    "logits_std": round(float(logits.std()), 4),
                },
                "versions": vers,
                "notes": (
                    "One full forward (no cache) of input_ids at positions 0..T-1, batch 1, CPU float32, "
                    "sdpa attention, causal. logits: all positions. hidden_k = output_hidden_states[k+1] "
                    "= output of decoder layer k (residual stream after the MLP add, before the final "
                    "norm); verified against forward hooks on the decoder layers. "
                    "output_hidden_states[L] (the last entry) is the FINAL-NORMED output in transformers "
                    "5, so no tap uses layer L-1. Weights: matrices N(0,0.12), embeddings N(0,0.3), "
                    "biases N(0,0.1), norm weights U[0.5,1.5]. config.json rewritten after "
                    "save_pretrained into the spelling named in config_spelling and verified to load "
                    "back to bit-identical logits in transformers."
                ),
            },
        )
        print(f"{name}: taps={taps} logits_std={float(logits.std()):.3f} entropy={ent:.3f} "
              f"files={sorted(os.listdir(d))}", flush=True)


if __name__ == "__main__":
    main()
