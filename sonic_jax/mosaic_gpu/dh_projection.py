"""dH role: dA' = dO_rows @ w2_e^T, then from the stored H: A, dH = s * act'(H, dA'), A_s = s * A and
the per-row partial sums of dA' * A that add up to the router-score gradient dS.

dO's rows are gathered by token as the A operand loads; w2 is stored (E, n, d), so B = w2_e^T is
read as (block_n, tile_k) boxes of w2_e and transposed by wgmma. The epilogue (`dh_epilogue`)
recomputes A from the H columns of its column block in float32 and writes dH, A_s and one float32
partial of dS per row and column block, so neither Y nor A was stored by the forward. Under the
core's pingpong schedule (`GroupedGemmConfig.schedule`) a warpgroup takes a whole 128 x 128 tile
and reads its H straight into registers: the other warpgroup's mainloop hides the loads, which
pays where the epilogue and the mainloop are of a size (the tuning table picks it at d = 1536).
Reference: `sonic_jax.xla_backend.dh_projection` (without the b2 term of dS, which the backend
adds).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import dh_epilogue
from sonic_jax.mosaic_gpu.grouped_gemm import (GemmRole, GroupedGemmConfig, check_layout_tile,
                                                grouped_gemm, unsupported_operands)

PREFETCH_BLOCK_N = 128  # the column block whose H columns fit in SMEM next to a 4-stage ring
WIDE_BLOCK_N = 256  # twice the columns per tile: half the A-operand traffic per FLOP


@dataclasses.dataclass(frozen=True)
class DhProjectionConfig:
  """block_n: hidden units per column block. 128: the tile's H columns are TMA-prefetched into
  SMEM during the mainloop (`dh_epilogue.Prefetched`). 256: a wider tile that reads each dO tile
  half as often; its epilogue reads H 64 hidden units at a time (`default_block_n` picks).
  wide_h_loads: how the 256-column tile's epilogue reads H: "staged" (`dh_epilogue.Staged`; the
  ring is then at most `Staged.MAX_STAGES` deep) or "registers" (`dh_epilogue.Registers`). The
  interleaved layout needs "staged" (its pairs are read as words from SMEM).
  With `gemm.schedule="pingpong"`: block_n must be 128 and H is read into registers (the concat
  layout only; wide_h_loads does not apply)."""

  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=4)
  block_n: int = PREFETCH_BLOCK_N
  wide_h_loads: str = "staged"

  def __post_init__(self):
    if self.gemm.cluster_m != 1:  # slower, cooperative or pingpong (docs/decisions.md, "dH")
      raise ValueError(f"dH runs unclustered (cluster_m=1), got cluster_m={self.gemm.cluster_m}")
    if self.gemm.schedule == "pingpong" and self.block_n != PREFETCH_BLOCK_N:
      raise ValueError(f"a pingpong dH takes block_n={PREFETCH_BLOCK_N} (a warpgroup holds a whole "
                       f"tile's rows), got {self.block_n}")
    if self.block_n not in (PREFETCH_BLOCK_N, WIDE_BLOCK_N):
      raise ValueError(f"block_n must be {PREFETCH_BLOCK_N} or {WIDE_BLOCK_N}, got {self.block_n}")
    if self.wide_h_loads not in ("staged", "registers"):
      raise ValueError(f"wide_h_loads must be 'staged' or 'registers', got {self.wide_h_loads!r}")


def default_block_n(n: int) -> int:
  """The wide tile wherever n allows it: half the dO traffic per FLOP outweighs its H loads'
  stalls, which the 128-column tile's prefetch hides (docs/decisions.md)."""
  return WIDE_BLOCK_N if n % WIDE_BLOCK_N == 0 else PREFETCH_BLOCK_N


def supports(h, w2, gate_up_layout: str, block_n: int = PREFETCH_BLOCK_N) -> str | None:
  if gate_up_layout not in acts.GATE_UP_LAYOUTS:
    return f"gate_up_layout {gate_up_layout!r} (one of {acts.GATE_UP_LAYOUTS})"
  return unsupported_operands(h, w2, [("d", w2.shape[2], 64), ("n", w2.shape[1], block_n)])


def dh_projection(d_out, h, row_scores, w2, layout, activation: acts.Activation,
                  config: DhProjectionConfig = DhProjectionConfig(),
                  gate_up_layout: str = "concat"):
  """Returns dH (R, 2n or n), A_s (R, n) in H's dtype and dS partials (n // bn, R) float32 (bn: the
  tile's column block).

  d_out: the (T, d) output gradient, whose rows the kernel gathers by `layout.row_token` as it
  loads them. row_scores: (R,) float32, 0 on padding rows. Rows of tiles past `layout.num_tiles`
  are left unwritten.
  gate_up_layout: where a GLU's gate and up columns sit in H and dH. The interleaved layout reads
  its H pieces from SMEM as uint32 words, one (gate, up) pair each, and writes dH back the same
  way (a strided register slice does not exist in Mosaic GPU, and a uint32 view of H in HBM would
  cost XLA a copy each way).
  """
  _, n, _ = w2.shape
  check_layout_tile(layout)
  glu = activation.is_glu
  interleaved = glu and gate_up_layout == "interleaved"
  bn = config.block_n
  pingpong = config.gemm.schedule == "pingpong"
  if pingpong and interleaved:
    raise ValueError("a pingpong dH takes the concat gate/up layout (the interleaved layout reads "
                     "its pairs from SMEM)")
  tile = dh_epilogue.DhTile(n=n, block_n=bn, rows=config.gemm.rows_per_warpgroup, dtype=h.dtype,
                            glu=glu, interleaved=interleaved, activation=activation)
  gemm_config = config.gemm
  if bn == PREFETCH_BLOCK_N and not pingpong:
    strategy = dh_epilogue.Prefetched(tile)
  elif not pingpong and (interleaved or config.wide_h_loads == "staged"):
    strategy = dh_epilogue.Staged(tile)
    gemm_config = dataclasses.replace(  # its H and A_s buffers take a stage's SMEM
        gemm_config, num_stages=min(gemm_config.num_stages, dh_epilogue.Staged.MAX_STAGES))
  else:
    strategy = dh_epilogue.Registers(tile)

  def rhs_copy(w2_ref, expert, k_slice, nb, j):
    del j
    return w2_ref.at[expert, pl.ds(nb * bn, bn), k_slice]

  def epilogue(accs, ctx):
    (acc,) = accs
    strategy(acc, ctx, pl.ds(ctx.row0, ctx.rows))

  role = GemmRole(
      name="dh_projection",
      block_n=bn, num_rhs_blocks=1, num_column_blocks=n // bn, rhs_copy=rhs_copy,
      epilogue=epilogue, epilogue_scratch=strategy.scratch(),
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, h.shape[1]), h.dtype),
                 jax.ShapeDtypeStruct((layout.num_rows, n), h.dtype),
                 jax.ShapeDtypeStruct((n // bn, layout.num_rows), jnp.float32)),
      rhs_transposed=True, epilogue_prefetch=strategy.prefetch,
      prefetch_copies=strategy.prefetch_copies)
  return grouped_gemm(d_out, w2, layout.tile_expert, layout.num_tiles, layout.row_token, role,
                      (h, row_scores.astype(jnp.float32)), gemm_config)
