"""Grouped-layout placement: every array of the layout from the sorted routing keys, in one pass.

After the pairs are sorted by expert (`sonic_jax.layout`: one int32 key per pair, expert id above
pair index), the rest of the layout -- per-expert counts, padded group sizes and their offsets, the
row -> pair, row -> token and pair -> row maps, the tile -> expert map -- took XLA a dozen small
kernels on a GPU (about 45 us of kernels and as many launch gaps at T*K = 327680; BENCHMARKS.md).
Here one Pallas (Triton) kernel writes all of it. Each program takes `tiles_per_program` row tiles:
it finds every expert's first and last sorted position by a vectorised binary search over the
sorted keys (every program repeats it: E lanes, log2(P) steps, L2-resident), rounds the counts up
to the row tile and prefix-sums them; a tile belongs to one expert, so its rows read their pairs
from one contiguous run of the sorted keys. Each row with a pair also writes that pair's row (a
scatter with distinct addresses); sorted positions past the last expert (pairs routed nowhere)
get row R. Program 0 writes the per-expert vectors.

Same result as the XLA path of `sonic_jax.layout.build_grouped_layout`, which is its reference.
Uses Pallas's Triton lowering (deprecated in jax 0.11, present in 0.11.2); `AVAILABLE` is False
where it is gone.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # Pallas's Triton lowering is deprecated in jax 0.11; without it the layout uses XLA.
  from jax.experimental.pallas import triton as pltriton
  AVAILABLE = True
except ImportError:  # pragma: no cover
  pltriton = None
  AVAILABLE = False

MAX_EXPERTS = 1023  # E + 1 search lanes in a power-of-two vector of at most 1024


def _next_pow2(v: int) -> int:
  return 1 << max(0, (v - 1).bit_length())


def tiles_per_program(num_tiles: int) -> int:
  for m in (8, 4, 2, 1):
    if num_tiles % m == 0:
      return m
  return 1


def _kernel(keys_ref, row_pair_ref, row_token_ref, row_expert_ref, tile_expert_ref, pair_row_ref,
            counts_ref, group_sizes_ref, num_tiles_ref, *, num_pairs, num_experts, index_bits,
            slots, row_tile, num_rows, tiles):
  e, p = num_experts, num_pairs
  lanes = _next_pow2(e + 1)
  expert = lax.broadcasted_iota(jnp.int32, (lanes,), 0)

  def lower_bound(target):
    """First sorted position whose expert id is >= target (per lane); P if none."""
    lo = jnp.zeros((lanes,), jnp.int32)
    hi = jnp.full((lanes,), p, jnp.int32)
    for _ in range(max(1, p.bit_length())):
      active = lo < hi
      mid = (lo + hi) // 2
      ids = pltriton.load(keys_ref.at[jnp.minimum(mid, p - 1)]) >> index_bits
      below = ids < target
      lo = jnp.where(active & below, mid + 1, lo)
      hi = jnp.where(active & ~below, mid, hi)
    return lo

  starts = lower_bound(expert)  # lane j: where expert j's run starts (lane E: 'no expert')
  in_range = expert < e
  counts = jnp.where(in_range, lower_bound(expert + 1) - starts, 0)
  group = (counts + row_tile - 1) // row_tile * row_tile
  row_end = jnp.cumsum(group)  # after expert j's padded group
  row_start = row_end - group
  used_rows = jnp.sum(group)
  routed = jnp.sum(jnp.where(expert == e, starts, 0))  # sorted positions >= this: no expert

  # This program's tiles: each belongs to the expert whose padded group holds its first row.
  pid = pl.program_id(0)
  tile = pid * tiles + lax.broadcasted_iota(jnp.int32, (tiles,), 0)
  first_row = tile * row_tile
  tile_e = jnp.sum(jnp.where(in_range[None, :] & (row_end[None, :] <= first_row[:, None]), 1, 0),
                   axis=1)  # E past the rows in use
  pick = lambda v: jnp.sum(jnp.where(expert[None, :] == tile_e[:, None], v[None, :], 0), axis=1)
  t_row_start, t_start, t_count = pick(row_start), pick(starts), pick(counts)

  rows = first_row[:, None] + lax.broadcasted_iota(jnp.int32, (tiles, row_tile), 1)
  offset = rows - t_row_start[:, None]
  valid = (tile_e[:, None] < e) & (offset < t_count[:, None])
  position = jnp.where(valid, t_start[:, None] + offset, 0)
  pair = pltriton.load(keys_ref.at[position], mask=valid, other=0) & ((1 << index_bits) - 1)
  pltriton.store(row_pair_ref.at[rows], jnp.where(valid, pair, -1))
  pltriton.store(row_token_ref.at[rows], jnp.where(valid, pair // slots, 0))
  pltriton.store(row_expert_ref.at[rows], jnp.broadcast_to(tile_e[:, None], (tiles, row_tile)))
  pltriton.store(tile_expert_ref.at[tile], tile_e)
  # pair_row has R spare entries after its P: a row without a pair writes its own spare entry
  # instead of being masked (a masked scatter with repeated addresses is not a no-op in the
  # interpreter), so every store below has distinct addresses.
  pltriton.store(pair_row_ref.at[jnp.where(valid, pair, p + rows)], rows)

  # Pairs routed nowhere: the sorted positions of this program's span (R >= P) from `routed` on.
  nowhere = (rows >= routed) & (rows < p)
  key = pltriton.load(keys_ref.at[jnp.where(nowhere, rows, 0)], mask=nowhere, other=0)
  pltriton.store(pair_row_ref.at[jnp.where(nowhere, key & ((1 << index_bits) - 1), p + rows)],
                 jnp.where(nowhere, num_rows, rows))

  first = jnp.broadcast_to(pid == 0, (lanes,))  # the per-expert vectors: program 0, all lanes
  pltriton.store(counts_ref.at[expert], counts, mask=first)
  pltriton.store(group_sizes_ref.at[expert], group, mask=first)
  pltriton.store(num_tiles_ref.at[expert], jnp.broadcast_to(used_rows // row_tile, (lanes,)),
                 mask=first)


def supports(num_pairs: int, num_experts: int, num_rows: int, row_tile: int,
             index_bits: int) -> str | None:
  """None when the kernel builds this layout, else the reason it does not."""
  if not AVAILABLE:
    return "Pallas's Triton lowering is not available"
  if not 1 <= num_experts <= MAX_EXPERTS:
    return f"E={num_experts} is not in [1, {MAX_EXPERTS}]"
  if row_tile & (row_tile - 1) or row_tile < 16:
    return f"row_tile={row_tile} is not a power of two >= 16"
  if num_rows < num_pairs:
    return f"R={num_rows} < P={num_pairs}"
  return None


@functools.partial(jax.jit, static_argnames=("num_experts", "index_bits", "slots", "row_tile",
                                             "num_rows", "interpret"))
def place_rows(sorted_keys, *, num_experts: int, index_bits: int, slots: int, row_tile: int,
               num_rows: int, interpret: bool = False):
  """The grouped layout's arrays from the sorted keys (expert id << index_bits | pair index):
  (row_pair, row_token, row_expert, tile_expert, pair_row, counts, group_sizes, num_tiles), as
  `sonic_jax.layout.build_grouped_layout` defines them (pair_row flat)."""
  (p,) = sorted_keys.shape
  reason = supports(p, num_experts, num_rows, row_tile, index_bits)
  if reason is not None:
    raise ValueError(f"layout placement kernel: {reason}")
  num_tiles = num_rows // row_tile
  tiles = tiles_per_program(num_tiles)
  lanes = _next_pow2(num_experts + 1)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  (row_pair, row_token, row_expert, tile_expert, pair_row, counts, group_sizes,
   used_tiles) = pl.pallas_call(
      functools.partial(_kernel, num_pairs=p, num_experts=num_experts, index_bits=index_bits,
                        slots=slots, row_tile=row_tile, num_rows=num_rows, tiles=tiles),
      out_shape=(i32(num_rows), i32(num_rows), i32(num_rows), i32(num_tiles), i32(p + num_rows),
                 i32(lanes), i32(lanes), i32(lanes)),
      grid=(num_tiles // tiles,),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
  )(sorted_keys)
  return (row_pair, row_token, row_expert, tile_expert, pair_row[:p], counts[:num_experts],
          group_sizes[:num_experts], used_tiles[0])
