"""Up-projection role: H = gather(x) @ w1_e (+ b1_e), A = act(H); stores H and A.

The rows of x are gathered by token index as the A operand is loaded (no gathered copy of x in
HBM); the epilogue adds the bias, applies the activation in float32 and stores both the
pre-activation H (kept for the backward) and A (read by the down-projection).

GLU activations use the "concat" gate/up layout natively: each warpgroup's B block holds the gate
columns of its 64 hidden units and their up columns, so one wgmma (N = 128) produces both halves of
act(gate) * up in one accumulator.
Reference: `sonic_jax.xla_backend.up_projection`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import (GemmRole, GroupedGemmConfig, grouped_gemm,
                                                interpreting, plain_rhs, tiled)

# Hidden units per compute warpgroup: a GLU accumulator is (tile_m, 2 * 64), a plain one (tile_m, 128).
GLU_UNITS_PER_WG = 64
PLAIN_COLS_PER_WG = 128


@dataclasses.dataclass(frozen=True)
class UpProjectionConfig:
  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=3)


def _glu_rhs(n, units, tile_k, dtype):
  """B block = [gate columns u0..u0+units | up columns n+u0..] of w1[e] (concat layout).

  On the GPU: w1 viewed as (E, d, 2, n) (a free reshape), one TMA of a (tile_k, 2, units) box into
  a (8, 1, 64)-tiled block that wgmma reads reshaped to (tile_k, 2 * units). The interpreter does
  not model reshaped refs, so there the block is (tile_k, 2 * units) and filled by two copies (a
  TMA into half of a tiled block would not be contiguous on the GPU).
  """
  if interpreting():
    def copies(rhs_ref, expert, k_slice, nb, w, block):
      u0 = (nb * 2 + w) * units
      return [(rhs_ref.at[expert, k_slice, pl.ds(u0, units)], block.at[:, :units]),
              (rhs_ref.at[expert, k_slice, pl.ds(n + u0, units)], block.at[:, units:])]
    return dict(rhs_smem=((tile_k, 2 * units), tiled(dtype)), rhs_copies=copies,
                rhs_copies_per_wg=2, rhs_operand=lambda block: block)

  def copies(rhs_ref, expert, k_slice, nb, w, block):  # rhs_ref: w1 viewed as (E, d, 2, n)
    return [(rhs_ref.at[expert, k_slice, :, pl.ds((nb * 2 + w) * units, units)], block)]
  elems = 128 // jnp.dtype(dtype).itemsize
  return dict(rhs_smem=((tile_k, 2, units), (plgpu.TilingTransform((8, 1, elems)),
                                             plgpu.SwizzleTransform(128))),
              rhs_copies=copies, rhs_copies_per_wg=1,
              rhs_operand=lambda block: block.reshape(tile_k, 2 * units))


def supports(x, w1, activation: acts.Activation, gate_up_layout: str) -> str | None:
  """None when the kernel handles this problem, else the reason it does not."""
  d = x.shape[1]
  width = w1.shape[2]
  if x.dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtype {x.dtype} (the kernel takes bfloat16 or float16)"
  if d % 64:
    return f"d={d} is not a multiple of 64"
  if activation.is_glu:
    if gate_up_layout != "concat":
      return "the interleaved gate/up layout (not yet in the kernel)"
    if (width // 2) % (2 * GLU_UNITS_PER_WG):
      return f"n={width // 2} is not a multiple of {2 * GLU_UNITS_PER_WG}"
  elif width % (2 * PLAIN_COLS_PER_WG):
    return f"n={width} is not a multiple of {2 * PLAIN_COLS_PER_WG}"
  return None


def up_projection(x, w1, b1, layout, activation: acts.Activation, gate_up_layout: str,
                  config: UpProjectionConfig = UpProjectionConfig(), gather: bool = True):
  """(H, A) for the grouped layout; shapes and dtypes as `xla_backend.up_projection`.

  With gather=False, x must already be the (R, d) grouped buffer x[layout.row_token]: the same
  kernel with a contiguous A operand, which measures what the fused gather costs.
  """
  e_count, d, width = w1.shape
  tm, tk = config.gemm.tile_m, config.gemm.tile_k
  if layout.row_tile != tm:
    raise ValueError(f"layout row_tile {layout.row_tile} != kernel tile_m {tm}")
  rows = layout.num_rows
  dtype = x.dtype
  glu = activation.is_glu
  n = width // 2 if glu else width
  bias = b1 if b1 is not None else jnp.zeros((e_count, width), dtype)

  if glu:
    units = GLU_UNITS_PER_WG
    rhs_fields = _glu_rhs(n, units, tk, dtype)
    acc_n, blocks = 2 * units, n // (2 * units)
  else:
    units = PLAIN_COLS_PER_WG
    rhs_fields = plain_rhs(units, tk, dtype)
    acc_n, blocks = units, n // (2 * units)

  def epilogue(acc, ctx):
    h_ref, a_ref = ctx.outputs
    (b_ref,) = ctx.inputs
    row0 = ctx.tile * tm
    u0 = (ctx.column_block * 2 + ctx.wg) * units
    if glu:
      gate = acc[:, :units] + epi.column_vector(b_ref.at[ctx.expert, pl.ds(u0, units)], acc[:, :units])
      up = acc[:, units:] + epi.column_vector(b_ref.at[ctx.expert, pl.ds(n + u0, units)], acc[:, units:])
      gate, up = gate.astype(dtype), up.astype(dtype)
      a = acts.kernel_fn(activation)(gate.astype(jnp.float32)) * up.astype(jnp.float32)
      stores = [(gate, h_ref.at[pl.ds(row0, tm), pl.ds(u0, units)]),
                (up, h_ref.at[pl.ds(row0, tm), pl.ds(n + u0, units)]),
                (a.astype(dtype), a_ref.at[pl.ds(row0, tm), pl.ds(u0, units)])]
    else:
      h = (acc + epi.column_vector(b_ref.at[ctx.expert, pl.ds(u0, units)], acc)).astype(dtype)
      a = acts.kernel_fn(activation)(h.astype(jnp.float32)).astype(dtype)
      stores = [(h, h_ref.at[pl.ds(row0, tm), pl.ds(u0, units)]),
                (a, a_ref.at[pl.ds(row0, tm), pl.ds(u0, units)])]
    epi.store_tiles(stores, ctx.scratch)

  role = GemmRole(
      acc_n=acc_n, num_column_blocks=blocks, **rhs_fields, epilogue=epilogue,
      epilogue_scratch=epi.staging_buffers(tm, dtype),
      out_types=(jax.ShapeDtypeStruct((rows, width), dtype),
                 jax.ShapeDtypeStruct((rows, n), dtype)))
  rhs = w1.reshape(e_count, d, 2, n) if glu and not interpreting() else w1
  h, a = grouped_gemm(x, rhs, layout.tile_expert, layout.num_tiles,
                      layout.row_token if gather else None, role,
                      (bias,), config.gemm)
  return h, a
