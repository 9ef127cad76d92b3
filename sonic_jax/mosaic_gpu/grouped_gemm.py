"""The grouped GEMM core shared by every GEMM role: persistent, warp-specialised, varlen-M.

One kernel shape serves the up- and down-projections and the backward's dH and dX roles; a role
supplies only how its B operand is read and what its epilogue does (`GemmRole`).

Work: the grouped layout (`sonic_jax.layout`) cuts the rows into tiles of `TILE_M` rows that each
belong to one expert; a tile's expert is `tile_expert[tile]` and only the first `num_tiles` tiles
are in use (a number known on the device only: the loops skip the rest, nothing syncs with the
host). The output columns are cut into column blocks; a role reads `num_rhs_blocks` B blocks of
`block_n` columns per column block (a GLU up-projection reads the gate and the up block). A
persistent grid of one CTA per SM walks the (tile, column block) space.

Warp specialisation, per CTA: two compute warpgroups, each owning half of the tile's rows, issue
wgmma into their own accumulators (one per B block) and run the role's epilogue; a memory
warpgroup streams operands into a `num_stages`-deep ring of shared-memory stages. A stage holds the
A tile (TILE_M x TILE_K) and the B blocks, both read by both compute warpgroups (splitting rows
rather than columns lets the warpgroups share B and keeps each wgmma N = block_n wide). `full[s]`
completes when the stage's copies landed, `empty[s]` when both compute warpgroups finished the
wgmma that read it.

With `schedule="pingpong"` the compute warpgroups take the CTA's tiles in turn instead, each a whole
tile (TILE_M rows; roles halve their column blocks so the accumulators still fit), so that one
warpgroup's epilogue (activation, conversion, stores: no wgmma) runs while the other's mainloop
keeps the tensor cores busy. The ring stays one sequence. Where each tile uses every ring slot an
even number of times (k-steps a multiple of 2 * num_stages) the schedule is decoupled: the owner
alone waits for and releases a tile's stages; elsewhere, and always in the interpreter
(which checks that every thread that waits on a barrier sees each of its phases), the other
warpgroup waits for and releases them too, without reading them. A pingpong CTA loads a 128 x 128
tile's operands for each 128 x 128 of output, 1.33x the operand bytes per FLOP of the cooperative
128 x 256 CTA tile, so only dH, whose epilogue is the heaviest, runs it, where the tuning table
says so, and never in 2-CTA clusters, which it ran slower in (docs/decisions.md).

With `cluster_m=2` the persistent grid is one 2-CTA cluster per two SMs, walking pairs of
consecutive row tiles (one per CTA) of a column block: where the pair shares its expert, B is TMA-
multicast (each CTA loads half of each block for both) and the `empty` barriers are cluster-wide.

The A operand is either contiguous (rows of the grouped buffer, one TMA copy per stage) or gathered:
row r of the tile is row `row_token[tile * TILE_M + r]` of the source (`gather.py`: cp.async by the
memory warpgroup, completion signalled on per-stage barriers of their own). No gathered copy of the
source is ever written to HBM. The gather addresses the stage through an untransformed view of its
bytes (`RefUnion`) and writes each 16-byte piece where the (8, 64)-tiled, 128-byte-swizzled view
that wgmma reads expects it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax.interpret import interpreting, warn_if_interpreter_may_hang
from sonic_jax.mosaic_gpu import gather
from sonic_jax.mosaic_gpu.tuning import target_device

_SWIZZLE = 128  # bytes: one 64-element bf16 row
_NUM_COMPUTE_WGS = 2
SCHEDULES = ("cooperative", "pingpong")
# Rows per tile, the grouped layout's row tile (`backend.ROW_TILE`): the two compute warpgroups'
# 64-row wgmmas (cooperative), or one warpgroup's whole tile (pingpong).
TILE_M = 128
TILE_K = 64  # reduction step: one 128-byte swizzled row of 16-bit operands


@dataclasses.dataclass(frozen=True)
class GroupedGemmConfig:
  """Tile configuration of the grouped GEMM core.

  num_stages: depth of the shared-memory operand ring.
  grid_tile_width: width of a band of the snake-ordered tile walk, in column blocks or row tiles
    (`grid_band`).
  grid_band: what a band spans `grid_tile_width` of: "n", column blocks (the band runs down every
    row tile of every expert, so each band re-reads all A rows), or "m", row tiles (the band runs
    across every column block, so A rows are read once and each expert's weights once per band
    of its rows). Which one moves fewer bytes from DRAM depends on the role and the problem:
    the tuning table picks.
  """

  num_stages: int = 4
  grid_tile_width: int = 4
  grid_band: str = "n"
  # Registers per thread of the memory warpgroup (None: 80 for the cp.async gather, which computes
  # addresses, else 40); the compute warpgroups share the rest of the launch's pool.
  memory_registers: int | None = None
  # CTAs per cluster along M (1 or 2). With 2, the CTAs of a cluster take consecutive row tiles of
  # the same column block; when both tiles belong to one expert (all but the pairs that straddle an
  # expert boundary), each CTA TMA-loads half of every B block and multicasts it to both, halving
  # the weights' L2 -> SMEM traffic. The operand ring's `empty` barriers are then cluster-wide: a
  # stage is rewritten only once the compute warpgroups of both CTAs released it.
  cluster_m: int = 1
  # How the two compute warpgroups share a tile: "cooperative" (each takes half of every tile's
  # rows; both run the epilogue at once, with no wgmma in flight) or "pingpong" (each takes every
  # other tile whole, so one warpgroup's epilogue runs under the other's mainloop). A pingpong
  # warpgroup holds a whole tile's accumulators: roles halve their column blocks for it.
  schedule: str = "cooperative"

  @property
  def rows_per_warpgroup(self) -> int:
    return TILE_M if self.schedule == "pingpong" else TILE_M // _NUM_COMPUTE_WGS

  def __post_init__(self):
    if self.cluster_m not in (1, 2):
      raise ValueError(f"cluster_m must be 1 or 2, got {self.cluster_m}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    if self.schedule == "pingpong" and self.cluster_m != 1:
      raise ValueError("the pingpong schedule runs unclustered (cluster_m=1): in 2-CTA clusters "
                       "it measured slower (docs/decisions.md, 'dH')")
    if self.grid_band not in ("n", "m"):
      raise ValueError(f"grid_band must be 'n' or 'm', got {self.grid_band!r}")
    for name in ("num_stages", "grid_tile_width"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if self.memory_registers is not None:
      register_split(False, self.memory_registers)  # refuses a split the launch cannot give


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
  warpgroup (rows: `GroupedGemmConfig.rows_per_warpgroup`) and stores the outputs.
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
  epilogue_scratch: Any  # SMEM scratch for one warpgroup's epilogue (see above)
  out_types: Sequence[jax.ShapeDtypeStruct]
  rhs_transposed: bool = False
  epilogue_prefetch: Callable | None = None
  prefetch_copies: int = 0
  name: str = "grouped_gemm"  # the kernel's name in profiles


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


def consume_stages(full, empty, ready, step, steps, stages: int, issue, *, after_issue=None,
                   before_drain=None):
  """A compute warpgroup's k-loop over the operand ring, k-steps step .. step + steps (steps may be
  traced, and 0). Each waits for its stage (and, with `ready`, for the cp.async gather's rows),
  runs `issue(slot, ki)`, which starts the step's wgmmas and returns how many, then
  `after_issue(ki)` (work under those wgmmas), and releases the previous step's stage once its
  wgmmas are done. After the loop, `before_drain()`, then every wgmma done and the last stage
  released."""
  @pl.loop(0, steps)
  def _k(ki):
    slot = lax.rem(step + ki, stages)
    plgpu.barrier_wait(full.at[slot])
    if ready is not None:
      gather.wait_stage(ready.at[slot], lax.rem((step + ki) // stages, 2))
    issued = issue(slot, ki)
    if after_issue is not None:
      after_issue(ki)
    plgpu.wgmma_wait(issued)  # the previous step's wgmmas are done: release its stage

    @pl.when(ki > 0)
    def _():
      plgpu.barrier_arrive(empty.at[lax.rem(step + ki - 1, stages)])

  if before_drain is not None:
    before_drain()
  plgpu.wgmma_wait(0)
  release_last = lambda: plgpu.barrier_arrive(empty.at[lax.rem(step + steps - 1, stages)])
  if isinstance(steps, int):
    if steps > 0:
      release_last()
  else:
    pl.when(steps > 0)(release_last)


def stage_release_barriers(cluster: int, stages: int, consumers: int = _NUM_COMPUTE_WGS):
  """The operand ring's `empty` barriers, one per stage, completed by the `consumers` compute
  warpgroups that read a stage; with a 2-CTA cluster by those of both CTAs (a multicast stage is
  rewritten in both at once)."""
  if cluster == 1:
    return plgpu.Barrier(num_arrivals=consumers, num_barriers=stages)
  return plgpu.ClusterBarrier(collective_axes=("cluster",), num_arrivals=consumers,
                              num_barriers=stages)


def persistent_launch(cluster: int) -> dict:
  """plgpu.kernel's grid arguments for a persistent kernel of one CTA per SM, as `cluster`-CTA
  clusters along the axis "cluster"."""
  return dict(grid=(num_sms() // cluster,), grid_names=("sm",),
              cluster=(cluster,) if cluster > 1 else (),
              cluster_names=("cluster",) if cluster > 1 else ())


def unsupported_operands(a, b, multiples) -> str | None:
  """Why a kernel cannot take these operands, or None: both 16-bit floats of one dtype and every
  (name, size, multiple) of `multiples` divisible."""
  if a.dtype not in (jnp.bfloat16, jnp.float16) or b.dtype != a.dtype:
    return f"dtypes {a.dtype}, {b.dtype} (the kernel takes bfloat16 or float16, both the same)"
  for name, size, multiple in multiples:
    if size % multiple:
      return f"{name}={size} is not a multiple of {multiple}"
  return None


def check_layout_tile(layout):
  if layout.row_tile != TILE_M:
    raise ValueError(f"layout row_tile {layout.row_tile} != the kernels' tile of {TILE_M} rows")


# The launch gives each of the 3 * 128 threads 65536 // 384 registers, rounded down to a multiple of
# 8 (168): `setmaxnreg` can only move registers between warpgroups within that pool, and an
# increase that the pool cannot cover blocks forever (the cp.async gather's "hang": 80 + 2 * 216 >
# 504).
_REGISTER_POOL = (65536 // (128 * (_NUM_COMPUTE_WGS + 1))) // 8 * 8 * (_NUM_COMPUTE_WGS + 1)


def register_split(gathers: bool, memory: int | None = None) -> tuple[int, int]:
  """(memory warpgroup, compute warpgroup) registers per thread; the cp.async gather computes
  addresses in the memory warpgroup, so by default it gets more than a TMA-only producer."""
  if memory is None:
    memory = 80 if gathers else 40
  # setmaxnreg only lowers the memory warpgroup from the launch's share and raises the compute
  # ones: above it the memory one would ask for more and the compute ones for fewer.
  launch = _REGISTER_POOL // (_NUM_COMPUTE_WGS + 1)
  if memory % 8 or not 24 <= memory <= launch:
    raise ValueError(f"memory_registers must be a multiple of 8 in [24, {launch}], got {memory}")
  compute = (_REGISTER_POOL - memory) // _NUM_COMPUTE_WGS // 8 * 8
  return memory, compute


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
  tm, tk, stages = TILE_M, TILE_K, config.num_stages
  k = lhs.shape[1]
  if k % tk:
    raise ValueError(f"the contraction dim ({k}) must be a multiple of TILE_K={tk}")
  k_iters = k // tk
  dtype = lhs.dtype
  interpret_mode = interpreting()
  # How A arrives: "tma" (contiguous rows), "cp_async" (gathered, `gather.cp_async_rows`) or
  # "interpreted" (gathered by one indexed read a stage: the interpreter runs no inline Mosaic GPU).
  gather_impl = "tma" if row_token is None else "interpreted" if interpret_mode else "cp_async"
  memory_regs, compute_regs = register_split(row_token is not None, config.memory_registers)
  m_tiles = tile_expert.shape[0]
  num_experts = rhs.shape[0]
  cluster = config.cluster_m
  m_groups = pl.cdiv(m_tiles, cluster)
  walk_grid = (m_groups * role.num_column_blocks,)
  pingpong = config.schedule == "pingpong"
  decoupled = pingpong and k_iters % (2 * stages) == 0 and not interpret_mode
  if interpret_mode:
    warn_if_interpreter_may_hang()

  def body(tile_expert_ref, num_tiles_ref, row_token_ref, lhs_ref, rhs_ref, *refs):
    n_in, n_out = len(extra_inputs), len(role.out_types)
    inputs, outputs = refs[:n_in], refs[n_in:n_in + n_out]

    def scoped(a_union, b_smem, full, empty, epi_scratch, a_ready, prefetch_bar, order):
      a_tiles, a_raw = a_union
      if gather_impl == "cp_async":
        gather.init_stage_barriers(a_ready)
      wg = lax.axis_index("wg")
      n_tiles_used = num_tiles_ref[0]

      def walk_tiles(per_tile):
        """Runs per_tile(tile, column_block, expert, first_step, active, shared) over this CTA's
        tiles, in the same order in every warpgroup; returns the number of k-steps taken (stages
        used). A cluster walks groups of `cluster` consecutive row tiles; a group runs when its
        first tile is in use, and a CTA whose own tile is not (the last group's tail) runs it as a
        dummy tile (its loads and wgmmas keep the cluster's barriers in step; `active` is False
        and the epilogue is skipped). `shared`: every tile of the group has one expert (B is
        multicast)."""
        @plgpu.nd_loop(walk_grid, collective_axes="sm", init_carry=jnp.int32(0))
        def _tiles(info, carry):
          step = carry
          gi, nb = plgpu.planar_snake(info.index[0], (m_groups, role.num_column_blocks),
                                      1 if config.grid_band == "n" else 0,
                                      config.grid_tile_width)
          first = gi * cluster
          group_active = first < n_tiles_used
          if cluster == 1:
            mi, active, shared = first, group_active, False
            expert = tile_expert_ref[mi]
          else:
            last = first + cluster - 1
            mi = first + lax.axis_index("cluster")
            active = mi < n_tiles_used
            # Unused tiles carry the expert id E: clamp it for the dummy tile's B copy.
            mi = jnp.minimum(mi, m_tiles - 1)
            expert = jnp.minimum(tile_expert_ref[mi], num_experts - 1)
            shared = (last < n_tiles_used) & (
                tile_expert_ref[first] == tile_expert_ref[jnp.minimum(last, m_tiles - 1)])
          pl.when(group_active)(lambda: per_tile(mi, nb, expert, step, active, shared))
          return step + jnp.where(group_active, k_iters, 0)
        return _tiles

      @pl.when(wg == _NUM_COMPUTE_WGS)
      def _memory_wg():
        plgpu.set_max_registers(memory_regs, action="decrease")

        def load_tile(mi, nb, expert, step, active, shared):
          del active  # a dummy tile loads like any other
          @pl.loop(0, k_iters)
          def _k(ki):
            s = step + ki
            slot = lax.rem(s, stages)

            @pl.when(s >= stages)
            def _():
              plgpu.barrier_wait(empty.at[slot])

            k_slice = pl.ds(ki * tk, tk)
            if gather_impl == "cp_async":
              gather.cp_async_rows(lhs_ref.at[:, k_slice], row_token_ref.at[pl.ds(mi * tm, tm)],
                                   a_raw.at[slot], a_ready.at[slot], source_row_stride=k)
            elif gather_impl == "interpreted":
              a_tiles[slot] = gather.interpreted_rows(lhs_ref.at[:, k_slice],
                                                     row_token_ref.at[pl.ds(mi * tm, tm)])
              plgpu.barrier_arrive(full.at[slot])
            else:
              plgpu.copy_gmem_to_smem(lhs_ref.at[pl.ds(mi * tm, tm), k_slice],
                                      a_tiles.at[slot], full.at[slot])
            for j in range(role.num_rhs_blocks):
              src, dst = role.rhs_copy(rhs_ref, expert, k_slice, nb, j), b_smem.at[slot, j]
              if cluster == 1:
                plgpu.copy_gmem_to_smem(src, dst, full.at[slot])
              else:  # either way this CTA's full[slot] expects the whole block
                pl.when(shared)(lambda: plgpu.copy_gmem_to_smem(
                    src, dst, full.at[slot], collective_axes="cluster"))
                pl.when(~shared)(lambda: plgpu.copy_gmem_to_smem(src, dst, full.at[slot]))

        drain_ring(empty, walk_tiles(load_tile), stages)

      @pl.when(wg < _NUM_COMPUTE_WGS)
      def _compute_wg():
        plgpu.set_max_registers(compute_regs, action="increase")
        if decoupled:  # warpgroup 0's first tile needs no other mainloop to have gone first
          pl.when(wg == 1)(lambda: plgpu.barrier_arrive(order.at[0]))

        def compute_tile(mi, nb, expert, step, active, shared):
          del shared
          rows = config.rows_per_warpgroup
          first_row = 0 if pingpong else wg * rows  # of this warpgroup's rows in the tile
          blocks = role.num_rhs_blocks
          ctx = EpilogueContext(
              row0=mi * tm + first_row, rows=rows, expert=expert, column_block=nb,
              inputs=inputs, outputs=outputs,
              scratch=_at_warpgroup(epi_scratch, role.epilogue_scratch, wg),
              prefetched=None if prefetch_bar is None else prefetch_bar.at[wg])

          def acc_scope(*acc_refs):
            if decoupled:  # the other warpgroup's mainloop waited for all its stages
              plgpu.barrier_wait(order.at[wg])

            def issue(slot, ki):
              del ki
              a_half = a_tiles.at[slot, pl.ds(first_row, rows)]
              for j in range(blocks):
                b_block = b_smem.at[slot, j]
                if role.rhs_transposed:
                  b_block = b_block.transpose((1, 0))
                plgpu.wgmma(acc_refs[j], a_half, b_block)
              return blocks

            def prefetch(ki):
              # While the first wgmmas run: the previous tile's stores must have read the
              # scratch before the prefetch overwrites it.
              # (Not for a dummy tile: its epilogue, which waits on the prefetch, is skipped.)
              @pl.when((ki == 0) & active)
              def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                role.epilogue_prefetch(ctx, ctx.prefetched)

            consume_stages(
                full, empty, a_ready if gather_impl == "cp_async" else None, step, k_iters,
                stages, issue, after_issue=None if role.epilogue_prefetch is None else prefetch,
                before_drain=(lambda: plgpu.barrier_arrive(order.at[1 - wg])) if decoupled
                else None)
            return [r[...] for r in acc_refs]

          def run_tile():
            accs = pl.run_scoped(acc_scope, *[plgpu.ACC((rows, role.block_n), jnp.float32)
                                              for _ in range(blocks)])
            if cluster == 1:
              role.epilogue(accs, ctx)
            else:
              pl.when(active)(lambda: role.epilogue(accs, ctx))

          if not pingpong:
            run_tile()
            return
          # Pingpong: the CTA's tiles alternate between the warpgroups (step // k_iters counts
          # its tiles). Decoupled (each tile uses every ring slot an even number of times): the
          # owner alone waits for and releases a tile's stages; the other warpgroup skips them,
          # and the parity it tracks per barrier (one flip per wait) is still right when its next
          # tile comes, since the barrier completed an even number of phases meanwhile. A parity
          # wait cannot tell phase p from p + 2, so a warpgroup starts a mainloop only once the
          # other's previous one waited for all its stages (`order`). Else the
          # other warpgroup waits for and releases them too (coupled: a warpgroup's epilogue runs
          # under at most `stages` k-steps of the other's mainloop).
          mine = lax.rem(step // k_iters, _NUM_COMPUTE_WGS) == wg
          pl.when(mine)(run_tile)
          if decoupled:
            return

          @pl.when(~mine)
          def _pass():
            @pl.loop(0, k_iters)
            def _k(ki):
              slot = lax.rem(step + ki, stages)
              plgpu.barrier_wait(full.at[slot])
              plgpu.barrier_arrive(empty.at[slot])

        walk_tiles(compute_tile)
        plgpu.wait_smem_to_gmem(0)

    # Arrivals on full[s]: the B copies, plus the A copy (TMA) or the interpreter's gathered store;
    # the cp.async gather signals its own per-stage barriers instead (`gather.stage_barriers`).
    a_copies = {"cp_async": 0, "interpreted": 1, "tma": 1}[gather_impl]
    copies_per_stage = a_copies + role.num_rhs_blocks
    a_union = plgpu.RefUnion(
        plgpu.SMEM((stages, tm, tk), dtype, transforms=tiled(dtype)),
        plgpu.SMEM((stages, tm, tk), dtype),  # raw bytes, for the cp.async gather's addressing
    )
    b_block = (role.block_n, tk) if role.rhs_transposed else (tk, role.block_n)
    b_smem = plgpu.SMEM((stages, role.num_rhs_blocks) + b_block, dtype, transforms=tiled(dtype))
    epi = _per_warpgroup(role.epilogue_scratch)
    pl.run_scoped(
        scoped, a_union, b_smem,
        plgpu.Barrier(num_arrivals=copies_per_stage, num_barriers=stages),
        stage_release_barriers(cluster, stages, 1 if decoupled else _NUM_COMPUTE_WGS),
        epi, gather.stage_barriers(stages) if gather_impl == "cp_async" else None,
        (plgpu.Barrier(num_arrivals=role.prefetch_copies, num_barriers=_NUM_COMPUTE_WGS)
         if role.epilogue_prefetch is not None else None),
        plgpu.Barrier(num_arrivals=1, num_barriers=_NUM_COMPUTE_WGS) if decoupled else None,
        collective_axes="wg")

  out_types = tuple(role.out_types)
  if row_token is None:
    row_token = jnp.zeros((1,), jnp.int32)
  kernel = plgpu.kernel(
      body,
      out_type=out_types,
      **persistent_launch(cluster),
      kernel_name=role.name,
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=True,
          # Pallas reserves 2 KiB of SMEM for any reduction by default; the epilogues reduce
          # only along the rows of a WGMMA fragment (shuffles within a warp, no SMEM).
          reduction_scratch_bytes=0),
  )
  return kernel(tile_expert, num_tiles.reshape(1), row_token, lhs, rhs, *extra_inputs)

