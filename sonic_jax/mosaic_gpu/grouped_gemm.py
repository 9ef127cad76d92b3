"""The grouped GEMM core shared by every GEMM role: persistent, warp-specialised, varlen-M.

One kernel shape serves the up-projection, the down-projection and (later) the backward roles; a
role supplies only how its B operand is read and what its epilogue does (`GemmRole`).

Work: the grouped layout (`sonic_jax.layout`) cuts the rows into tiles of `tile_m` rows that each
belong to one expert; a tile's expert is `tile_expert[tile]` and only the first `num_tiles` tiles
are in use (a number known on the device only: the loops skip the rest, nothing syncs with the
host). The output columns are cut into column blocks; a role reads `num_rhs_blocks` B blocks of
`block_n` columns per column block (a GLU up-projection reads the gate and the up block). A
persistent grid of one CTA per SM walks the (tile, column block) space.

Warp specialisation, per CTA: two compute warpgroups issue wgmma into their accumulators and run
the role's epilogue; a memory warpgroup streams operands into a `num_stages`-deep ring of
shared-memory stages, each holding the A tile (tile_m x tile_k) and the B blocks. Two schedules
(`GroupedGemmConfig.schedule`):
- "cooperative": each compute warpgroup owns half of every tile's rows (one accumulator per B
  block); both read every stage (splitting rows rather than columns lets them share B and keeps
  each wgmma N = block_n wide) and both run the epilogue after the tile's mainloop, while the
  tensor cores wait.
- "pingpong": the warpgroups take whole tiles in turn (the CTA's 1st, 3rd, ... tile to one, the
  others to the other), so one warpgroup's epilogue runs while the other's mainloop keeps the
  tensor cores busy. A warpgroup's accumulator then has twice the rows, so it holds half the
  columns (`accumulator_columns`); the B blocks of a stage lie side by side in one buffer, read by
  one wgmma of N = num_rhs_blocks * block_n (N = 64 wgmmas would be bound by SMEM bandwidth).
  The ring is consumed in tile order, so stages alternate between the warpgroups by whole tiles.
`full[s]` completes when the stage's copies landed (pingpong: one barrier per stage and warpgroup,
signalled for the warpgroup that owns the stage's tile, so that each warpgroup waits on every
phase of its own barriers), `empty[s]` when the compute warpgroups that read the stage finished
the wgmma that read it.

The A operand is either contiguous (rows of the grouped buffer, one TMA copy per stage) or gathered:
row r of the tile is row `row_token[tile * tile_m + r]` of the source (`gather.py`: cp.async by the
memory warpgroup, completion signalled on per-stage barriers of their own). No gathered copy of the
source is ever written to HBM.
Gathered rows are written through other views of the stage than the (8, 64)-tiled one wgmma reads
(`RefUnion`): with 128-byte rows and the 128-byte swizzle, the (8, 64) and (1, 64) tilings both put
row r at byte r * 128 and the swizzle is a function of the address, so the views are byte-identical.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax.backends import interpreting
from sonic_jax.mosaic_gpu import gather

_SWIZZLE = 128  # bytes: one 64-element bf16 row
_NUM_COMPUTE_WGS = 2
SCHEDULES = ("cooperative", "pingpong")
# float32 accumulator elements per compute warpgroup: 128 registers per thread (a 64 x 256 tile),
# which leaves room for an epilogue inside the compute warpgroups' register budget.
_ACCUMULATOR_ELEMENTS = 64 * 256


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
  """Tile configuration of the grouped GEMM core.

  tile_m: rows per tile; must equal the grouped layout's row tile.
  tile_k: reduction step; 64 for 16-bit operands (one 128-byte swizzled row).
  num_stages: depth of the shared-memory operand ring.
  grid_tile_width: column blocks per band of the snake-ordered tile walk (L2 reuse of A rows).
  """

  tile_m: int = 128
  tile_k: int = 64
  num_stages: int = 4
  grid_tile_width: int = 4
  # How a gathered A operand is loaded (sonic_jax.mosaic_gpu.gather): "cp_async" (the memory
  # warpgroup's threads copy 16-byte pieces) or "row_tma" (one TMA per row: exact but issue-bound,
  # about 7x slower; what the interpreter always runs).
  gather_impl: str = "cp_async"
  # Registers per thread of the memory warpgroup (None: 80 for the cp.async gather, which computes
  # addresses, else 40); the compute warpgroups share the rest of the launch's pool.
  memory_registers: int | None = None
  # SMEM buffers that a role's epilogue stages its 64-column output pieces through (roles using
  # `epilogue.store_tiles`). A piece's buffer is rewritten once its TMA store has read it, so more
  # buffers leave more stores in flight; each costs tile_m * 128 bytes next to the operand ring.
  # On an H100 a 3-stage ring with 2-4 buffers was slower than 4 stages with 2 (up and down
  # projections, benchmarks/NOTES.md); the autotuner tries them.
  epilogue_buffers: int = 2
  # How the compute warpgroups share the tiles (module docstring): "cooperative" or "pingpong".
  schedule: str = "cooperative"
  # CTAs of the persistent grid; None: one per SM. Tests pass a few so that each CTA walks many
  # tiles (ring wrap-around, pingpong turns) on small problems.
  num_ctas: int | None = None

  @property
  def rows_per_warpgroup(self) -> int:
    """Rows of a tile that one compute warpgroup computes (its accumulator's rows)."""
    return self.tile_m // _NUM_COMPUTE_WGS if self.schedule == "cooperative" else self.tile_m

  @property
  def accumulator_columns(self) -> int:
    """Columns of accumulator one compute warpgroup holds (over all of a role's B blocks)."""
    return _ACCUMULATOR_ELEMENTS // self.rows_per_warpgroup

  def __post_init__(self):
    if self.tile_m % 128:  # two compute warpgroups, each wgmma M a multiple of 64 rows
      raise ValueError(f"tile_m must be a multiple of 128, got {self.tile_m}")
    if self.tile_k != 64:
      raise ValueError(f"tile_k must be 64 (one swizzled 16-bit row), got {self.tile_k}")
    if not 1 <= self.epilogue_buffers <= 8:
      raise ValueError(f"epilogue_buffers must be in [1, 8], got {self.epilogue_buffers}")
    if self.num_ctas is not None and self.num_ctas < 1:
      raise ValueError(f"num_ctas must be >= 1 or None, got {self.num_ctas}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    if self.gather_impl not in ("cp_async", "row_tma"):
      raise ValueError(f"gather_impl must be 'cp_async' or 'row_tma', got {self.gather_impl!r}")


@dataclasses.dataclass(frozen=True)
class EpilogueContext:
  """What a role's epilogue sees for one (tile, column block, warpgroup)."""

  row0: jax.Array  # first grouped row of this warpgroup's rows
  rows: int  # rows per warpgroup (`GroupedGemmConfig.rows_per_warpgroup`)
  expert: jax.Array
  column_block: jax.Array
  inputs: Sequence[Any]  # the role's extra GMEM inputs
  outputs: Sequence[Any]  # the role's GMEM outputs
  scratch: Any  # this warpgroup's epilogue SMEM scratch
  # Completes when the copies of the role's `epilogue_prefetch` landed (None without one).
  prefetched: Any = None


@dataclasses.dataclass(frozen=True)
class GemmRole:
  """A GEMM role: its B operand and its epilogue.

  rhs_copy(rhs_ref, expert, k_slice, column_block, j) -> the GMEM view (tile_k, block_n) that B
  block j of the stage is copied from (one dense TMA box); (block_n, tile_k) when rhs_transposed,
  for weights stored (N, K) per expert: wgmma reads the transposed 16-bit block for free, so the
  backward's w^T products need no transposed copy of the weights.
  epilogue(accs, ctx) consumes the float32 accumulators [(rows, block_n)] * num_rhs_blocks of one
  warpgroup (rows = the config's `rows_per_warpgroup`) and stores the outputs; block_n *
  num_rhs_blocks must not exceed the config's `accumulator_columns`.
  epilogue_scratch: one plgpu.SMEM, a tuple of them, or one plgpu.RefUnion (a union unpacks only
  as the whole scratch), per warpgroup; the epilogue sees this warpgroup's refs (a RefUnion as the
  flat tuple of its members' leaves).
  epilogue_prefetch(ctx, barrier): optional; each compute warpgroup calls it as its tile's
  mainloop starts, to TMA-copy the epilogue's GMEM inputs into its scratch (`prefetch_copies`
  copies, all on `barrier`); the epilogue waits on `ctx.prefetched`. Epilogue inputs read straight
  from GMEM stall the warpgroup for a full memory latency per load after the mainloop.
  """

  block_n: int
  num_rhs_blocks: int
  num_column_blocks: int
  rhs_copy: Callable
  epilogue: Callable
  epilogue_scratch: Any  # SMEM scratch for one warpgroup's epilogue (a plgpu.SMEM)
  out_types: Sequence[jax.ShapeDtypeStruct]
  rhs_transposed: bool = False
  epilogue_prefetch: Callable | None = None
  prefetch_copies: int = 0


def tiled(dtype):
  """The (8, 64) tiling + 128-byte swizzle that wgmma operands and TMA copies use."""
  elems = _SWIZZLE // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(_SWIZZLE))


def drain_ring(empty, total_steps, stages: int):
  """Memory warpgroup, after its last copy: waits for the compute warpgroups' releases of the last
  `stages` stages, so that every barrier phase is observed before the barriers go away."""
  for j in range(stages):
    s = total_steps - stages + j

    @pl.when(s >= 0)
    def _():
      plgpu.barrier_wait(empty.at[lax.rem(s, stages)])


def unsupported_operands(a, b, multiples) -> str | None:
  """Why a kernel cannot take these operands, or None: both 16-bit floats of one dtype and every
  (name, size, multiple) of `multiples` divisible."""
  if a.dtype not in (jnp.bfloat16, jnp.float16) or b.dtype != a.dtype:
    return f"dtypes {a.dtype}, {b.dtype} (the kernel takes bfloat16 or float16, both the same)"
  for name, size, multiple in multiples:
    if size % multiple:
      return f"{name}={size} is not a multiple of {multiple}"
  return None


def check_layout_tile(layout, tile_m: int):
  if layout.row_tile != tile_m:
    raise ValueError(f"layout row_tile {layout.row_tile} != kernel tile_m {tile_m}")


# The launch gives each of the 3 * 128 threads 65536 // 384 registers, rounded down to a multiple of
# 8 (168): `setmaxnreg` can only move registers between warpgroups within that pool, and an
# increase that the pool cannot cover blocks forever (the cp.async gather's "hang": 80 + 2 * 216 >
# 504).
_REGISTER_POOL = (65536 // (128 * (_NUM_COMPUTE_WGS + 1))) // 8 * 8 * (_NUM_COMPUTE_WGS + 1)


def register_split(gather_impl: str | None, memory: int | None = None) -> tuple[int, int]:
  """(memory warpgroup, compute warpgroup) registers per thread; the cp.async gather computes
  addresses in the memory warpgroup, so by default it gets more than a TMA-only producer."""
  if memory is None:
    memory = 80 if gather_impl == "cp_async" else 40
  if memory % 8 or not 24 <= memory <= 256:
    raise ValueError(f"memory_registers must be a multiple of 8 in [24, 256], got {memory}")
  compute = (_REGISTER_POOL - memory) // _NUM_COMPUTE_WGS // 8 * 8
  return memory, compute


def target_device():
  """The GPU the kernels are built for: the abstract mesh's device (export, interpret mode), else
  the first device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and getattr(mesh, "abstract_device", None) is not None:
    return mesh.abstract_device
  return jax.devices()[0]


def num_sms() -> int:
  dev = target_device()
  return getattr(dev, "num_cores", None) or getattr(dev, "core_count", None) or 132


def _per_warpgroup(scratch):
  """One copy of a role's epilogue scratch (an SMEM, a tuple of them, or a RefUnion of such
  groups) for each compute warpgroup: a leading warpgroup dimension on every buffer."""
  if isinstance(scratch, tuple):
    return tuple(map(_per_warpgroup, scratch))
  if isinstance(scratch, plgpu.RefUnion):
    return plgpu.RefUnion(*map(_per_warpgroup, scratch.refs))
  return plgpu.SMEM((_NUM_COMPUTE_WGS,) + scratch.shape, scratch.dtype,
                    transforms=scratch.transforms)


def _at_warpgroup(refs, scratch, wg):
  """This warpgroup's view of the scratch refs; `scratch` is their spec. A RefUnion arrives as a
  ref that iterates over its groups: the epilogue gets the flat tuple of their refs."""
  if isinstance(scratch, tuple):
    return tuple(_at_warpgroup(r, s, wg) for r, s in zip(refs, scratch))
  if isinstance(scratch, plgpu.RefUnion):
    flat = lambda g: [x for r in g for x in flat(r)] if isinstance(g, (tuple, list)) else [g]
    return tuple(r.at[wg] for r in flat(tuple(refs)))
  return refs.at[wg]


def grouped_gemm(lhs, rhs, tile_expert, num_tiles, row_token, role: GemmRole,
                 extra_inputs: Sequence[jax.Array], config: GroupedGemmConfig):
  """Runs `role` over the grouped layout. lhs: (rows, k) source of A; rhs: the role's weights.

  row_token: (R,) int32 gather indices into lhs, or None when lhs is the (R, k) grouped buffer.
  Returns the role's outputs.
  """
  tm, tk, stages = config.tile_m, config.tile_k, config.num_stages
  k = lhs.shape[1]
  if k % tk:
    raise ValueError(f"the contraction dim ({k}) must be a multiple of tile_k={tk}")
  k_iters = k // tk
  dtype = lhs.dtype
  gather_impl = None
  if row_token is not None:
    gather_impl = "row_tma" if interpreting() else config.gather_impl
  memory_regs, compute_regs = register_split(gather_impl, config.memory_registers)
  m_tiles = tile_expert.shape[0]
  grid = (m_tiles * role.num_column_blocks,)
  interpret_mode = interpreting()
  pingpong = config.schedule == "pingpong"
  rows = config.rows_per_warpgroup
  blocks = role.num_rhs_blocks
  if role.block_n * blocks > config.accumulator_columns:
    raise ValueError(f"{blocks} B blocks of {role.block_n} columns exceed the "
                     f"{config.accumulator_columns} accumulator columns of a {config.schedule} "
                     f"warpgroup")
  # Pingpong reads the B blocks of a stage side by side, as one wgmma operand.
  fused_b = pingpong and blocks > 1
  if fused_b and role.rhs_transposed:
    raise NotImplementedError("pingpong with several transposed B blocks")

  def body(tile_expert_ref, num_tiles_ref, row_token_ref, lhs_ref, rhs_ref, *refs):
    n_in = len(extra_inputs)
    inputs, outputs = refs[:n_in], refs[n_in:]

    def scoped(a_union, b_smem, full, empty, epi_scratch, a_ready, prefetch_bar):
      a_rows, a_tiles, a_raw = a_union
      if gather_impl == "cp_async":
        gather.init_stage_barriers(a_ready)
      if interpret_mode:
        a_tiles = a_rows  # the interpreter keeps RefUnion members apart; on a GPU they alias
      wg = lax.axis_index("wg")
      n_tiles_used = num_tiles_ref[0]

      def walk_tiles(per_tile, owner=None):
        """Runs per_tile(tile, column_block, expert, first_step, owner) over this CTA's tiles in
        use, in the same order in every warpgroup; owner is the compute warpgroup whose tile it
        is under pingpong (0 under cooperative). With `owner` given, runs only that warpgroup's
        tiles. Returns the number of k-steps taken (stages used)."""
        @plgpu.nd_loop(grid, collective_axes="sm", init_carry=(jnp.int32(0), jnp.int32(0)))
        def _tiles(info, carry):
          step, count = carry
          mi, nb = plgpu.planar_snake(info.index[0], (m_tiles, role.num_column_blocks), 1,
                                      config.grid_tile_width)
          active = mi < n_tiles_used
          tile_owner = lax.rem(count, _NUM_COMPUTE_WGS) if pingpong else jnp.int32(0)
          run = active if owner is None else active & (tile_owner == owner)
          pl.when(run)(lambda: per_tile(mi, nb, tile_expert_ref[mi], step, tile_owner))
          taken = jnp.where(active, 1, 0)
          return step + taken * k_iters, count + taken
        return _tiles[0]

      @pl.when(wg == _NUM_COMPUTE_WGS)
      def _memory_wg():
        plgpu.set_max_registers(memory_regs, action="decrease")

        def load_tile(mi, nb, expert, step, owner):
          @pl.loop(0, k_iters)
          def _k(ki):
            s = step + ki
            slot = lax.rem(s, stages)
            landed = full.at[owner * stages + slot] if pingpong else full.at[slot]

            @pl.when(s >= stages)
            def _():
              plgpu.barrier_wait(empty.at[slot])

            k_slice = pl.ds(ki * tk, tk)
            if gather_impl == "cp_async":
              gather.cp_async_rows(lhs_ref.at[:, k_slice], row_token_ref.at[pl.ds(mi * tm, tm)],
                                   a_raw.at[slot], a_ready.at[slot], source_row_stride=k)
            elif gather_impl == "row_tma":
              base = mi * tm

              @pl.loop(0, tm)
              def _row(r):
                tok = row_token_ref[base + r]
                plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(tok, 1), k_slice],
                                        a_rows.at[slot, pl.ds(r, 1)], landed)
            else:
              plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(mi * tm, tm), k_slice],
                                      a_tiles.at[slot], landed)
            for j in range(blocks):
              src = role.rhs_copy(rhs_ref, expert, k_slice, nb, j)
              if not fused_b:
                plgpu.copy_gmem_to_smem(src, b_smem.at[slot, j], landed)
                continue
              # A TMA box lands in contiguous SMEM, and a block's columns of the fused (8, 64)-
              # tiled buffer are contiguous only 8 rows at a time (one tile): a box per tile.
              cols = pl.ds(j * role.block_n, role.block_n)
              for r in range(b_shape[0] // 8):
                tile_rows = pl.ds(r * 8, 8)
                plgpu.copy_gmem_to_smem(
                    src.at[tile_rows], b_smem.at[slot, 0, tile_rows, cols], landed)

        drain_ring(empty, walk_tiles(load_tile), stages)

      @pl.when(wg < _NUM_COMPUTE_WGS)
      def _compute_wg():
        plgpu.set_max_registers(compute_regs, action="increase")

        def compute_tile(mi, nb, expert, step, owner):
          del owner  # == wg under pingpong
          ctx = EpilogueContext(
              row0=mi * tm + (0 if pingpong else wg * rows), rows=rows, expert=expert,
              column_block=nb, inputs=inputs, outputs=outputs,
              scratch=_at_warpgroup(epi_scratch, role.epilogue_scratch, wg),
              prefetched=None if prefetch_bar is None else prefetch_bar.at[wg])

          def acc_scope(*acc_refs):
            @pl.loop(0, k_iters)
            def _k(ki):
              slot = lax.rem(step + ki, stages)
              plgpu.barrier_wait(full.at[wg * stages + slot] if pingpong else full.at[slot])
              if gather_impl == "cp_async":
                gather.wait_stage(a_ready.at[slot], lax.rem((step + ki) // stages, 2))
              a_rows_of_wg = a_tiles.at[slot] if pingpong else a_tiles.at[slot,
                                                                          pl.ds(wg * rows, rows)]
              for j in range(len(acc_refs)):
                b = b_smem.at[slot, j]
                if role.rhs_transposed:
                  b = b.transpose((1, 0))
                plgpu.wgmma(acc_refs[j], a_rows_of_wg, b)
              if role.epilogue_prefetch is not None:
                # While the first wgmmas run: the previous tile's stores must have read the
                # scratch before the prefetch overwrites it.
                @pl.when(ki == 0)
                def _():
                  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                  role.epilogue_prefetch(ctx, ctx.prefetched)
              # The previous step's wgmmas are done: release its stage.
              plgpu.wgmma_wait(len(acc_refs))

              @pl.when(ki > 0)
              def _():
                plgpu.barrier_arrive(empty.at[lax.rem(step + ki - 1, stages)])

            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(empty.at[lax.rem(step + k_iters - 1, stages)])
            return [r[...] for r in acc_refs]

          if fused_b:
            (acc,) = pl.run_scoped(acc_scope, plgpu.ACC((rows, blocks * role.block_n),
                                                        jnp.float32))
            bn = role.block_n
            accs = [acc[:, j * bn:(j + 1) * bn] for j in range(blocks)]
          else:
            accs = pl.run_scoped(acc_scope, *[plgpu.ACC((rows, role.block_n), jnp.float32)
                                              for _ in range(blocks)])
          role.epilogue(accs, ctx)

        walk_tiles(compute_tile, owner=wg if pingpong else None)
        plgpu.wait_smem_to_gmem(0)

    # Arrivals on full[s]: the B copies, plus one per A row copy (row_tma) or the A copy (TMA);
    # the cp.async gather signals its own per-stage barriers instead (`gather.stage_barriers`).
    a_copies = {"row_tma": tm, "cp_async": 0, None: 1}[gather_impl]
    b_width = role.block_n * (blocks if fused_b else 1)
    b_shape = (b_width, tk) if role.rhs_transposed else (tk, b_width)
    copies_per_stage = a_copies + (blocks * b_shape[0] // 8 if fused_b else blocks)
    elems = _SWIZZLE // jnp.dtype(dtype).itemsize
    a_union = plgpu.RefUnion(
        plgpu.SMEM((stages, tm, tk), dtype, transforms=(plgpu.TilingTransform((1, elems)),
                                                         plgpu.SwizzleTransform(_SWIZZLE))),
        plgpu.SMEM((stages, tm, tk), dtype, transforms=tiled(dtype)),
        plgpu.SMEM((stages, tm, tk), dtype),  # raw bytes, for the cp.async gather's addressing
    )
    b_smem = plgpu.SMEM((stages, 1 if fused_b else blocks) + b_shape, dtype,
                        transforms=tiled(dtype))
    epi = _per_warpgroup(role.epilogue_scratch)
    pl.run_scoped(
        scoped, a_union, b_smem,
        plgpu.Barrier(num_arrivals=copies_per_stage,
                      num_barriers=stages * (_NUM_COMPUTE_WGS if pingpong else 1)),
        plgpu.Barrier(num_arrivals=1 if pingpong else _NUM_COMPUTE_WGS, num_barriers=stages),
        epi, gather.stage_barriers(stages) if gather_impl == "cp_async" else None,
        (plgpu.Barrier(num_arrivals=role.prefetch_copies, num_barriers=_NUM_COMPUTE_WGS)
         if role.epilogue_prefetch is not None else None),
        collective_axes="wg")

  if row_token is None:
    row_token = jnp.zeros((1,), jnp.int32)
  kernel = plgpu.kernel(
      body,
      out_type=tuple(role.out_types),
      grid=(config.num_ctas or num_sms(),),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True,
          # Pallas reserves 2 KiB of SMEM for any reduction by default; the epilogues reduce
          # only along the rows of a WGMMA fragment (shuffles within a warp, no SMEM).
          reduction_scratch_bytes=0),
  )
  return kernel(tile_expert, num_tiles.reshape(1), row_token, lhs, rhs, *extra_inputs)

