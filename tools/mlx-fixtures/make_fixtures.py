"""Record MLX's own affine quantization of small matrices, for crates/dflash/tests/mlx.rs.

Writes crates/dflash/tests/fixtures/mlx/affine.safetensors with, for every bits in
{2, 3, 4, 5, 6, 8} and group size in {32, 64, 128} (prefix `b{bits}_g{group}`), and for a
few bf16 / f16 inputs (prefix `b{bits}_g{group}_{dtype}`):

  .input        the matrix given to mx.quantize (its dtype: f32, bf16 or f16)
  .weight       packed uint32, as mx.quantize returns it
  .scales       .biases  (the input's dtype)
  .dequantized  f32: mx.dequantize of the f32-upcast scales/biases (the exact w = s*q + b)

The matrices have ordinary random groups and the edge cases of MLX's rules: a constant
group, an all-zero group, an all-negative group, a group with one outlier.

Run (no Apple hardware needed: MLX has a Linux CPU build on PyPI):
    python3 -m pip download --no-deps mlx==0.32.4 mlx-cpu==0.32.4 -d /tmp/mlxdl
    python3 -m pip install --no-deps --target /tmp/mlxenv /tmp/mlxdl/*.whl
    PYTHONPATH=/tmp/mlxenv python3 tools/mlx-fixtures/make_fixtures.py
"""

import os

import mlx.core as mx
import numpy as np

ROWS, COLS = 3, 256
OUT = os.path.join(
    os.path.dirname(__file__), "../../crates/dflash/tests/fixtures/mlx/affine.safetensors"
)


def matrix(seed):
    r = np.random.default_rng(seed)
    w = r.normal(0.0, 0.1, size=(ROWS, COLS)).astype(np.float32)
    w[0, 0:32] = 0.03125  # constant group (at every group size: the first 32 are equal)
    w[1, 32:64] = 0.0  # zeros
    w[2, 0:128] = -np.abs(w[2, 0:128]) - 0.01  # all negative
    w[1, 200] = 1.5  # outlier
    return w


def main():
    tensors = {}
    for bits in [2, 3, 4, 5, 6, 8]:
        for group in [32, 64, 128]:
            variants = [("", mx.float32)]
            if group == 64 and bits in (4, 8):
                variants += [("_bf16", mx.bfloat16), ("_f16", mx.float16)]
            for suffix, dt in variants:
                name = f"b{bits}_g{group}{suffix}"
                w = mx.array(matrix(bits * 1000 + group)).astype(dt)
                q, s, b = mx.quantize(w, group_size=group, bits=bits)
                d = mx.dequantize(
                    q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits
                )
                assert q.dtype == mx.uint32 and q.shape == (ROWS, COLS * bits // 32)
                tensors[f"{name}.input"] = w
                tensors[f"{name}.weight"] = q
                tensors[f"{name}.scales"] = s
                tensors[f"{name}.biases"] = b
                tensors[f"{name}.dequantized"] = d.astype(mx.float32)
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    mx.save_safetensors(OUT, tensors, metadata={"mlx": mx.__version__})
    print(f"wrote {len(tensors)} tensors to {OUT} (mlx {mx.__version__})")


if __name__ == "__main__":
    main()
