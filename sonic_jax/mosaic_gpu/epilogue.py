"""Small epilogue helpers shared by the GEMM roles: bias broadcast and staged TMA stores."""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax.mosaic_gpu.grouped_gemm import tiled

STORE_COLS = 64  # columns per staged store: one 128-byte swizzled row of 16-bit values
NUM_STAGING = 2


def staging_buffers(rows, dtype):
  """Per-warpgroup SMEM for the epilogue: NUM_STAGING (rows, 64) tiles, double buffered."""
  return plgpu.SMEM((NUM_STAGING, rows, STORE_COLS), dtype, transforms=tiled(dtype))


def column_vector(ref, like):
  """Loads a (cols,) GMEM row (a bias slice) and broadcasts it over the rows of `like`."""
  v = plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False).astype(jnp.float32)
  return lax.broadcast_in_dim(v, like.shape, [1])


def store_tiles(stores, staging):
  """Stores [(value (rows, c), GMEM ref view (rows, c)), ...] through the staging buffers.

  Each value is cut into 64-column pieces; a buffer is reused only after the TMA store that read it
  has finished reading, so stores overlap with the next piece's register-to-SMEM copy.
  """
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores read the buffers
  i = 0
  for value, dst in stores:
    for c in range(0, value.shape[1], STORE_COLS):
      slot = i % NUM_STAGING
      if i >= NUM_STAGING:
        plgpu.wait_smem_to_gmem(NUM_STAGING - 1, wait_read_only=True)
      staging[slot] = value[:, c:c + STORE_COLS]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(staging.at[slot], dst.at[:, c:c + STORE_COLS])
      i += 1
