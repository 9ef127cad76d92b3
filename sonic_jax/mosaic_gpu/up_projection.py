"""Up-projection role: H = gather(x) @ w1_e (+ b1_e), A = act(H); stores H and A.

The rows of x are gathered by token index as the A operand is loaded (no gathered copy of x in
HBM); the epilogue adds the bias, applies the activation in float32 and stores both the
pre-activation H (kept for the backward) and A (read by the down-projection).

GLU activations use the "concat" gate/up layout natively: a column block covers BLOCK_N hidden
units and reads two B blocks, their gate columns (w1[e][:, u0:u0+BLOCK_N]) and their up columns
(w1[e][:, n+u0:...]), so both halves of act(gate) * up meet in one warpgroup's registers.
Reference: `sonic_jax.xla_backend.up_projection`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import (GemmRole, GroupedGemmConfig, check_layout_tile,
                                                grouped_gemm, unsupported_operands)

GLU_BLOCK_N = 128  # hidden units per column block (gate and up blocks of 128 columns each)
PLAIN_BLOCK_N = 256


@dataclasses.dataclass(frozen=True)
class UpProjectionConfig:
  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=4)


def supports(x, w1, activation: acts.Activation, gate_up_layout: str) -> str | None:
  """None when the kernel handles this problem, else the reason it does not."""
  if activation.is_glu and gate_up_layout != "concat":
    return "the interleaved gate/up layout (not yet in the kernel)"
  n = w1.shape[2] // activation.width_multiplier()
  block_n = GLU_BLOCK_N if activation.is_glu else PLAIN_BLOCK_N
  return unsupported_operands(x, w1, [("d", x.shape[1], 64), ("n", n, block_n)])


def up_projection(x, w1, b1, layout, activation: acts.Activation, gate_up_layout: str,
                  config: UpProjectionConfig = UpProjectionConfig(), gather: bool = True):
  """(H, A) for the grouped layout; shapes and dtypes as `xla_backend.up_projection`.

  With gather=False, x must already be the (R, d) grouped buffer x[layout.row_token]: the same
  kernel with a contiguous A operand, which measures what the fused gather costs.
  """
  del gate_up_layout  # "concat" (see `supports`)
  _, d, width = w1.shape
  tm = config.gemm.tile_m
  check_layout_tile(layout, tm)
  dtype = x.dtype
  glu = activation.is_glu
  n = width // 2 if glu else width
  act_fn = acts.kernel_fn(activation)
  bn = GLU_BLOCK_N if glu else PLAIN_BLOCK_N

  def rhs_copy(w1_ref, expert, k_slice, nb, j):  # block j: 0 = gate (or all), 1 = up
    return w1_ref.at[expert, k_slice, pl.ds(j * n + nb * bn, bn)]

  def epilogue(accs, ctx):
    h_ref, a_ref = ctx.outputs
    rows = pl.ds(ctx.row0, ctx.rows)
    c0 = ctx.column_block * bn
    if b1 is not None:  # a GMEM load per tile: skipped without a bias
      (b_ref,) = ctx.inputs
      accs = [acc + epi.column_vector(b_ref.at[ctx.expert, pl.ds(j * n + c0, bn)], acc)
              for j, acc in enumerate(accs)]
    h = [acc.astype(dtype) for acc in accs]
    if glu:  # A from the rounded H, as the backward will recompute it
      a = act_fn(h[0].astype(jnp.float32)) * h[1].astype(jnp.float32)
    else:
      a = act_fn(h[0].astype(jnp.float32))
    stores = [(hj, h_ref.at[rows, pl.ds(j * n + c0, bn)]) for j, hj in enumerate(h)]
    stores.append((a.astype(dtype), a_ref.at[rows, pl.ds(c0, bn)]))
    epi.store_tiles(stores, ctx.scratch)

  role = GemmRole(
      block_n=bn, num_rhs_blocks=2 if glu else 1, num_column_blocks=n // bn, rhs_copy=rhs_copy,
      epilogue=epilogue, epilogue_scratch=epi.staging_buffers(tm // 2, dtype),
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, width), dtype),
                 jax.ShapeDtypeStruct((layout.num_rows, n), dtype)))
  h, a = grouped_gemm(x, w1, layout.tile_expert, layout.num_tiles,
                      layout.row_token if gather else None, role, () if b1 is None else (b1,),
                      config.gemm)
  return h, a
