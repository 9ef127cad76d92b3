"""Peer copies between the GPUs of one host over NVLink, inside Mosaic GPU kernels: candidate
transports for expert-parallel dispatch and combine (the layer does not use them; their rates
against NCCL are BENCHMARKS.md's "NVLink peer copies").

Called inside `jax.shard_map` over `axis` (every device of the host):

- `all_gather`: each of `num_blocks` CTAs owns a band of the local x's rows; for each destination
  (this device, then every peer) it TMA-loads the band tile by tile into a ring of SMEM slots and
  TMA-stores each tile into that destination's output (`plgpu.remote_ref` for a peer, as jax's
  `collective_matmul_mgpu.py` forwards its LHS). Reference: `jax.lax.all_gather(x, axis,
  tiled=True)`.
- `gather_rows`: picked rows of each peer's x read by cp.async straight from the peer's memory
  (the grouped GEMMs' row gather), then TMA-stored locally.

They use point-to-point peer accesses only, not NVLink multicast (`multimem` stores), which needs
multicast support that not every host enables. Cross-device ordering takes two global semaphores
per launch (`pl.get_global`; Pallas zero-initialises them at every launch), counted without
decrement: every CTA signals each peer on entry and waits for all of theirs before any peer
access (each device's x is written and its output allocated), and again after its copies
completed (`wait_smem_to_gmem(0)`), so that no device releases its x while a peer still reads it,
and every peer's rows are in a device's output when its kernel ends.

Both kernels write x under an impossible condition (never at run time), which makes XLA place
the operand where peers can map it, as jax's `all_gather_mgpu.py` does. `gather_rows` needs it
(peers read its x); `all_gather` only stores into its peers' outputs but keeps the same write:
its compiled tests cover only that form.

64 CTAs by default: within 2% of 128, the fastest measured, while rows need only be a multiple of
64 * tile_m = 4096 rather than 8192 (docs/decisions.md).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax.mosaic_gpu import gather
from sonic_jax.mosaic_gpu.grouped_gemm import tiled


def _check_common(x, axis, num_devices, num_blocks, tile_m, tile_n):
  if not (x.ndim == 2 and jnp.issubdtype(x.dtype, jnp.floating)
          and jnp.dtype(x.dtype).itemsize == 2):
    raise ValueError(f"x must be a (rows, d) 16-bit float array, got {x.dtype}{list(x.shape)}")
  for name, v in (("num_blocks", num_blocks), ("tile_m", tile_m), ("tile_n", tile_n)):
    if v < 1:
      raise ValueError(f"{name} must be >= 1, got {v}")
  if x.shape[1] % tile_n:
    raise ValueError(f"d={x.shape[1]} must be a multiple of tile_n={tile_n}")
  if num_devices < 2:
    raise ValueError(f"axis {axis!r} has {num_devices} device; peer copies need at least 2")


def _barrier(sem, *, peers, signals):
  """Signals `sem` on every peer, then waits until this device's `sem` has `signals` arrivals in
  all (one from each CTA of each peer: num_blocks * (P - 1) a round; counted without decrement,
  so a second round on the same semaphore would wait for twice that)."""
  for peer in peers:
    pl.semaphore_signal(sem, device_id=peer)
  pl.semaphore_wait(sem, signals, decrement=False)


def _never_write(x_ref, me):
  """A write under an impossible condition: XLA then places x where the peers can map it."""
  @pl.when(me < 0)
  def _():
    x_ref[(0,) * x_ref.ndim] = jnp.zeros((), x_ref.dtype)


@functools.partial(jax.named_call, name="peer_all_gather")
def all_gather(x: jax.Array, *, axis: str, num_blocks: int = 64,
               tile_m: int = 64, tile_n: int = 256, max_concurrent_steps: int = 4) -> jax.Array:
  """(P * rows, d): every device's x, device i's at rows [i * rows, (i + 1) * rows). Inside a
  shard_map over `axis`, whose size P counts the peers. rows must be a multiple of
  num_blocks * tile_m and d of tile_n; max_concurrent_steps: SMEM slots of (tile_m, tile_n), the
  TMA loads in flight (at least 2: a slot is reloaded once the store from it has read it)."""
  num_devices = lax.axis_size(axis)
  _check_common(x, axis, num_devices, num_blocks, tile_m, tile_n)
  rows, d = x.shape
  if rows % (num_blocks * tile_m):
    raise ValueError(f"rows={rows} must be a multiple of num_blocks * tile_m = "
                     f"{num_blocks} * {tile_m}")
  if max_concurrent_steps < 2:
    raise ValueError(f"max_concurrent_steps must be >= 2, got {max_concurrent_steps}")
  rows_per_block = rows // num_blocks
  tiles_n = d // tile_n
  steps = rows_per_block // tile_m * tiles_n
  stages = min(max_concurrent_steps, steps)

  def copy(src, dst, smem, loaded):
    """src -> dst ((rows_per_block, d) refs, local or remote) by TMA through `stages` SMEM slots:
    each slot is loaded, then stored from; a slot is loaded again once its store has read it, and
    up to `stages` loads are in flight."""
    tile = lambda step: (pl.ds(step // tiles_n * tile_m, tile_m),
                         pl.ds(step % tiles_n * tile_n, tile_n))
    load = lambda step: plgpu.copy_gmem_to_smem(src.at[tile(step)], smem.at[step % stages],
                                                loaded.at[step % stages])
    for step in range(stages):
      load(step)

    @pl.loop(0, steps)
    def _(step):
      slot = step % stages
      plgpu.barrier_wait(loaded.at[slot])
      plgpu.copy_smem_to_gmem(smem.at[slot], dst.at[tile(step)])

      # The previous step's store has read its slot: load that slot's next tile.
      @pl.when((step > 0) & (step - 1 + stages < steps))
      def _():
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        load(step - 1 + stages)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slots are free for the next copy

  def kernel(x_ref, out_ref, smem, loaded):
    ready = pl.get_global(plgpu.SemaphoreType.REGULAR)
    done = pl.get_global(plgpu.SemaphoreType.REGULAR)
    me = lax.axis_index(axis)
    block = lax.axis_index("blocks")
    mine = pl.ds(block * rows_per_block, rows_per_block)
    peers = [lax.rem(me + offset, num_devices) for offset in range(1, num_devices)]
    signals = num_blocks * (num_devices - 1)

    def device_rows(device):
      return pl.ds(device * rows + block * rows_per_block, rows_per_block)

    barrier = functools.partial(_barrier, peers=peers, signals=signals)

    # Every device is inside the kernel (its x written, its output allocated) before any peer
    # access.
    barrier(ready)
    copy(x_ref.at[mine], out_ref.at[device_rows(me)], smem, loaded)
    for peer in peers:
      copy(x_ref.at[mine], plgpu.remote_ref(out_ref, peer).at[device_rows(me)], smem, loaded)
    plgpu.wait_smem_to_gmem(0)
    barrier(done)  # every peer's rows are in this device's output

    _never_write(x_ref, me)

  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((num_devices * rows, d), x.dtype),
      scratch_types=[plgpu.SMEM((stages, tile_m, tile_n), x.dtype),
                     plgpu.Barrier(num_barriers=stages)],
      grid=(num_blocks,),
      grid_names=("blocks",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(x)


@functools.partial(jax.named_call, name="peer_gather_rows")
def gather_rows(x: jax.Array, rows: jax.Array, *, axis: str, num_blocks: int = 64,
                tile_m: int = 64, tile_n: int = 256, stages: int = 2) -> jax.Array:
  """(P, R, d): out[p, r] = device p's x[rows[p, r]], the rows read by cp.async straight from
  each peer's memory (the grouped GEMMs' row gather, `gather.cp_async_rows`, through a peer
  reference) into a ring of `stages` 128-byte-swizzled SMEM stages, each then TMA-stored; the
  gathers of the next stages - 1 tiles are in flight while one is stored (stages >= 2).
  Inside a shard_map over `axis`; rows: (P, R) int32 on
  every device, each in [0, T) (not checked: an index outside reads another buffer). The
  P * (R / tile_m) * (d / tile_n) tiles are dealt to the CTAs in turn, so their number must be a
  multiple of num_blocks."""
  num_devices = lax.axis_size(axis)
  _check_common(x, axis, num_devices, num_blocks, tile_m, tile_n)
  if rows.shape[:1] != (num_devices,) or rows.ndim != 2 or rows.dtype != jnp.int32:
    raise ValueError(f"rows must be ({num_devices}, R) int32, got {rows.dtype}{list(rows.shape)}")
  # cp_async_rows: 128-byte (64-element) column spans, 8-row swizzle groups, whole passes of a
  # warpgroup's 128 threads copying 16 bytes each.
  if tile_n % 64 or tile_m % 8 or (tile_m * tile_n // 8) % 128:
    raise ValueError(f"tile_n={tile_n} must be a multiple of 64, tile_m={tile_m} of 8, and "
                     f"tile_m * tile_n / 8 of 128")
  d = x.shape[1]
  r = rows.shape[1]
  if r % tile_m:
    raise ValueError(f"R={r} must be a multiple of tile_m={tile_m}")
  if stages < 2:
    raise ValueError(f"stages must be >= 2, got {stages}")
  tiles_m, tiles_n = r // tile_m, d // tile_n
  total = num_devices * tiles_m * tiles_n
  if total % num_blocks:
    raise ValueError(f"the P * (R / tile_m) * (d / tile_n) = {total} tiles must split evenly over "
                     f"num_blocks={num_blocks}")
  steps = total // num_blocks

  def kernel(x_ref, rows_ref, out_ref, stage, ready):
    sem_ready = pl.get_global(plgpu.SemaphoreType.REGULAR)
    sem_done = pl.get_global(plgpu.SemaphoreType.REGULAR)
    me = lax.axis_index(axis)
    block = lax.axis_index("blocks")
    peers = [lax.rem(me + offset, num_devices) for offset in range(1, num_devices)]
    barrier = functools.partial(_barrier, peers=peers, signals=num_blocks * (num_devices - 1))
    tiles, raw = stage
    gather.init_stage_barriers(ready)

    def where(step):
      t = block + step * num_blocks
      device, rest = t // (tiles_m * tiles_n), t % (tiles_m * tiles_n)
      return (device, pl.ds(rest // tiles_n * tile_m, tile_m),
              pl.ds(rest % tiles_n * tile_n, tile_n))

    def issue(step):
      device, m, cols = where(step)
      copy = lambda src: gather.cp_async_rows(src.at[:, cols], rows_ref.at[device, m],
                                              raw.at[step % stages], ready.at[step % stages],
                                              source_row_stride=d)
      pl.when(device == me)(lambda: copy(x_ref))
      pl.when(device != me)(lambda: copy(plgpu.remote_ref(x_ref, device)))

    barrier(sem_ready)
    for step in range(min(stages - 1, steps)):
      issue(step)

    @pl.loop(0, steps)
    def _(step):
      # The stage for step + stages - 1 is the one step - 1 stored from: once that store has read
      # it (the latest pending store), its gather is issued.
      @pl.when(step + stages - 1 < steps)
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        issue(step + stages - 1)

      gather.wait_stage(ready.at[step % stages], lax.rem(step // stages, 2))
      device, m, cols = where(step)
      plgpu.copy_smem_to_gmem(tiles.at[step % stages], out_ref.at[device, m, cols])

    plgpu.wait_smem_to_gmem(0)
    barrier(sem_done)  # no device releases its x while a peer still reads it
    _never_write(x_ref, me)

  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((num_devices, r, d), x.dtype),
      scratch_types=[plgpu.RefUnion(
                         plgpu.SMEM((stages, tile_m, tile_n), x.dtype, transforms=tiled(x.dtype)),
                         plgpu.SMEM((stages, tile_m, tile_n), x.dtype)),  # raw, for cp.async
                     gather.stage_barriers(stages)],
      grid=(num_blocks,),
      grid_names=("blocks",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(x, rows)
