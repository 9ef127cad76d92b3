"""Routing metadata: the tile-aligned grouped layout shared by every backend and kernel.

The P = T*S (token, slot) pairs, plus X optional *extra* pairs given as (token, expert) lists (token
rounding adds them: an expert may take more tokens than the slots hold), are grouped by expert (a
stable sort of the expert ids, so slot pairs keep token order inside an expert, extras follow).
Expert e's rows start at a multiple of `row_tile` and are padded up to the next multiple, so every
`row_tile` rows of the grouped buffer belong to exactly one expert: a grouped GEMM tile never
straddles two experts and needs no masking. Padding rows carry the token of their expert's
first row (a valid gather index, 0 past the rows in use) and are marked invalid; they contribute
nothing to outputs or gradients. (The Mosaic GPU weight-gradient kernels multiply the padding rows
of an expert's last reduction step by zeros rather than masking them: a non-finite value in a
token's row then reaches, as NaN, only the gradients of experts it is routed to, which its own
rows reach anyway.)

Shapes are static: the buffer has R = round_up(P + min(E, P) * (row_tile - 1), row_tile) rows, the
worst case over all routings, and the number of rows in use is carried as data, so there is no host
synchronisation and no recompilation when the routing changes.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sonic_jax.batching import unsplit
from sonic_jax.config import Config, check_config
from sonic_jax.pallas import layout_ranks, next_pow2

Array = jax.Array


def int32_ids(ids, bound: int, fill: int) -> Array:
  """Integer ids as int32, those outside [0, bound) set to `fill` first where the dtype is wider
  than int32, so that an out-of-range int64 id cannot wrap onto a real one (host arrays are
  checked before JAX narrows them)."""
  xp = jnp if isinstance(ids, jax.Array) else np
  ids = xp.asarray(ids)
  if ids.dtype.itemsize >= 4 and ids.dtype != np.int32:
    ids = xp.where((ids >= 0) & (ids < bound), ids, fill)
  return jnp.asarray(ids).astype(jnp.int32)


def _round_up(a, b):
  return (a + b - 1) // b * b


def grouped_rows(num_pairs: int, num_experts: int, row_tile: int) -> int:
  """Static row count R of the grouped buffer (worst case over routings)."""
  return _round_up(num_pairs + min(num_experts, num_pairs) * (row_tile - 1), row_tile)


class GroupedLayout(NamedTuple):
  """Where every (token, slot) pair sits in the expert-grouped buffer.

  Row-indexed arrays have R entries, R = round_up(N + min(E, N) * (row_tile - 1), row_tile) for N
  = T * S + X pairs (`sonic_jax.layout.grouped_rows`, the worst case over routings); pair-indexed
  arrays have the routing's (T, S) shape; tile-indexed arrays R // row_tile entries.

  Attributes:
    row_token: (R,) int32, the token whose x row feeds this grouped row (a padding row: the token
      of its expert's first row; 0 past the rows in use).
    row_pair: (R,) int32, the flat pair index t * S + s of this row (T * S + x for extra pair x),
      -1 for padding.
    row_expert: (R,) int32, the expert of this row's tile (E for tiles past the used rows).
    pair_row: (T, S) int32, the grouped row of each pair, R for pairs routed nowhere.
    group_sizes: (E,) int32, rows per expert including padding (multiples of row_tile).
    expert_counts: (E,) int32, real pairs per expert.
    tile_expert: (R // row_tile,) int32, the expert of each tile, E past the used tiles.
    num_tiles: () int32, tiles in use, sum(group_sizes) // row_tile.
    extra_row: (X,) int32, the grouped row of each extra pair, R for unused entries.
    extra_token: (X,) int32, the token of each extra pair, T for unused entries.
  """

  row_token: Array
  row_pair: Array
  row_expert: Array
  pair_row: Array
  group_sizes: Array
  expert_counts: Array
  tile_expert: Array
  num_tiles: Array
  extra_row: Array
  extra_token: Array

  @property
  def num_rows(self) -> int:
    return self.row_token.shape[0]

  @property
  def num_experts(self) -> int:
    return self.group_sizes.shape[0]

  @property
  def row_tile(self) -> int:
    return self.num_rows // self.tile_expert.shape[0]

  def row_valid(self) -> Array:
    """(R,) bool: the row holds a real (token, expert) pair."""
    return self.row_pair >= 0

  def pair_valid(self) -> Array:
    """(T, S) bool: the pair was routed to an expert."""
    return self.pair_row < self.num_rows

  @property
  def num_extra(self) -> int:
    return self.extra_row.shape[0]

  def extra_valid(self) -> Array:
    """(X,) bool: the extra pair is in use."""
    return self.extra_row < self.num_rows


def stable_sort_ids(flat: Array, bound: int) -> tuple[Array, Array]:
  """(order, sorted values) of the stable sort of integers in [0, bound].

  A (key, index) sort on the narrowest unsigned key that holds `bound`: XLA sorts these on the GPU
  with a radix sort over the key's bits, so uint8 ids (bound < 256) take one 8-bit pass where a
  packed int32 key (`id << b | pair`) takes four, and `jnp.argsort`'s int32 keys a comparison sort.
  """
  key_dtype = jnp.uint8 if bound < 256 else jnp.uint16 if bound < 65536 else jnp.int32
  index = jax.lax.iota(jnp.int32, flat.shape[0])
  sorted_ids, order = jax.lax.sort((flat.astype(key_dtype), index), num_keys=1, is_stable=True)
  return order, sorted_ids.astype(jnp.int32)


LAYOUT_METHODS = ("auto", "sort", "block_ranks")


def _block_ranks_unsupported(expert_ids: Array, num_experts: int, num_extra: int = 0,
                            extras_by_expert: bool = False) -> str | None:
  """None when `build_grouped_layout(method="block_ranks")` handles this routing, else why not."""
  if num_extra and not extras_by_expert:
    return "the block-rank method places extra pairs only when they come grouped by expert"
  if not layout_ranks.AVAILABLE:
    return "Pallas's Triton lowering is not available"
  return layout_ranks.supports(expert_ids, num_experts)


def _use_block_ranks(method: str, expert_ids: Array, num_experts: int, num_extra: int,
                     extras_by_expert: bool, max_experts: int) -> bool:
  if method not in LAYOUT_METHODS:
    raise ValueError(f"method must be one of {LAYOUT_METHODS}, got {method!r}")
  if method == "sort":
    return False
  reason = _block_ranks_unsupported(expert_ids, num_experts, num_extra, extras_by_expert)
  if method == "block_ranks":
    if reason is not None:
      raise ValueError(f"build_grouped_layout(method='block_ranks'): {reason}")
    return True
  # The kernel's work per pair grows with E, the sort's does not.
  return (reason is None and jax.default_backend() == "gpu"
          and next_pow2(num_experts) <= max_experts)


def _expert_row_starts(counts: Array, row_tile: int) -> Array:
  """First grouped row of each expert: its pairs padded to whole tiles, experts in order."""
  group_sizes = _round_up(counts, row_tile)
  return jnp.cumsum(group_sizes) - group_sizes


def _rows_by_sort(flat: Array, e_count: int, row_tile: int, rows: int):
  """(pair_row (P,), row_pair (R,), counts (E,)) from a stable sort of the expert ids (E: none)."""
  num_pairs = flat.shape[0]
  order, sorted_expert = stable_sort_ids(flat, e_count)

  # Per-expert counts from the sorted ids, not a scatter-add histogram (T*K atomics on E + 1
  # counters serialise on a GPU): the first sorted position of each expert that has pairs is where
  # its run begins (one unique scatter); an expert without pairs starts where the next one does.
  position = jnp.arange(num_pairs, dtype=jnp.int32)
  run_begins = jnp.ones((num_pairs,), bool)
  if num_pairs > 1:  # no zero-size slices (as with the concatenate in build_grouped_layout)
    run_begins = run_begins.at[1:].set(sorted_expert[1:] != sorted_expert[:-1])
  first = jnp.full((e_count + 1,), num_pairs, jnp.int32).at[  # positions inside a run: dropped
      jnp.where(run_begins, sorted_expert, e_count + 1)].set(position, mode="drop")
  starts_all = jax.lax.cummin(first, reverse=True)  # (E + 1,), E: 'no expert'
  counts = starts_all[1:] - starts_all[:-1]
  starts = starts_all[:e_count]  # first sorted position of each expert
  row_starts = _expert_row_starts(counts, row_tile)

  safe_expert = jnp.minimum(sorted_expert, e_count - 1)
  row_of_sorted = row_starts[safe_expert] + (position - starts[safe_expert])
  row_of_sorted = jnp.where(sorted_expert < e_count, row_of_sorted, rows)

  pair_row = jnp.full((num_pairs,), rows, jnp.int32).at[order].set(row_of_sorted)
  row_pair = jnp.full((rows,), -1, jnp.int32).at[row_of_sorted].set(order, mode="drop")
  return pair_row, row_pair, counts


def _exclusive_cumsum_rows(x: Array, group: int = 32) -> Array:
  """Exclusive prefix sum down the rows of x (B, E) in two levels (within groups of `group` rows,
  then over the groups' totals): XLA's GPU cumsum is a reduce-window over the whole axis, whose
  cost grows with its square."""
  blocks = x.shape[0]
  if blocks <= group:
    return jnp.cumsum(x, axis=0) - x
  padded = jnp.pad(x, ((0, -blocks % group), (0, 0))).reshape(-1, group, x.shape[1])
  totals = jnp.sum(padded, axis=1)
  before = (jnp.cumsum(padded, axis=1) - padded) + (jnp.cumsum(totals, axis=0) - totals)[:, None]
  return before.reshape(-1, x.shape[1])[:blocks]


def _rows_by_block_ranks(expert_ids: Array, e_count: int, row_tile: int, rows: int,
                         extra_used: Array | None = None):
  """`_rows_by_sort` as a counting sort: per token block, each expert's pair count and each pair's
  rank among the block's pairs of its expert (one Pallas kernel, `sonic_jax.pallas.layout_ranks`),
  then a prefix sum over blocks. Same layout, no sort. extra_used (E, J) bool, optional: extra
  pairs grouped by expert (entry (e, j) is expert e's or unused), placed after each expert's slot
  pairs in order."""
  num_tokens, slots = expert_ids.shape
  interpret = jax.default_backend() != "gpu"
  ranks, block_counts = layout_ranks.block_ranks(expert_ids, e_count, interpret=interpret)
  bt = layout_ranks.block_tokens(e_count)
  slot_counts = jnp.sum(block_counts, axis=0)
  counts = slot_counts
  if extra_used is not None:
    counts = counts + jnp.sum(extra_used, axis=1, dtype=jnp.int32)
  row_starts = _expert_row_starts(counts, row_tile)
  block_starts = _exclusive_cumsum_rows(block_counts) + row_starts
  valid = (expert_ids >= 0) & (expert_ids < e_count)
  block = jax.lax.broadcasted_iota(jnp.int32, expert_ids.shape, 0) // bt
  pair_row = block_starts[block, jnp.clip(expert_ids, 0, e_count - 1)] + ranks
  pair_row = jnp.where(valid, pair_row, rows).reshape(-1)
  if extra_used is not None:
    used = extra_used.astype(jnp.int32)
    extra_row = (row_starts + slot_counts)[:, None] + jnp.cumsum(used, axis=1) - used
    pair_row = jnp.concatenate(
        [pair_row, jnp.where(extra_used, extra_row, rows).reshape(-1).astype(jnp.int32)])
  pair = jnp.arange(pair_row.shape[0], dtype=jnp.int32)
  # Pairs routed nowhere point past the buffer, each at its own index: a scatter of unique
  # indices needs no atomics.
  target = jnp.where(pair_row < rows, pair_row, rows + pair)
  row_pair = jnp.full((rows,), -1, jnp.int32).at[target].set(
      pair, mode="drop", unique_indices=True)
  return pair_row, row_pair, counts


def check_integer_array(name: str, ids) -> None:
  """A TypeError naming `name` unless ids is an array of an integer dtype."""
  if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(ids).__name__}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")


def _check_ids(name, ids, ndim, shape_doc):
  check_integer_array(name, ids)
  if ids.ndim != ndim:
    raise ValueError(f"{name} must be {shape_doc}, got shape {tuple(ids.shape)}")


def build_grouped_layout(expert_ids: Array, num_experts: int, row_tile: int,
                         extra_tokens: Array | None = None,
                         extra_experts: Array | None = None, *, extras_by_expert: bool = False,
                         method: str = "auto", config: Config | None = None) -> GroupedLayout:
  """Builds the grouped layout (a `GroupedLayout`) for `expert_ids` (T, S) integer over
  num_experts = E experts; ids outside [0, E) mean 'no expert'. row_tile: rows per tile of the
  grouped GEMMs, every expert's rows padded to a multiple of it; `expert_mixture` needs its
  backend's (`sonic_jax.backends.resolve_backend(backend, config).row_tile`). config: a
  `sonic_jax.Config` (its layout_kernel_max_experts; None: the defaults).

  extra_tokens, extra_experts: optional (X,) int32 (token, expert) pairs beyond the slots; an expert
  id outside [0, E) or a token outside [0, T) marks an unused entry. A token may appear in any
  number of them. An expert's extra pairs follow its slot pairs, in list order.
  extras_by_expert: the extra pairs come grouped by expert as token rounding gives them: X = E * J
  and entry x is expert x // J's or unused (an entry naming any other expert counts as unused);
  then the "block_ranks" method places them with no sort.
  method: how pairs are grouped, the same layout either way. "sort": a stable sort of the expert
  ids. "block_ranks": a counting sort whose per-block counts and ranks come from a Pallas kernel
  (interpreted off the GPU; extra pairs only by expert, E <= 1024, S <= 32). "auto" (default):
  "block_ranks" on a GPU where it applies and E, rounded up to a power of two, is at most
  `config.layout_kernel_max_experts` (faster there: one kernel instead of a radix sort and about
  ten small XLA kernels), "sort" otherwise.
  """
  config = check_config(config)
  for name, value in (("num_experts", num_experts), ("row_tile", row_tile)):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 1:
      raise ValueError(f"{name} must be >= 1, got {value}")
  if not isinstance(extras_by_expert, bool):
    raise TypeError(f"extras_by_expert must be a bool, got {extras_by_expert!r}")
  if (extra_tokens is None) != (extra_experts is None):
    raise ValueError("extra_tokens and extra_experts must be given together")
  _check_ids("expert_ids", expert_ids, 2, "(T, S)")
  num_tokens, slots = expert_ids.shape
  if extra_tokens is None:
    extra_tokens = extra_experts = jnp.zeros((0,), jnp.int32)
  _check_ids("extra_tokens", extra_tokens, 1, "(X,)")
  _check_ids("extra_experts", extra_experts, 1, "(X,)")
  expert_ids, extra_tokens, extra_experts = unsplit(
      "build_grouped_layout", "tokens", expert_ids=expert_ids, extra_tokens=extra_tokens,
      extra_experts=extra_experts)
  if extra_tokens.shape != extra_experts.shape:
    raise ValueError(f"extra_tokens and extra_experts must both be (X,), got shapes "
                     f"{extra_tokens.shape} and {extra_experts.shape}")
  # Out-of-range ids of a dtype wider than int32 must not wrap onto a real expert.
  expert_ids = int32_ids(expert_ids, num_experts, -1)
  extra_experts = int32_ids(extra_experts, num_experts, num_experts)
  extra_tokens = int32_ids(extra_tokens, num_tokens, num_tokens)
  num_slot_pairs = num_tokens * slots
  num_extra = extra_tokens.shape[0]
  num_pairs = num_slot_pairs + num_extra
  e_count = num_experts
  rows = grouped_rows(num_pairs, e_count, row_tile)
  # An extra pair counts only with both its expert and its token in range: one outside would
  # add a row whose output the aggregation drops but whose weight gradient it keeps.
  extra_used = ((extra_experts >= 0) & (extra_experts < e_count) & (extra_tokens >= 0)
                & (extra_tokens < num_tokens))
  extra_experts = jnp.where(extra_used, extra_experts, e_count)

  if extras_by_expert and num_extra:
    if num_extra % e_count:
      raise ValueError(
          f"extras_by_expert needs E * J extra pairs, got {num_extra} for E={e_count}")
    owner = jnp.arange(num_extra, dtype=jnp.int32) // (num_extra // e_count)
    extra_used = extra_used & (extra_experts == owner)
    extra_experts = jnp.where(extra_used, extra_experts, e_count)
  if _use_block_ranks(method, expert_ids, e_count, num_extra, extras_by_expert,
                      config.layout_kernel_max_experts):
    extra_grid = extra_used.reshape(e_count, -1) if num_extra else None
    pair_row, row_pair, counts = _rows_by_block_ranks(expert_ids, e_count, row_tile, rows,
                                                      extra_grid)
  else:
    flat = expert_ids.reshape(-1)
    if num_extra:  # no zero-size concatenate: run eagerly, XLA:CPU crashes compiling one
      flat = jnp.concatenate([flat, extra_experts.astype(jnp.int32)])
    flat = jnp.where((flat >= 0) & (flat < e_count), flat, e_count)  # E sorts last: 'no expert'
    pair_row, row_pair, counts = _rows_by_sort(flat, e_count, row_tile, rows)
  group_sizes = _round_up(counts, row_tile)
  num_tiles = jnp.sum(group_sizes) // row_tile
  tile_ends = jnp.cumsum(group_sizes) // row_tile  # tile t belongs to the first e with t < end_e
  tiles = jnp.arange(rows // row_tile, dtype=jnp.int32)
  # A (tiles, E) compare-and-count: searchsorted's binary search is a while loop, one kernel
  # launch per step on a GPU.
  tile_expert = jnp.sum(tile_ends[None, :] <= tiles[:, None], axis=1, dtype=jnp.int32)
  # (jnp.repeat with a static length builds its indices by a cumsum that XLA constant-folds
  # slowly at these sizes.)
  row_expert = jnp.broadcast_to(tile_expert[:, None], (rows // row_tile, row_tile)).reshape(rows)

  # A padding row reads the pair of its expert's first row: the Mosaic GPU weight gradients
  # multiply the padding rows of an expert's last reduction step by zero rather than masking
  # them, so a non-finite row can then only reach the gradient of an expert it is routed to.
  row_source = row_pair
  if rows:  # (no rows, no padding: nothing to gather from)
    group_start = jnp.minimum(tile_ends * row_tile - group_sizes, rows - 1)
    first_pair = row_pair[group_start]
    row_source = jnp.where(row_pair >= 0, row_pair,
                           jnp.where(row_expert < e_count,
                                     first_pair[jnp.minimum(row_expert, e_count - 1)], -1))
  if num_extra:
    pair_token = jnp.concatenate([
        jnp.arange(num_slot_pairs, dtype=jnp.int32) // slots,
        jnp.where(extra_used, jnp.clip(extra_tokens, 0, num_tokens - 1), 0).astype(jnp.int32)])
    row_token = jnp.where(row_source >= 0, pair_token[jnp.maximum(row_source, 0)], 0)
  else:  # slot pairs only: the token is the pair index over S, no gather
    row_token = jnp.maximum(row_source, 0) // slots
  row_token = row_token.astype(jnp.int32)

  return GroupedLayout(
      row_token=row_token,
      row_pair=row_pair,
      row_expert=row_expert,
      pair_row=pair_row[:num_slot_pairs].reshape(num_tokens, slots),
      group_sizes=group_sizes.astype(jnp.int32),
      expert_counts=counts,
      tile_expert=tile_expert,
      num_tiles=num_tiles.astype(jnp.int32),
      extra_row=pair_row[num_slot_pairs:],
      extra_token=jnp.where(extra_used, extra_tokens, num_tokens).astype(jnp.int32),
  )
