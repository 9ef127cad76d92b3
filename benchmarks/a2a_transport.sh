#!/usr/bin/env bash
# The ragged all-to-all under each XLA:GPU transport setting (one process each: XLA_FLAGS is read
# at start-up). bash benchmarks/a2a_transport.sh [a2a_transport flags...]
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
run() {
  XLA_FLAGS="$2" timeout 150 python3 -m benchmarks.a2a_transport --label="$1" "${@:3}" 2>&1 \
    | grep '^{' || echo "{\"label\": \"$1\", \"failed\": true}"
}
run default "" "$@"
run one_shot "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=true" "$@"
run device_kernel "--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true" "$@"
run symmetric "--xla_gpu_ragged_all_to_all_mode=symmetric" "$@"
run peer "--xla_gpu_ragged_all_to_all_mode=peer" "$@"
run no_one_shot "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false" "$@"
# These two gave no result within the time limit on 2 H200s (jax 0.11.2):
run nccl_send_recv "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true" "$@"
run device_kernel_symmetric "--xla_gpu_experimental_ragged_all_to_all_use_device_kernel=true --xla_gpu_experimental_enable_nccl_symmetric_buffers=true" "$@"
