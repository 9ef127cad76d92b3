"""The `mosaic_gpu` backend: Hopper kernels for the forward roles, the xla path elsewhere.

Forward: up-projection with the activation epilogue (its rows gathered as `GATHER` says),
down-projection (this package). Aggregation and the backward roles run on the `xla` path for now, on the same layout
and with the same residuals. A role whose shape or dtype its kernel does not take
(`up_projection.supports`, `down_projection.supports`) falls back to the xla implementation.
"""

from __future__ import annotations

import dataclasses

from sonic_jax import xla_backend
from sonic_jax.mosaic_gpu import down_projection as down
from sonic_jax.mosaic_gpu import up_projection as up

ROW_TILE = 128


# Where the up-projection's A rows come from. "xla": XLA gathers x[row_token] into a contiguous
# buffer that the kernel streams with TMA (the fastest measured so far: see BENCHMARKS.md).
# "row_tma" / "cp_async": the gather fused into the kernel's operand load (gather.py); row_tma is
# exact but issue-bound (about 7x slower), cp_async does not yet complete on the GPU.
GATHER = "xla"


def up_projection(x, w1, b1, layout, activation, gate_up_layout):
  if up.supports(x, w1, activation, gate_up_layout) is not None:
    return xla_backend.up_projection(x, w1, b1, layout, activation, gate_up_layout)
  if GATHER == "xla":
    return up.up_projection(x[layout.row_token], w1, b1, layout, activation, gate_up_layout,
                            gather=False)
  config = up.UpProjectionConfig(dataclasses.replace(up.UpProjectionConfig().gemm,
                                                     gather_impl=GATHER))
  return up.up_projection(x, w1, b1, layout, activation, gate_up_layout, config=config)


def down_projection(a, w2, b2, layout):
  if down.supports(a, w2) is None:
    return down.down_projection(a, w2, b2, layout)
  return xla_backend.down_projection(a, w2, b2, layout)


def make_backend(base):
  return dataclasses.replace(base, name="mosaic_gpu", row_tile=ROW_TILE,
                             up_projection=up_projection, down_projection=down_projection)
