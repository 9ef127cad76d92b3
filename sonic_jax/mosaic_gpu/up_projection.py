"""Up-projection role: H = gather(x) @ w1_e (+ b1_e), A = act(H); stores H and A.

The rows of x are gathered by token index as the A operand is loaded (no gathered copy of x in
HBM); the epilogue adds the bias, applies the activation in float32 and stores both the
pre-activation H (kept for the backward) and A (read by the down-projection).

GLU activations take either gate/up layout of w1 as it is (no permuted copy of w1). A column
block covers GLU_BLOCK_N hidden units and reads two B blocks of GLU_BLOCK_N columns each:
- "concat": the gate columns (w1[e][:, u0:u0+GLU_BLOCK_N]) and the up columns
  (w1[e][:, n+u0:...]), so both halves of act(gate) * up meet in one warpgroup's registers;
- "interleaved": the block's 2 * GLU_BLOCK_N consecutive columns, (gate, up) side by side. H is
  stored as it comes; each 64-column H piece, once in SMEM for its store, is read back as 32
  uint32 words, one (gate, up) pair each, so a pair lands in one thread (a wgmma fragment puts
  adjacent columns in one thread, but Mosaic GPU has no strided register slice) and gives 32
  columns of A.
Reference: `sonic_jax.xla_backend.up_projection`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax import activations as acts
from sonic_jax.interpret import interpreting
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import (GemmRole, GroupedGemmConfig, check_layout_tile,
                                               grouped_gemm, unsupported_operands)

GLU_BLOCK_N = 128  # hidden units per column block (gate and up blocks of 128 columns each)
PLAIN_BLOCK_N = 256


@dataclasses.dataclass(frozen=True)
class UpProjectionConfig:
  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=4)

  def __post_init__(self):
    if self.gemm.schedule != "cooperative":  # a 128 x 128 warpgroup tile reads more per FLOP
      raise ValueError(f"the up-projection runs the cooperative schedule only, got "
                       f"{self.gemm.schedule!r}")
    if self.gemm.cluster_m != 1:  # no kernel gain, slower in the layer (docs/decisions.md)
      raise ValueError(f"the up-projection runs unclustered (cluster_m=1), got "
                       f"cluster_m={self.gemm.cluster_m}")


def supports(x, w1, activation: acts.Activation, gate_up_layout: str) -> str | None:
  """None when the kernel handles this problem, else the reason it does not."""
  if gate_up_layout not in acts.GATE_UP_LAYOUTS:
    return f"gate_up_layout {gate_up_layout!r} (one of {acts.GATE_UP_LAYOUTS})"
  n = w1.shape[2] // activation.width_multiplier()
  block_n = GLU_BLOCK_N if activation.is_glu else PLAIN_BLOCK_N
  return unsupported_operands(x, w1, [("d", x.shape[1], 64), ("n", n, block_n)])


def up_projection(x, w1, b1, layout, activation: acts.Activation, gate_up_layout: str,
                  config: UpProjectionConfig = UpProjectionConfig()):
  """(H, A) for the grouped layout; shapes and dtypes as `xla_backend.up_projection`. x: (T, d),
  its rows gathered by `layout.row_token` as they load."""
  width = w1.shape[2]
  check_layout_tile(layout)
  dtype = x.dtype
  glu = activation.is_glu
  interleaved = glu and gate_up_layout == "interleaved"
  n = width // 2 if glu else width
  bn = GLU_BLOCK_N if glu else PLAIN_BLOCK_N
  rows_per_wg = config.gemm.rows_per_warpgroup
  cols = epi.STORE_COLS

  def w1_column(nb, j):  # first w1 / H column of B block j (0: gate or all, 1: up)
    return nb * 2 * bn + j * bn if interleaved else j * n + nb * bn

  def rhs_copy(w1_ref, expert, k_slice, nb, j):
    return w1_ref.at[expert, k_slice, pl.ds(w1_column(nb, j), bn)]

  def rounded_h(accs, ctx):
    if b1 is not None:  # a GMEM load per tile: skipped without a bias
      (b_ref,) = ctx.inputs
      accs = [acc + epi.column_vector(b_ref.at[ctx.expert, pl.ds(w1_column(ctx.column_block, j),
                                                                 bn)], acc)
              for j, acc in enumerate(accs)]
    return [acc.astype(dtype) for acc in accs]

  def epilogue(accs, ctx):
    h_ref, a_ref = ctx.outputs
    rows = pl.ds(ctx.row0, ctx.rows)
    c0 = ctx.column_block * bn
    h = rounded_h(accs, ctx)
    if glu:  # A from the rounded H, as the backward will recompute it
      a = activation.glu(h[0].astype(jnp.float32), h[1].astype(jnp.float32), kernel=True)
    else:
      a = activation.fn(h[0].astype(jnp.float32), kernel=True)
    stores = [(hj, h_ref.at[rows, pl.ds(w1_column(ctx.column_block, j), bn)])
              for j, hj in enumerate(h)]
    stores.append((a.astype(dtype), a_ref.at[rows, pl.ds(c0, bn)]))
    epi.store_tiles(stores, ctx.scratch)

  def interleaved_epilogue(accs, ctx):
    """Per 64-column H piece: store it, read its pairs back from SMEM as words, store 32 columns
    of A. SMEM allows one H buffer (it fills between the previous piece's H store and A
    computation) and two A buffers next to the 4-stage ring."""
    h_ref, a_ref = ctx.outputs
    h_stage, a_stage, h_words = ctx.scratch
    rows = pl.ds(ctx.row0, ctx.rows)
    h = rounded_h(accs, ctx)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores read the buffers
    for i in range(2 * bn // cols):
      j, p = divmod(i, bn // cols)
      col = pl.multiple_of(w1_column(ctx.column_block, j) + p * cols, cols)
      piece = h[j][:, p * cols:(p + 1) * cols]
      if i:  # the store groups since the last H store: its A store
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
      h_stage[0] = piece
      plgpu.commit_smem()  # also a warpgroup barrier: every thread's part is in SMEM
      plgpu.copy_smem_to_gmem(h_stage.at[0], h_ref.at[rows, pl.ds(col, cols)])
      if interpreting():  # the interpreter does not alias the union's views: same values
        gate, up = epi.split_pairs(piece)
      else:
        gate, up = epi.unpack_pairs(h_words[0], dtype)
      slot = i % epi.NUM_STAGING
      if i >= epi.NUM_STAGING:  # since this buffer's last store: H, A, H
        plgpu.wait_smem_to_gmem(3, wait_read_only=True)
      a_stage[slot] = activation.glu(gate, up, kernel=True).astype(dtype)
      plgpu.commit_smem()
      unit = pl.multiple_of(col // 2, cols // 2)  # the pairs' first hidden unit
      plgpu.copy_smem_to_gmem(a_stage.at[slot], a_ref.at[rows, pl.ds(unit, cols // 2)])

  if interleaved:
    scratch = epi.pair_staging_buffers(rows_per_wg, dtype,
                                       epi.half_staging_buffers(rows_per_wg, dtype))
  else:
    scratch = epi.staging_buffers(rows_per_wg, dtype)
  role = GemmRole(
      name="up_projection",
      block_n=bn, num_rhs_blocks=2 if glu else 1, num_column_blocks=n // bn, rhs_copy=rhs_copy,
      epilogue=interleaved_epilogue if interleaved else epilogue, epilogue_scratch=scratch,
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, width), dtype),
                 jax.ShapeDtypeStruct((layout.num_rows, n), dtype)))
  h, a = grouped_gemm(x, w1, layout.tile_expert, layout.num_tiles,
                      layout.row_token, role, () if b1 is None else (b1,),
                      config.gemm)
  return h, a
