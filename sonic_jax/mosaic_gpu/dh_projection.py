"""dH role: dA' = dO_rows @ w2_e^T, then from the stored H: A, dH = s * act'(H, dA'), A_s = s * A and
the per-row partial sums of dA' * A that add up to the router-score gradient dS.

dO's rows are gathered by token as the A operand loads (or arrive in grouped order); w2 is stored
(E, n, d), so B = w2_e^T is read as (block_n, tile_k) boxes of w2_e and transposed by wgmma. A
column block covers
BLOCK_N hidden units: the epilogue loads the matching H columns (gate and up for GLU activations),
recomputes A in float32 and writes dH, A_s and one float32 partial of dS per row and column block,
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
                                                grouped_gemm, unsupported_operands)

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

  def epilogue(accs, ctx):
    dh_ref, as_ref, ds_ref = ctx.outputs
    h_ref, s_ref = ctx.inputs
    staging, ds_smem = ctx.scratch
    (acc,) = accs
    rows = pl.ds(ctx.row0, ctx.rows)
    c0 = ctx.column_block * BLOCK_N
    s = plgpu.load(s_ref.at[rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    ds = None
    for c in range(0, BLOCK_N, cols):  # 64 columns at a time bounds the live registers
      d_a = acc[:, c:c + cols]
      s_b = lax.broadcast_in_dim(s, d_a.shape, [0])
      load = lambda col: plgpu.load(h_ref.at[rows, pl.ds(col, cols)], layout=plgpu.Layout.WGMMA,
                                    optimized=False).astype(jnp.float32)
      if glu:
        gate, up = load(c0 + c), load(n + c0 + c)
        act_gate = act_fn(gate)
        a = act_gate * up
        stores = [((s_b * d_a * up * act_grad(gate)).astype(dtype),
                   dh_ref.at[rows, pl.ds(c0 + c, cols)]),
                  ((s_b * d_a * act_gate).astype(dtype), dh_ref.at[rows, pl.ds(n + c0 + c, cols)])]
      else:
        pre = load(c0 + c)
        a = act_fn(pre)
        stores = [((s_b * d_a * act_grad(pre)).astype(dtype), dh_ref.at[rows, pl.ds(c0 + c, cols)])]
      stores.append(((s_b * a).astype(dtype), as_ref.at[rows, pl.ds(c0 + c, cols)]))
      part = jnp.sum(d_a * a, axis=1)
      ds = part if ds is None else ds + part
      epi.store_tiles(stores, staging)
    ds_smem[...] = ds
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(ds_smem, ds_ref.at[ctx.column_block, rows])

  rows_per_wg = tm // 2
  role = GemmRole(
      block_n=BLOCK_N, num_rhs_blocks=1, num_column_blocks=n // BLOCK_N, rhs_copy=rhs_copy,
      epilogue=epilogue,
      epilogue_scratch=(epi.staging_buffers(rows_per_wg, dtype),
                        plgpu.SMEM((rows_per_wg,), jnp.float32)),
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, h.shape[1]), dtype),
                 jax.ShapeDtypeStruct((layout.num_rows, n), dtype),
                 jax.ShapeDtypeStruct((n // BLOCK_N, layout.num_rows), jnp.float32)),
      rhs_transposed=True)
  return grouped_gemm(d_out, w2, layout.tile_expert, layout.num_tiles,
                      layout.row_token if gather else None, role,
                      (h, row_scores.astype(jnp.float32)), config.gemm)
