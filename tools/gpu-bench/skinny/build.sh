#!/usr/bin/env bash
# Build the skinny-GEMM lab for the H200 (sm_90a) on a machine without a GPU:
#   source ../shared/tools/cuda-env.sh; tools/gpu-bench/skinny/build.sh [out]
# Run there: LD_LIBRARY_PATH=<torch's nvidia/cu13/lib> ./skinny [iters]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/skinny}
nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -o "$out" "$here/skinny.cu" -L"$CUDA_HOME/lib64" -L"$(readlink -f "$CUDA_HOME/bin")/../lib" -lcublas -diag-suppress 128
nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -o "$(dirname "$out")/affine_lab" "$here/affine_lab.cu" -L"$CUDA_HOME/lib64" -L"$(readlink -f "$CUDA_HOME/bin")/../lib" -diag-suppress 128,177
