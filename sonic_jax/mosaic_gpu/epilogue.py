"""Small epilogue helpers shared by the GEMM roles: bias broadcast, staged TMA stores and the
(gate, up) pair words of the interleaved GLU layout."""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax.mosaic_gpu.grouped_gemm import tiled

STORE_COLS = 64  # columns per staged store: one 128-byte swizzled row of 16-bit values
NUM_STAGING = 2


def staging_buffers(rows, dtype, slots=NUM_STAGING):
  """Per-warpgroup SMEM for the epilogue: (rows, 64) tiles, by default double buffered."""
  return plgpu.SMEM((slots, rows, STORE_COLS), dtype, transforms=tiled(dtype))


def half_staging_buffers(rows, dtype):
  """NUM_STAGING (rows, 32) 16-bit tiles (64-byte rows, 64-byte swizzle): the pieces of A that
  one piece of interleaved (gate, up) pairs gives."""
  half = STORE_COLS // 2
  return plgpu.SMEM((NUM_STAGING, rows, half), dtype,
                    transforms=(plgpu.TilingTransform((8, half)), plgpu.SwizzleTransform(64)))


def pair_staging_buffers(rows, dtype, *more):
  """A RefUnion of ((pair staging, *more), words), seen by an epilogue as the flat tuple
  (staging, *more, words): staging is one (rows, 64) 16-bit tile of (gate, up) pairs of the
  interleaved layout, words a uint32 view of its bytes, (rows, 32), one pair a word. With
  128-byte rows the (8, 64) 16-bit and the (8, 32) 32-bit tilings lay each row out on the same
  bytes, and the swizzle is a function of the address. On a GPU the two views alias (the first
  ref of each group of a union starts at its first byte); the interpreter keeps them apart, so a
  role reads the words only when compiled. A union only unpacks as a whole scratch (not inside a
  tuple), hence `more`: the role's other buffers."""
  return plgpu.RefUnion((staging_buffers(rows, dtype, slots=1),) + more,
                        plgpu.SMEM((1, rows, STORE_COLS // 2), jnp.uint32,
                                   transforms=tiled(jnp.uint32)))


def unpack_pairs(words, dtype):
  """uint32 words holding (gate, up) 16-bit pairs (gate in the low half, as the interleaved
  layout's little-endian bytes put it) -> (gate, up) in float32."""
  half = lambda w: lax.bitcast_convert_type(w.astype(jnp.uint16), dtype).astype(jnp.float32)
  return half(words & 0xFFFF), half(lax.shift_right_logical(words, jnp.uint32(16)))


def split_pairs(value):
  """(rows, 2m) interleaved 16-bit value -> (gate, up), each (rows, m) float32, by a value-level
  reshape: what the interpreter runs instead of the word view (Mosaic GPU cannot lower it)."""
  pairs = value.astype(jnp.float32).reshape(value.shape[0], value.shape[1] // 2, 2)
  return pairs[..., 0], pairs[..., 1]


def merge_pairs(gate, up, dtype):
  """Inverse of `split_pairs`: (rows, m) gate and up -> the (rows, 2m) interleaved `dtype` value
  (the interpreter's counterpart of `pack_pairs`)."""
  return jnp.stack([gate, up], axis=-1).reshape(gate.shape[0], 2 * gate.shape[1]).astype(dtype)


def pack_pairs(gate, up, dtype):
  """Inverse of `unpack_pairs`: float32 (gate, up) rounded to `dtype`, one uint32 word a pair."""
  bits = lambda v: lax.bitcast_convert_type(v.astype(dtype), jnp.uint16).astype(jnp.uint32)
  return bits(gate) | lax.shift_left(bits(up), jnp.uint32(16))


def column_vector(ref, like):
  """Loads a (cols,) GMEM row (a bias slice) and broadcasts it over the rows of `like`."""
  v = plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False).astype(jnp.float32)
  return lax.broadcast_in_dim(v, like.shape, [1])


def store_tiles(stores, staging, transposed: bool = False):
  """Stores [(value (rows, c), GMEM ref view (rows, c)), ...] through the staging buffers.

  Each value is cut into 64-column pieces, one staging buffer each in turn; a buffer is reused
  only after the TMA store that read it has finished reading, so stores overlap with the next
  pieces' register-to-SMEM copies. transposed: the views are (c, rows) and take each value
  transposed, 64 rows a value, through the transpose of square (64, 64) staging buffers (each
  piece first converted to the transposed WGMMA register layout: a shuffle within lane pairs).

  When the pieces fill the buffers a whole number of times, every call (tile) uses them in the
  same order, so a piece waits only for the store that read its buffer last, the same piece of
  the previous call: at most `slots - 1` bulk stores of this thread may still be reading (every
  other store committed since is younger). The previous tile's stores then drain under this
  tile's register-to-SMEM copies instead of all being waited for first. Otherwise the call first
  waits until every earlier store has read its buffer.
  """
  if transposed and staging.shape[1:] != (STORE_COLS, STORE_COLS):
    raise ValueError(f"transposed stores take square ({STORE_COLS}, {STORE_COLS}) staging buffers")
  slots = staging.shape[0]
  pieces = sum(pl.cdiv(value.shape[1], STORE_COLS) for value, _ in stores)
  wait_all_first = pieces % slots != 0
  if wait_all_first:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's stores read the buffers
  i = 0
  for value, dst in stores:
    for c in range(0, value.shape[1], STORE_COLS):
      slot = i % slots
      if i >= slots or not wait_all_first:
        plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
      piece = value[:, c:c + STORE_COLS]
      if transposed:
        staging.at[slot].T[...] = plgpu.layout_cast(piece, plgpu.Layout.WGMMA_TRANSPOSED)
      else:
        staging[slot] = piece
      plgpu.commit_smem()
      cols = slice(c, c + STORE_COLS)
      plgpu.copy_smem_to_gmem(staging.at[slot], dst.at[cols, :] if transposed else dst.at[:, cols])
      i += 1
