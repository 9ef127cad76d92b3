"""All-gather of row blocks between the GPUs of one host by TMA over NVLink, inside a Mosaic GPU
kernel: the transport that expert-parallel dispatch and combine kernels build on.

Called inside `jax.shard_map` over `axis` (every device of the host). Each of `num_blocks` CTAs
copies its share of the rows tile by tile through a pipelined SMEM stage, either

- "pull": TMA loads from each peer's x (`plgpu.remote_ref`) into SMEM, then TMA stores into the
  local output's slice for that peer; or
- "push": TMA loads of the local x, then TMA stores into each peer's output (remote stores, as
  jax's `collective_matmul_mgpu.py` forwards its LHS).

No NVLink multicast (`multimem` stores): the kernels use point-to-point peer accesses only.
Cross-device ordering takes two global semaphores per launch (`pl.get_global`), counted without
decrement: every CTA signals each peer on entry and waits for all of theirs before any peer
access (each device's x is written and its output allocated), and again after its copies
completed (`wait_smem_to_gmem(0)`), so that no device releases its x while a peer still reads it
(pull), and every peer's rows are in a device's output when its kernel ends (push).

x is both read remotely and (never, at run time) written by the kernel: the write under an
impossible condition makes XLA place the operand where peers can map it, as jax's
`all_gather_mgpu.py` does. Reference: `jax.lax.all_gather(x, axis, tiled=True)`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

MODES = ("pull", "push")


def _check(x, num_devices, num_blocks, tile_m, tile_n, mode):
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if x.ndim != 2:
    raise ValueError(f"x must be (rows, d), got shape {x.shape}")
  rows, d = x.shape
  if jnp.dtype(x.dtype).itemsize != 2:
    raise ValueError(f"x must be a 16-bit float, got {x.dtype}")
  if rows % (num_blocks * tile_m):
    raise ValueError(f"rows={rows} must be a multiple of num_blocks * tile_m = "
                     f"{num_blocks} * {tile_m}")
  if d % tile_n:
    raise ValueError(f"d={d} must be a multiple of tile_n={tile_n}")
  if num_devices < 2:
    raise ValueError(f"the axis has {num_devices} device; peer copies need at least 2")


@functools.partial(jax.named_call, name="peer_all_gather")
def all_gather(x: jax.Array, *, axis: str, mode: str = "pull", num_blocks: int = 16,
               tile_m: int = 64, tile_n: int = 256, max_concurrent_steps: int = 4) -> jax.Array:
  """(P * rows, d): every device's x, device i's at rows [i * rows, (i + 1) * rows). Inside a
  shard_map over `axis`, whose size P counts the peers."""
  num_devices = lax.axis_size(axis)
  _check(x, num_devices, num_blocks, tile_m, tile_n, mode)
  rows, d = x.shape
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
    signals = num_blocks * (num_devices - 1)  # one from each CTA of each peer

    def device_rows(device):
      return pl.ds(device * rows + block * rows_per_block, rows_per_block)

    def barrier(sem):
      for peer in peers:
        pl.semaphore_signal(sem, device_id=peer)
      pl.semaphore_wait(sem, signals, decrement=False)

    # Every device is inside the kernel (its x written, its output allocated) before any peer
    # access.
    barrier(ready)
    copy(x_ref.at[mine], out_ref.at[device_rows(me)], smem, loaded)
    if mode == "pull":
      for peer in peers:
        copy(plgpu.remote_ref(x_ref, peer).at[mine], out_ref.at[device_rows(peer)], smem,
             loaded)
    else:
      for peer in peers:
        copy(x_ref.at[mine], plgpu.remote_ref(out_ref, peer).at[device_rows(me)], smem,
             loaded)
    plgpu.wait_smem_to_gmem(0)
    # Pull: no device leaves (releasing its x) while a peer still reads it. Push: every peer's
    # rows are in this device's output.
    barrier(done)

    @pl.when(me < 0)  # never: makes XLA place x where the peers can map it
    def _():
      x_ref[0, 0] = jnp.zeros((), x_ref.dtype)

  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((num_devices * rows, d), x.dtype),
      scratch_types=[plgpu.SMEM((stages, tile_m, tile_n), x.dtype),
                     plgpu.Barrier(num_barriers=stages)],
      grid=(num_blocks,),
      grid_names=("blocks",),
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(x)
