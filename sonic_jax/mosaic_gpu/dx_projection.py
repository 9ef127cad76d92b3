"""dX role: dX rows = dH @ w1_e^T, in grouped order; a gather-sum then reduces them per token.

w1 is stored (E, d, 2n), so B = w1_e^T is read as (block_n, tile_k) boxes of w1_e and transposed by
wgmma for free. Reference: `sonic_jax.xla_backend.dx_projection`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.experimental import pallas as pl

from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import (GemmRole, GroupedGemmConfig, check_layout_tile,
                                               grouped_gemm, unsupported_operands)

BLOCK_N = 256


@dataclasses.dataclass(frozen=True)
class DxProjectionConfig:
  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=4)

  def __post_init__(self):
    if self.gemm.schedule != "cooperative":
      raise ValueError(f"the dX role runs the cooperative schedule only, got "
                       f"{self.gemm.schedule!r}")


def supports(d_h, w1) -> str | None:
  return unsupported_operands(d_h, w1, [("w1's width", w1.shape[2], 64),
                                        ("d", w1.shape[1], BLOCK_N)])


def dx_projection(d_h, w1, layout, config: DxProjectionConfig = DxProjectionConfig()):
  """dX rows (R, d) in dH's dtype; rows of tiles past `layout.num_tiles` are left unwritten."""
  _, d, _ = w1.shape
  check_layout_tile(layout)
  dtype = d_h.dtype

  def rhs_copy(w1_ref, expert, k_slice, nb, j):
    del j
    return w1_ref.at[expert, pl.ds(nb * BLOCK_N, BLOCK_N), k_slice]

  def epilogue(accs, ctx):
    (dx_ref,) = ctx.outputs
    (acc,) = accs
    c0 = ctx.column_block * BLOCK_N
    epi.store_tiles([(acc.astype(dtype), dx_ref.at[pl.ds(ctx.row0, ctx.rows), pl.ds(c0, BLOCK_N)])],
                    ctx.scratch)

  role = GemmRole(
      name="dx_projection",
      block_n=BLOCK_N, num_rhs_blocks=1, num_column_blocks=d // BLOCK_N, rhs_copy=rhs_copy,
      epilogue=epilogue,
      epilogue_scratch=epi.staging_buffers(config.gemm.rows_per_warpgroup, dtype),
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, d), dtype),), rhs_transposed=True)
  (dx,) = grouped_gemm(d_h, w1, layout.tile_expert, layout.num_tiles, None, role, (), config.gemm)
  return dx
