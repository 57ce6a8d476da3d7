"""Layer 0 of a llama-architecture Q4_1 GGUF (SmolLM2) in numpy, with llama.cpp's x86 int8
activation rule for every Q4_1 product (Q8_1 blocks: q = rint(x * 127 / amax), d and s as
f16) and everything else in f64 (norms, rope in ggml's mode 0, softmax). Prints each row's
first and last three outputs, to set beside `llama-eval-callback ... -ctk f32 -ctv f32 -fa off`
(l_out-0) and `LAYER_SUMS=1 gguf_greedy FILE "prompt"` (dflash). Needs `pip install numpy gguf`.

usage: python3 tools/llama-cpp-fixtures/ref_layer0.py FILE.gguf ID [ID ...]
(session 48: ids 504 3575 282 4649 314 253 2240 351 = "The capital of France is a city with")
"""
import numpy as np, gguf, sys

r = gguf.GGUFReader(sys.argv[1])
T = {t.name: t for t in r.tensors}
def W(n):
    t = T[n]
    a = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(a, dtype=np.float64).reshape([int(x) for x in reversed(t.shape)]) if a.ndim == 1 else np.asarray(a, dtype=np.float64)
def kv(k):
    f = r.fields[k]; return f.parts[f.data[0]][0]
ids = [int(i) for i in sys.argv[2:]]
eps = float(kv("llama.attention.layer_norm_rms_epsilon")); base = float(kv("llama.rope.freq_base"))
nh = int(kv("llama.attention.head_count")); nkv = int(kv("llama.attention.head_count_kv"))
emb = W("token_embd.weight"); x = emb[ids]
d = x.shape[1]; hd = d // nh
def rms(v, w): return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w
def rope_normal(q):  # ggml mode 0: pairs (2i, 2i+1)
    n, h, dd = q.shape
    inv = base ** (-np.arange(0, dd, 2) / dd)
    ang = np.arange(n)[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = q[..., 0::2], q[..., 1::2]
    out = np.empty_like(q); out[..., 0::2] = a * c - b * s; out[..., 1::2] = a * s + b * c
    return out
def q41_parts(n):
    t = T[n]; raw = np.asarray(t.data, dtype=np.uint8)
    rows = int(t.shape[1]); cols = int(t.shape[0]); nb = cols // 32
    b = raw.reshape(rows, nb, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
    qs = b[..., 4:20]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float64)  # [rows, nb, 32]
    return d, m, q
def qmm(x, n):
    assert T[n].tensor_type == gguf.GGMLQuantizationType.Q4_1, T[n].tensor_type
    d, m, q = q41_parts(n)
    n_rows, nb = d.shape
    out = np.zeros((x.shape[0], n_rows))
    for r, xr in enumerate(x):
        xb = xr.astype(np.float32).reshape(nb, 32)
        amax = np.abs(xb).max(-1)
        dd = (amax / np.float32(127)).astype(np.float32)
        inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        qx = np.rint((xb * inv[:, None]).astype(np.float32)).astype(np.float64)
        d16 = dd.astype(np.float16).astype(np.float64)
        s16 = (dd.astype(np.float64) * qx.sum(-1)).astype(np.float32).astype(np.float16).astype(np.float64)
        sumi = np.einsum("rbk,bk->rb", q, qx)
        out[r] = (d * d16[None, :] * sumi + m * s16[None, :]).sum(-1)
    return out
L = 0
h = rms(x, W(f"blk.{L}.attn_norm.weight"))
q = qmm(h, f"blk.{L}.attn_q.weight").reshape(len(ids), nh, hd)
k = qmm(h, f"blk.{L}.attn_k.weight").reshape(len(ids), nkv, hd)
v = qmm(h, f"blk.{L}.attn_v.weight").reshape(len(ids), nkv, hd)
q, k = rope_normal(q), rope_normal(k)
g = nh // nkv
o = np.zeros((len(ids), nh, hd))
for hh in range(nh):
    kk, vv = k[:, hh // g], v[:, hh // g]
    s = q[:, hh] @ kk.T / np.sqrt(hd)
    s = s + np.triu(np.full((len(ids), len(ids)), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
    o[:, hh] = p @ vv
x = x + qmm(o.reshape(len(ids), d), f"blk.{L}.attn_output.weight")
h = rms(x, W(f"blk.{L}.ffn_norm.weight"))
gt = qmm(h, f"blk.{L}.ffn_gate.weight"); up = qmm(h, f"blk.{L}.ffn_up.weight")
x = x + qmm((gt / (1 + np.exp(-gt))) * up, f"blk.{L}.ffn_down.weight")
for i, row in enumerate(x):
    print(f"row {i}: {np.round(row[:3], 4)} ... {np.round(row[-3:], 4)}")
