"""dH role: dA' = dO_rows @ w2_e^T, then from the stored H: A, dH = s * act'(H, dA'), A_s = s * A and
the per-row partial sums of dA' * A that add up to the router-score gradient dS.

dO's rows are gathered by token as the A operand loads (or arrive in grouped order); w2 is stored
(E, n, d), so B = w2_e^T is read as (block_n, tile_k) boxes of w2_e and transposed by wgmma. A
column block covers
BLOCK_N hidden units: the matching H columns (gate and up for GLU activations) and row scores are
TMA-copied into SMEM while the tile's mainloop runs; the epilogue recomputes A from them in float32
and writes dH (in place of H in SMEM), A_s and one float32 partial of dS per row and column block,
so neither Y nor A was stored by the forward. Reference: `sonic_jax.xla_backend.dh_projection`
(without the b2 term of dS, which the backend adds).
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import (GemmRole, GroupedGemmConfig, check_layout_tile,
                                                grouped_gemm, tiled, unsupported_operands)

BLOCK_N = 128


@dataclasses.dataclass(frozen=True)
class DhProjectionConfig:
  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=4)


def supports(h, w2, activation: acts.Activation, gate_up_layout: str) -> str | None:
  if activation.is_glu and gate_up_layout != "concat":
    return "the interleaved gate/up layout (not yet in the kernel)"
  return unsupported_operands(h, w2, [("d", w2.shape[2], 64), ("n", w2.shape[1], BLOCK_N)])


def dh_projection(d_out, h, row_scores, w2, layout, activation: acts.Activation,
                  config: DhProjectionConfig = DhProjectionConfig(), gather: bool = False):
  """Returns dH (R, 2n or n), A_s (R, n) in H's dtype and dS partials (n // BLOCK_N, R) float32.

  d_out: the (R, d) grouped rows dO[layout.row_token], or with gather=True the (T, d) dO itself,
  whose rows the kernel gathers as it loads them (no gathered copy in HBM). row_scores: (R,)
  float32, 0 on padding rows. Rows of tiles past `layout.num_tiles` are left unwritten.
  """
  _, n, _ = w2.shape
  tm = config.gemm.tile_m
  check_layout_tile(layout, tm)
  dtype = h.dtype
  glu = activation.is_glu
  act_fn, act_grad = acts.kernel_fn(activation), acts.kernel_grad(activation)
  cols = epi.STORE_COLS

  def rhs_copy(w2_ref, expert, k_slice, nb, j):
    del j
    return w2_ref.at[expert, pl.ds(nb * BLOCK_N, BLOCK_N), k_slice]

  pieces = BLOCK_N // cols  # 64-column pieces of the column block
  h_pieces = 2 * pieces if glu else pieces  # GLU: the gate pieces, then the up pieces
  rows_per_wg = tm // 2

  def h_column(column_block, i):
    half, piece = divmod(i, pieces)
    return half * n + column_block * BLOCK_N + piece * cols

  def prefetch(ctx, barrier):
    """The tile's H columns and row scores, TMA-copied into SMEM while the mainloop runs."""
    h_ref, s_ref = ctx.inputs
    h_smem, _, s_smem = ctx.scratch
    rows = pl.ds(ctx.row0, ctx.rows)
    for i in range(h_pieces):
      plgpu.copy_gmem_to_smem(h_ref.at[rows, pl.ds(h_column(ctx.column_block, i), cols)],
                              h_smem.at[i], barrier)
    plgpu.copy_gmem_to_smem(s_ref.at[rows], s_smem, barrier)

  def epilogue(accs, ctx):
    dh_ref, as_ref, ds_ref = ctx.outputs
    h_smem, as_smem, s_smem = ctx.scratch
    (acc,) = accs
    rows = pl.ds(ctx.row0, ctx.rows)
    plgpu.barrier_wait(ctx.prefetched)
    s = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    load = lambda i: plgpu.load(h_smem.at[i], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
    ds = None
    for p in range(pieces):  # 64 columns at a time bounds the live registers
      d_a = acc[:, p * cols:(p + 1) * cols]
      s_d_a = lax.broadcast_in_dim(s, d_a.shape, [0]) * d_a
      # dH overwrites the H piece it came from (each thread rewrites the elements it read).
      if glu:
        gate, up = load(p), load(pieces + p)
        act_gate = act_fn(gate)
        a = act_gate * up
        h_smem[p] = (s_d_a * up * act_grad(gate)).astype(dtype)
        h_smem[pieces + p] = (s_d_a * act_gate).astype(dtype)
      else:
        pre = load(p)
        a = act_fn(pre)
        h_smem[p] = (s_d_a * act_grad(pre)).astype(dtype)
      as_smem[p] = (lax.broadcast_in_dim(s, a.shape, [0]) * a).astype(dtype)
      part = jnp.sum(d_a * a, axis=1)
      ds = part if ds is None else ds + part
    ds_ref.at[ctx.column_block, rows][...] = ds  # 256 bytes: straight from registers
    plgpu.commit_smem()
    for i in range(h_pieces):
      plgpu.copy_smem_to_gmem(h_smem.at[i],
                              dh_ref.at[rows, pl.ds(h_column(ctx.column_block, i), cols)])
    for p in range(pieces):
      plgpu.copy_smem_to_gmem(as_smem.at[p],
                              as_ref.at[rows, pl.ds(ctx.column_block * BLOCK_N + p * cols, cols)])

  role = GemmRole(
      block_n=BLOCK_N, num_rhs_blocks=1, num_column_blocks=n // BLOCK_N, rhs_copy=rhs_copy,
      epilogue=epilogue,
      epilogue_scratch=(plgpu.SMEM((h_pieces, rows_per_wg, cols), dtype, transforms=tiled(dtype)),
                        plgpu.SMEM((pieces, rows_per_wg, cols), dtype, transforms=tiled(dtype)),
                        plgpu.SMEM((rows_per_wg,), jnp.float32)),
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, h.shape[1]), dtype),
                 jax.ShapeDtypeStruct((layout.num_rows, n), dtype),
                 jax.ShapeDtypeStruct((n // BLOCK_N, layout.num_rows), jnp.float32)),
      rhs_transposed=True, epilogue_prefetch=prefetch, prefetch_copies=h_pieces + 1)
  return grouped_gemm(d_out, w2, layout.tile_expert, layout.num_tiles,
                      layout.row_token if gather else None, role,
                      (h, row_scores.astype(jnp.float32)), config.gemm)
