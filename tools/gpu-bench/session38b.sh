#!/usr/bin/env bash
# Session 38, tests of this session's build on the GPU: the affine-expert test with its
# corrected bound (the tensor cores' rounding, not bit equality), the MoE checkpoints over
# affine stacks, the batch's verify choices together == each sequence's alone, and the
# batched / graphs / verify == decode invariants the engine change could touch.
#   run(command="bash tools/gpu-bench/session38b.sh", carry=[".device/fused_cuda.xz", "tools/goldens/wheels"])
set -uo pipefail
T0=$SECONDS
. "$(dirname "$0")/env.sh" fused_cuda
begin_session s38b
fused_tests tests ${TEST_LIMIT:-300} ${TESTS:-affine_experts int4_moe mlx_moe batch_choices device_sampler forward_batch batched_attention verify_rows every_family}
echo "### done in $((SECONDS - T0)) s"
