"""Down-projection role: Y = A @ w2_e (+ b2_e), rows in grouped order, not scaled by the scores.

A is read contiguously (it is already in grouped order). Reference:
`sonic_jax.xla_backend.down_projection`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import GemmRole, GroupedGemmConfig, grouped_gemm, plain_rhs

COLS_PER_WG = 128


@dataclasses.dataclass(frozen=True)
class DownProjectionConfig:
  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=4)


def supports(a, w2) -> str | None:
  n, d = w2.shape[1], w2.shape[2]
  if a.dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {a.dtype} (the kernel takes bfloat16 or float16)"
  if n % 64:
    return f"n={n} is not a multiple of 64"
  if d % (2 * COLS_PER_WG):
    return f"d={d} is not a multiple of {2 * COLS_PER_WG}"
  return None


def down_projection(a, w2, b2, layout, config: DownProjectionConfig = DownProjectionConfig()):
  """Y (R, d) in a's dtype."""
  e_count, n, d = w2.shape
  tm, tk = config.gemm.tile_m, config.gemm.tile_k
  if layout.row_tile != tm:
    raise ValueError(f"layout row_tile {layout.row_tile} != kernel tile_m {tm}")
  dtype = a.dtype
  bias = b2 if b2 is not None else jnp.zeros((e_count, d), dtype)

  def epilogue(acc, ctx):
    (y_ref,) = ctx.outputs
    (b_ref,) = ctx.inputs
    c0 = (ctx.column_block * 2 + ctx.wg) * COLS_PER_WG
    y = acc + epi.column_vector(b_ref.at[ctx.expert, pl.ds(c0, COLS_PER_WG)], acc)
    epi.store_tiles([(y.astype(dtype), y_ref.at[pl.ds(ctx.tile * tm, tm), pl.ds(c0, COLS_PER_WG)])],
                    ctx.scratch)

  role = GemmRole(
      acc_n=COLS_PER_WG, num_column_blocks=d // (2 * COLS_PER_WG),
      **plain_rhs(COLS_PER_WG, tk, dtype), epilogue=epilogue, epilogue_scratch=epi.staging_buffers(tm, dtype),
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, d), dtype),))
  (y,) = grouped_gemm(a, w2, layout.tile_expert, layout.num_tiles, None, role, (bias,), config.gemm)
  return y
