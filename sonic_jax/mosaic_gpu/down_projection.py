"""Down-projection role: Y = A @ w2_e (+ b2_e), rows in grouped order, not scaled by the scores.

A is read contiguously (it is already in grouped order). Reference:
`sonic_jax.xla_backend.down_projection`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl

from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import (GemmRole, GroupedGemmConfig, check_layout_tile,
                                               grouped_gemm, unsupported_operands)

BLOCK_N = 256  # output columns per tile


@dataclasses.dataclass(frozen=True)
class DownProjectionConfig:
  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=4)

  def __post_init__(self):
    if self.gemm.schedule != "cooperative":  # a 128 x 128 warpgroup tile reads more per FLOP
      raise ValueError(f"the down-projection runs the cooperative schedule only, got "
                       f"{self.gemm.schedule!r}")


def supports(a, w2) -> str | None:
  return unsupported_operands(a, w2, [("n", w2.shape[1], 64), ("d", w2.shape[2], BLOCK_N)])


def down_projection(a, w2, b2, layout, config: DownProjectionConfig = DownProjectionConfig()):
  """Y (R, d) in a's dtype."""
  d = w2.shape[2]
  check_layout_tile(layout)
  dtype = a.dtype
  bn = BLOCK_N

  def rhs_copy(w2_ref, expert, k_slice, nb, j):
    del j
    return w2_ref.at[expert, k_slice, pl.ds(nb * bn, bn)]

  def epilogue(accs, ctx):
    (y_ref,) = ctx.outputs
    (y,) = accs
    c0 = ctx.column_block * bn
    if b2 is not None:  # a GMEM load per tile: skipped without a bias
      (b_ref,) = ctx.inputs
      y = y + epi.column_vector(b_ref.at[ctx.expert, pl.ds(c0, bn)], y)
    epi.store_tiles([(y.astype(dtype), y_ref.at[pl.ds(ctx.row0, ctx.rows), pl.ds(c0, bn)])],
                    ctx.scratch)

  role = GemmRole(
      name="down_projection",
      block_n=bn, num_rhs_blocks=1, num_column_blocks=d // bn, rhs_copy=rhs_copy,
      epilogue=epilogue,
      epilogue_scratch=epi.staging_buffers(config.gemm.rows_per_warpgroup, dtype),
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, d), dtype),))
  (y,) = grouped_gemm(a, w2, layout.tile_expert, layout.num_tiles, None, role,
                      () if b2 is None else (b2,), config.gemm)
  return y
