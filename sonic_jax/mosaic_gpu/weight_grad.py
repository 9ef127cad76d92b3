"""Varlen-K grouped GEMM for the weight gradients: out[e] = lhs_e^T @ rhs_e, the reduction running
over expert e's rows of the grouped layout.

dw1_e = x_rows_e^T dH_e and dw2_e = A_s,e^T dO_rows_e. Each work item is one (expert, BLOCK_M x
block_n) block of out[e]; its k-loop walks the expert's rows TILE_K at a time, so the number of
steps is data (the expert's row count, rounded up to TILE_K): nothing syncs with the host and
experts with no rows get exact zeros. Same warp specialisation as the varlen-M core
(`grouped_gemm.py`): a memory warpgroup fills a ring of stages (the gathered lhs rows by cp.async,
the rhs tile by TMA), two compute warpgroups each own half of the block's rows (64, one
accumulator) and read their part of the A tile transposed
(wgmma transposes 16-bit SMEM operands for free), so no transposed copy of the activations is ever
made. The lhs rows are gathered by token as they load (`gather.py`: x for dw1, dO for dw2), the rhs
rows (dH, A_s) read contiguously by TMA; `transpose_out` stores each block transposed, so that
dw2 = A_s^T dO runs as (dO_rows^T A_s)^T with the gathered dO on the wgmma's M side
(`backend.dw2_gathering_d_out`). Reference: `xla_backend.grouped_weight_grad`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax.interpret import interpreting, warn_if_interpreter_may_hang
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu import gather
from sonic_jax.mosaic_gpu.grouped_gemm import (_NUM_COMPUTE_WGS, TILE_K, consume_stages,
                                               drain_ring, persistent_launch, register_split,
                                               stage_release_barriers, tiled, unsupported_operands)

# Output rows per work item: one 64-row accumulator per compute warpgroup (256-row blocks, for
# dw2's N-side form, measured slower: docs/decisions.md, "Weight gradients").
BLOCK_M = 128


@dataclasses.dataclass(frozen=True)
class WeightGradConfig:
  """block_n: output columns per work item (of BLOCK_M rows); num_stages: depth of the operand
  ring.
  cluster: CTAs per cluster (1 or 2). With 2, the CTAs of a cluster take two blocks of one expert
  that share their rhs tile (consecutive d blocks): each CTA TMA-loads half of that tile and
  multicasts it to both. Where the number of d blocks is odd the kernel runs unclustered."""

  block_n: int = 256
  num_stages: int = 4
  cluster: int = 1
  # The cp.async gather: load a k-step's row indices before waiting for its stage to be free, not
  # after (their latency off the path from that wait to the copies); the tuning table turns it
  # off where that loses.
  indices_before_wait: bool = True

  def __post_init__(self):
    if self.cluster not in (1, 2):
      raise ValueError(f"cluster must be 1 or 2, got {self.cluster}")
    if self.block_n not in (128, 256):
      raise ValueError(f"block_n must be 128 or 256, got {self.block_n}")
    if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or (
        self.num_stages < 1):
      raise ValueError(f"num_stages must be an int >= 1, got {self.num_stages!r}")
    if not isinstance(self.indices_before_wait, bool):
      raise ValueError(f"indices_before_wait must be a bool, got {self.indices_before_wait!r}")


def supports(lhs, rhs_rows, config: WeightGradConfig = WeightGradConfig()) -> str | None:
  return unsupported_operands(lhs, rhs_rows, [("lhs width", lhs.shape[1], BLOCK_M),
                                              ("rhs width", rhs_rows.shape[1], config.block_n)])


def weight_grad(lhs, rhs_rows, layout, config: WeightGradConfig = WeightGradConfig(),
                transpose_out: bool = False):
  """(E, d, w) in lhs's dtype, float32 accumulation: out[e] = sum over e's grouped rows r of
  lhs[row_token[r]]^T rhs_rows[r] (dw1: w = 2n or n, the up-projection's width; dw2, transposed:
  w = n).

  lhs: the (T, d) source whose row `layout.row_token[r]` is grouped row r, gathered as the
  reduction runs (cp.async on the GPU; `gather.py`; no gathered copy is written to HBM).
  rhs_rows: (R, w) grouped rows, zero on padding rows. Expert e's reduction runs over its first
  `layout.expert_counts[e]` rows rounded up to `TILE_K` (its real rows come first in its group):
  the padding rows past them are never read, and an expert without rows gets a zero gradient.
  transpose_out: return (E, w, d), each block's accumulators stored transposed, so that a product
  wanted as rhs^T lhs (dw2 = A_s^T dO) puts its gathered operand on the wgmma's M side.
  """
  if layout.row_tile % TILE_K:
    raise ValueError(f"layout row_tile {layout.row_tile} is not a multiple of {TILE_K}")
  d, width = lhs.shape[1], rhs_rows.shape[1]  # out[e] is (d, w): BLOCK_M x block_n blocks
  e_count = layout.num_experts
  bd, bw, tk, stages = BLOCK_M, config.block_n, TILE_K, config.num_stages
  half = bd // _NUM_COMPUTE_WGS  # output rows per compute warpgroup: its one accumulator
  lhs_boxes = _NUM_COMPUTE_WGS  # the lhs stage as (tk, half) boxes, warpgroup w's is box w
  d_blocks, w_blocks = d // bd, width // bw
  items = e_count * d_blocks * w_blocks
  dtype = lhs.dtype
  group_start = (jnp.cumsum(layout.group_sizes) - layout.group_sizes).astype(jnp.int32)
  itemsize = jnp.dtype(dtype).itemsize
  memory_regs, compute_regs = register_split(True)
  interpret_mode = interpreting()
  if interpret_mode:
    warn_if_interpreter_may_hang()
  cp_async = not interpret_mode
  # Arrivals on full[s]: the rhs block's TMA copy, plus the interpreter's store of the gathered
  # lhs; the cp.async gather signals `ready` instead.
  full_arrivals = 1 if cp_async else 2
  # Both CTAs of a cluster read the same rhs tile (TMA multicast): never the gathered operand.
  cluster = config.cluster
  if d_blocks % cluster:
    cluster = 1
  multicast = {"collective_axes": "cluster"} if cluster > 1 else {}

  def body(sizes_ref, starts_ref, row_token_ref, lhs_ref, rhs_ref, out_ref):
    def scoped(a_union, b_smem, full, empty, staging, ready):
      a_smem, a_raw = a_union  # the raw view: the cp.async gather's byte addressing
      if cp_async:
        gather.init_stage_barriers(ready)
      wg = lax.axis_index("wg")

      def walk_items(per_item):
        """per_item(expert, d_block, w_block, first_row, steps, first_step) over this CTA's
        items, in the same order in every warpgroup; returns the k-steps taken."""
        # A cluster walks items of pairs of d blocks; each CTA takes its own block of the pair.
        dbs, wbs = d_blocks // cluster, w_blocks

        @plgpu.nd_loop((items // cluster,), collective_axes="sm", init_carry=jnp.int32(0))
        def _items(info, carry):
          step = carry
          idx = info.index[0]
          e = idx // (dbs * wbs)
          d_block = lax.rem(idx, dbs * wbs) // wbs
          w_block = lax.rem(idx, wbs)
          if cluster > 1:
            d_block = d_block * cluster + lax.axis_index("cluster")
          steps = sizes_ref[e] // tk  # of the expert's rows that the reduction reads
          per_item(e, d_block, w_block, starts_ref[e], steps, step)
          return step + steps
        return _items

      def load_lhs_rows(rows, cols, slot, indices):
        """Gathers the grouped rows `rows` of lhs, columns `cols`, into the stage's (tk, half)
        boxes."""
        if cp_async:
          # Each step reads new indices: prefetch the next step's (clamped to the buffer).
          next_rows = pl.ds(jnp.minimum(rows.start + tk, row_token_ref.shape[0] - tk), tk)
          gather.cp_async_rows(lhs_ref.at[:, cols], row_token_ref.at[rows], a_raw.at[slot],
                               ready.at[slot], source_row_stride=lhs_ref.shape[1],
                               block_stride=tk * half * itemsize, group_stride=8 * half * itemsize,
                               next_row_index=row_token_ref.at[next_rows],
                               loaded_indices=indices)
          return
        value = gather.interpreted_rows(lhs_ref.at[:, cols], row_token_ref.at[rows])
        for j in range(lhs_boxes):
          a_smem[slot, j] = value[:, j * half:(j + 1) * half]
        plgpu.barrier_arrive(full.at[slot])

      @pl.when(wg == _NUM_COMPUTE_WGS)
      def _memory_wg():
        plgpu.set_max_registers(memory_regs, action="decrease")

        def load(e, d_block, w_block, first_row, steps, step):
          del e

          @pl.loop(0, steps)
          def _k(ki):
            s = step + ki
            slot = lax.rem(s, stages)
            # Group starts are multiples of the layout's row tile, hence of TILE_K.
            rows = pl.ds(pl.multiple_of(first_row + ki * tk, tk), tk)
            indices = None
            if cp_async and config.indices_before_wait:
              indices = gather.load_row_indices(row_token_ref.at[rows], width=bd, dtype=dtype)

            @pl.when(s >= stages)
            def _():
              plgpu.barrier_wait(empty.at[slot])

            load_lhs_rows(rows, pl.ds(d_block * bd, bd), slot, indices)
            plgpu.copy_gmem_to_smem(rhs_ref.at[rows, pl.ds(w_block * bw, bw)], b_smem.at[slot],
                                    full.at[slot], **multicast)

        drain_ring(empty, walk_items(load), stages)

      @pl.when(wg < _NUM_COMPUTE_WGS)
      def _compute_wg():
        plgpu.set_max_registers(compute_regs, action="increase")

        def compute(e, d_block, w_block, first_row, steps, step):
          del first_row

          def acc_scope(acc_ref):
            def issue(slot, ki):
              del ki
              plgpu.wgmma(acc_ref, a_smem.at[slot, wg].transpose((1, 0)), b_smem.at[slot])
              return 1

            consume_stages(full, empty, ready if cp_async else None, step, steps, stages, issue)
            return acc_ref[...]

          acc = pl.run_scoped(acc_scope, plgpu.ACC((half, bw), jnp.float32))
          out_rows = pl.ds(d_block * bd + wg * half, half)
          out_cols = pl.ds(w_block * bw, bw)
          epi.store_tiles(
              [(acc.astype(dtype), out_ref.at[e, out_cols, out_rows] if transpose_out
                else out_ref.at[e, out_rows, out_cols])],
              staging.at[wg], transposed=transpose_out)

        walk_items(compute)
        plgpu.wait_smem_to_gmem(0)

    staging = epi.staging_buffers(half, dtype)
    a_shape = (stages, lhs_boxes, tk, half)
    pl.run_scoped(
        scoped,
        plgpu.RefUnion(plgpu.SMEM(a_shape, dtype, transforms=tiled(dtype)),
                       plgpu.SMEM(a_shape, dtype)),
        plgpu.SMEM((stages, tk, bw), dtype, transforms=tiled(dtype)),
        plgpu.Barrier(num_arrivals=full_arrivals, num_barriers=stages),
        stage_release_barriers(cluster, stages),
        plgpu.SMEM((_NUM_COMPUTE_WGS,) + staging.shape, dtype, transforms=staging.transforms),
        gather.stage_barriers(stages) if cp_async else None,
        collective_axes="wg")

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct(
          (e_count, width, d) if transpose_out else (e_count, d, width), dtype),
      **persistent_launch(cluster),
      kernel_name="weight_grad",
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  # The reduction stops at the TILE_K step holding an expert's last real row: padding only
  # follows it (an expert's padding ends its group), half a 128-row tile per expert on average.
  reduced_rows = (layout.expert_counts + tk - 1) // tk * tk
  return kernel(reduced_rows.astype(jnp.int32), group_start, layout.row_token, lhs, rhs_rows)
