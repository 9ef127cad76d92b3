"""Grouped-layout placement: the layout's arrays from the sorted routing keys in two small passes.

After the pairs are sorted by expert (`sonic_jax.layout`: one int32 key per pair, expert id above
pair index), the rest of the layout -- per-expert counts, padded group sizes and their offsets, the
row -> pair, row -> token and pair -> row maps, the tile -> expert map -- took XLA a dozen small
kernels on a GPU (about 45 us of kernels plus their launch gaps at T*K = 327680). Here two Pallas
(Triton) kernels write all of it:
- a histogram of the expert ids (each program adds its block of ids into E + 1 counters with
  atomics; integer adds, so the result does not depend on their order; interpreted, a one-hot sum,
  as the interpreter's vector atomics drop repeated addresses);
- the placement: every program prefix-sums the counts (E lanes, in registers: the sorted position
  and the padded row where each expert starts) and takes `tiles_per_program` row tiles. A tile
  belongs to one expert, so its rows read their pairs from one run of the sorted keys; a row with a
  pair also writes that pair's row (a scatter with distinct addresses); sorted positions past the
  last expert (pairs routed nowhere) get row R. Program 0 writes the per-expert vectors.

Same result as the XLA path of `sonic_jax.layout.build_grouped_layout`, its reference. Uses
Pallas's Triton lowering (deprecated in jax 0.11, present in 0.11.2); `AVAILABLE` is False where it
is gone.
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

MAX_EXPERTS = 1023  # E + 1 counters in a power-of-two vector of at most 1024 lanes


def _next_pow2(v: int) -> int:
  return 1 << max(0, (v - 1).bit_length())


def tiles_per_program(num_tiles: int) -> int:
  for m in (8, 4, 2, 1):
    if num_tiles % m == 0:
      return m
  return 1


HISTOGRAM_BLOCK = 2048  # ids per histogram program


def _histogram_kernel(ids_ref, zeros_ref, counts_ref, *, num_ids, interpret):
  del zeros_ref  # aliased to counts_ref: the counters start at zero
  i = pl.program_id(0) * HISTOGRAM_BLOCK + lax.broadcasted_iota(jnp.int32, (HISTOGRAM_BLOCK,), 0)
  in_range = i < num_ids
  ids = pltriton.load(ids_ref.at[jnp.minimum(i, num_ids - 1)], mask=in_range, other=0)
  if interpret:  # the interpreter's vector atomics do not add repeated addresses; it runs the
    # programs one after another, so a plain read-modify-write of a one-hot sum is exact
    lanes = lax.broadcasted_iota(jnp.int32, (1, counts_ref.shape[0]), 1)
    counts_ref[...] += jnp.sum(((ids[:, None] == lanes) & in_range[:, None]).astype(jnp.int32),
                               axis=0)
  else:  # lanes past the ids add 0
    pltriton.atomic_add(counts_ref, ids, in_range.astype(jnp.int32))


def _placement_kernel(keys_ref, counts_ref, row_pair_ref, row_token_ref, row_expert_ref,
                      tile_expert_ref, pair_row_ref, counts_out_ref, group_sizes_ref,
                      num_tiles_ref, *, num_pairs, num_experts, index_bits, slots, row_tile,
                      num_rows, tiles):
  e, p = num_experts, num_pairs
  lanes = counts_ref.shape[0]
  expert = lax.broadcasted_iota(jnp.int32, (lanes,), 0)
  all_counts = counts_ref[...]  # lane E: pairs routed nowhere; lanes past E: 0
  starts = jnp.cumsum(all_counts) - all_counts  # sorted position where each expert's run starts
  in_range = expert < e
  counts = jnp.where(in_range, all_counts, 0)
  group = (counts + row_tile - 1) // row_tile * row_tile
  row_end = jnp.cumsum(group)  # after expert j's padded group
  row_start = row_end - group
  used_rows = jnp.sum(group)
  routed = jnp.sum(counts)  # sorted positions >= this: no expert

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
  pltriton.store(counts_out_ref.at[expert], counts, mask=first)
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
def place_rows(ids, sorted_keys, *, num_experts: int, index_bits: int, slots: int, row_tile: int,
               num_rows: int, interpret: bool = False):
  """The grouped layout's arrays from the (P,) expert ids (E for 'no expert') and their sorted
  keys (id << index_bits | pair index): (row_pair, row_token, row_expert, tile_expert, pair_row,
  counts, group_sizes, num_tiles), as `sonic_jax.layout.build_grouped_layout` defines them
  (pair_row flat)."""
  (p,) = sorted_keys.shape
  reason = supports(p, num_experts, num_rows, row_tile, index_bits)
  if reason is not None:
    raise ValueError(f"layout placement kernel: {reason}")
  num_tiles = num_rows // row_tile
  tiles = tiles_per_program(num_tiles)
  lanes = _next_pow2(num_experts + 1)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  params = pltriton.CompilerParams(num_warps=4, num_stages=1)
  counts = pl.pallas_call(
      functools.partial(_histogram_kernel, num_ids=p, interpret=interpret),
      out_shape=i32(lanes), grid=(pl.cdiv(p, HISTOGRAM_BLOCK),),
      input_output_aliases={1: 0}, compiler_params=params, interpret=interpret,
  )(ids, jnp.zeros((lanes,), jnp.int32))
  (row_pair, row_token, row_expert, tile_expert, pair_row, counts, group_sizes,
   used_tiles) = pl.pallas_call(
      functools.partial(_placement_kernel, num_pairs=p, num_experts=num_experts,
                        index_bits=index_bits, slots=slots, row_tile=row_tile,
                        num_rows=num_rows, tiles=tiles),
      out_shape=(i32(num_rows), i32(num_rows), i32(num_rows), i32(num_tiles), i32(p + num_rows),
                 i32(lanes), i32(lanes), i32(lanes)),
      grid=(num_tiles // tiles,), compiler_params=params, interpret=interpret,
  )(sorted_keys, counts)
  return (row_pair, row_token, row_expert, tile_expert, pair_row[:p], counts[:num_experts],
          group_sizes[:num_experts], used_tiles[0])
