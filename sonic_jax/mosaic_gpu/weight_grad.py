"""Varlen-K grouped GEMM for the weight gradients: out[e] = lhs_e^T @ rhs_e, the reduction running
over expert e's rows of the grouped layout.

dw1_e = x_rows_e^T dH_e and dw2_e = A_s,e^T dO_rows_e. Each work item is one (expert, block_m x
block_n) block of out[e]; its k-loop walks the expert's rows tile_k at a time, so the number of
steps is data (the expert's group size): nothing syncs with the host and experts with no rows get
exact zeros. Same warp specialisation as the varlen-M core (`grouped_gemm.py`): a memory warpgroup
fills a ring of stages with TMA, two compute warpgroups each own half of the block's rows and read
their half of the A tile transposed (wgmma transposes 16-bit SMEM operands for free), so no
transposed copy of the activations is ever made. Reference: `xla_backend.grouped_weight_grad`.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import drain_ring, num_sms, tiled, unsupported_operands

_NUM_COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class WeightGradConfig:
  """block_m: output rows per work item (two warpgroups of 64); block_n: output columns;
  tile_k: grouped rows per reduction step; num_stages: depth of the operand ring."""

  block_m: int = 128
  block_n: int = 256
  tile_k: int = 64
  num_stages: int = 4

  def __post_init__(self):
    if self.block_m != 64 * _NUM_COMPUTE_WGS:
      raise ValueError(f"block_m must be {64 * _NUM_COMPUTE_WGS}, got {self.block_m}")
    if self.tile_k != 64:
      raise ValueError(f"tile_k must be 64, got {self.tile_k}")


def supports(lhs_rows, rhs_rows, config: WeightGradConfig = WeightGradConfig()) -> str | None:
  return unsupported_operands(lhs_rows, rhs_rows,
                              [("lhs width", lhs_rows.shape[1], config.block_m),
                               ("rhs width", rhs_rows.shape[1], config.block_n)])


def weight_grad(lhs_rows, rhs_rows, layout, config: WeightGradConfig = WeightGradConfig()):
  """(E, m, n) in lhs's dtype, float32 accumulation; lhs_rows (R, m), rhs_rows (R, n) grouped rows
  whose padding rows are zero in at least one of the two."""
  if layout.row_tile % config.tile_k:
    raise ValueError(f"layout row_tile {layout.row_tile} is not a multiple of tile_k")
  m, n = lhs_rows.shape[1], rhs_rows.shape[1]
  e_count = layout.num_experts
  bm, bn, tk, stages = config.block_m, config.block_n, config.tile_k, config.num_stages
  half = bm // _NUM_COMPUTE_WGS
  m_blocks, n_blocks = m // bm, n // bn
  items = e_count * m_blocks * n_blocks
  dtype = lhs_rows.dtype
  group_start = (jnp.cumsum(layout.group_sizes) - layout.group_sizes).astype(jnp.int32)

  def body(sizes_ref, starts_ref, lhs_ref, rhs_ref, out_ref):
    def scoped(a_smem, b_smem, full, empty, staging):
      wg = lax.axis_index("wg")

      def walk_items(per_item):
        """per_item(expert, m_block, n_block, first_row, steps, first_step) over this CTA's
        items, in the same order in every warpgroup; returns the k-steps taken."""
        @plgpu.nd_loop((items,), collective_axes="sm", init_carry=jnp.int32(0))
        def _items(info, carry):
          step = carry
          idx = info.index[0]
          e = idx // (m_blocks * n_blocks)
          mb = lax.rem(idx, m_blocks * n_blocks) // n_blocks
          nb = lax.rem(idx, n_blocks)
          steps = sizes_ref[e] // tk
          per_item(e, mb, nb, starts_ref[e], steps, step)
          return step + steps
        return _items

      @pl.when(wg == _NUM_COMPUTE_WGS)
      def _memory_wg():
        plgpu.set_max_registers(40, action="decrease")

        def load(e, mb, nb, first_row, steps, step):
          del e

          @pl.loop(0, steps)
          def _k(ki):
            s = step + ki
            slot = lax.rem(s, stages)

            @pl.when(s >= stages)
            def _():
              plgpu.barrier_wait(empty.at[slot])

            # Group starts are multiples of the layout's row tile, hence of tile_k.
            rows = pl.ds(pl.multiple_of(first_row + ki * tk, tk), tk)
            for h in range(_NUM_COMPUTE_WGS):
              plgpu.copy_gmem_to_smem(lhs_ref.at[rows, pl.ds(mb * bm + h * half, half)],
                                      a_smem.at[slot, h], full.at[slot])
            plgpu.copy_gmem_to_smem(rhs_ref.at[rows, pl.ds(nb * bn, bn)], b_smem.at[slot],
                                    full.at[slot])

        drain_ring(empty, walk_items(load), stages)

      @pl.when(wg < _NUM_COMPUTE_WGS)
      def _compute_wg():
        plgpu.set_max_registers(232, action="increase")

        def compute(e, mb, nb, first_row, steps, step):
          del first_row

          def acc_scope(acc_ref):
            @pl.loop(0, steps)
            def _k(ki):
              slot = lax.rem(step + ki, stages)
              plgpu.barrier_wait(full.at[slot])
              plgpu.wgmma(acc_ref, a_smem.at[slot, wg].transpose((1, 0)), b_smem.at[slot])
              plgpu.wgmma_wait(1)  # the previous step's wgmma is done: release its stage

              @pl.when(ki > 0)
              def _():
                plgpu.barrier_arrive(empty.at[lax.rem(step + ki - 1, stages)])

            plgpu.wgmma_wait(0)

            @pl.when(steps > 0)
            def _():
              plgpu.barrier_arrive(empty.at[lax.rem(step + steps - 1, stages)])

            return acc_ref[...]

          acc = pl.run_scoped(acc_scope, plgpu.ACC((half, bn), jnp.float32))
          dst = out_ref.at[e, pl.ds(mb * bm + wg * half, half), pl.ds(nb * bn, bn)]
          epi.store_tiles([(acc.astype(dtype), dst)], staging.at[wg])

        walk_items(compute)
        plgpu.wait_smem_to_gmem(0)

    staging = epi.staging_buffers(half, dtype)
    pl.run_scoped(
        scoped,
        plgpu.SMEM((stages, _NUM_COMPUTE_WGS, tk, half), dtype, transforms=tiled(dtype)),
        plgpu.SMEM((stages, tk, bn), dtype, transforms=tiled(dtype)),
        plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS + 1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=_NUM_COMPUTE_WGS, num_barriers=stages),
        plgpu.SMEM((_NUM_COMPUTE_WGS,) + staging.shape, dtype, transforms=staging.transforms),
        collective_axes="wg")

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((e_count, m, n), dtype),
      grid=(num_sms(),),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return kernel(layout.group_sizes, group_start, lhs_rows, rhs_rows)
