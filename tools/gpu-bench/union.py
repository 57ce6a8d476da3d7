"""How many experts q rows really route to, per MoE layer, in a sweep model (issue 20).

The sweep's union floor assumes uniform routing: E (1 - (1 - k/E)^q) experts for q rows. A
random-weight model's router need not route uniformly, so this counts the union the micro
bench's rows actually meet: a context of C uniform random ids and q more (the verify block),
the target run by transformers on the GPU, each router's logits recomputed from its input
(top-k of the logits = the chosen set for softmax-then-top-k and top-k-then-softmax routers;
for DeepSeek's grouped sigmoid routing this is an approximation and is marked so).

  python3 union.py MODEL_DIR [--ctx 128] [--qs 1,4,8,16] [--trials 5]
"""
import argparse
import json
import math
import os

import torch
import transformers

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--ctx", type=int, default=128)
ap.add_argument("--qs", default="1,4,8,16")
ap.add_argument("--trials", type=int, default=5)
a = ap.parse_args()
cfg = json.load(open(os.path.join(a.model, "config.json")))
tc = cfg.get("text_config", cfg)
E = tc.get("num_experts") or tc.get("num_local_experts") or tc.get("n_routed_experts")
k = tc.get("num_experts_per_tok")
model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
routers = [(n, m) for n, m in model.named_modules()
           if getattr(m, "weight", None) is not None and m.weight.dim() == 2 and m.weight.shape[0] == E
           and (n.endswith(".gate") or n.endswith(".router"))]
seen = {}
hooks = [m.register_forward_pre_hook(lambda m, args, n=n: seen.__setitem__(n, args[0].detach()))
         for n, m in routers]
qs = [int(q) for q in a.qs.split(",")]
vocab = tc["vocab_size"]
g = torch.Generator(device="cpu").manual_seed(0)
res = {q: [] for q in qs}
with torch.no_grad():
    for _ in range(a.trials):
        ids = torch.randint(0, vocab, (1, a.ctx + max(qs)), generator=g).cuda()
        seen.clear()
        model(ids)
        for n, m in routers:
            x = seen[n].reshape(-1, seen[n].shape[-1])[a.ctx:]
            logits = x.to(m.weight.dtype) @ m.weight.T
            if getattr(m, "bias", None) is not None:
                logits = logits + m.bias
            top = logits.float().topk(k, dim=-1).indices
            for q in qs:
                res[q].append(len(set(top[:q].flatten().tolist())))
for h in hooks:
    h.remove()
grouped = "n_group" in tc and (tc.get("topk_group") or 1) < (tc.get("n_group") or 1)
print(f"{os.path.basename(os.path.dirname(a.model.rstrip('/')))}: E={E} k={k}, {len(routers)} routers"
      + (" (grouped routing: top-k of logits approximates)" if grouped else ""))
for q in qs:
    v = res[q]
    uni = E * (1 - (1 - k / E) ** q)
    print(f"  q={q:>2}: union mean {sum(v) / len(v):6.1f} (min {min(v)}, max {max(v)}) vs uniform {uni:6.1f}")
