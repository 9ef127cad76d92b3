"""Token rounding's extra pairs folded into each token's first slot, read by the same gather-sum.

The aggregation y_t = sum_s w_ts Y[row(t, s)] + sum_x w_x Y[row_x] (x: the extra pairs of token t)
has a fixed number of slot pairs per token but any number of extra pairs. `fold_extras` sums each
token's extra rows, weighted, in float32, into the row of its slot 0 together with that slot's
weighted row (the slot's weight becomes 1), or, where slot 0 was routed nowhere (rounding dropped
it), into the first extra row, which slot 0 then names. The gather-sum then reads the top-K slots
only: the extras cost no slot of their own, so the forward's weighted sum and the backward's dX sum
(which XLA fuses with the router's input gradient) run as they do for top-K, and only the extra
pairs in use are read. The list has a static length X = E * J, but rounding uses a fraction of it
(about 2k of 16k entries at T = 16384, E = 256, tile 128); a segment sum over the whole list gathers
and scatter-adds all X rows.

A token finds its extra pairs through the layout's `extra_index` (T, E): for each expert, the
place of the token in that expert's part of the list, or -1 (token rounding's lists are grouped by
expert, each token at most once per expert). One Pallas (Triton) program per block of tokens loads
their rows of the index, ranks each token's extras in expert order (a prefix sum along E), then
adds the slot row and the m-th extra row of every token of the block for m = 0, 1, ... while any
token has one, each row's column blocks loaded at once, and stores each token's sum, in the
buffer's dtype, over its slot row (or its first extra row). No sort of the list by token: a token
without extras costs its row of the index. Each row of the buffer belongs to one pair, so no two
programs touch the same row: no atomics, deterministic. The buffer is updated in place (aliased);
the rows are the forward's Y or the backward's dX rows, which nothing reads after the gather-sum.
Uses Pallas's Triton lowering (deprecated in jax 0.11, present in 0.11.2; `AVAILABLE` is False
where it is gone). Reference: `reference`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax.pallas import TRITON_AVAILABLE, next_pow2, pltriton

AVAILABLE = TRITON_AVAILABLE  # without the Triton lowering the sum is XLA's

BLOCK_COLUMNS = (1024, 512, 256, 128)
MAX_TOKENS_PER_PROGRAM = 16


def block_columns(d: int) -> int | None:
  return next((b for b in BLOCK_COLUMNS if d % b == 0), None)


def num_warps(d: int) -> int:
  return 4 if d <= 4096 else 8


def tokens_per_program(d: int) -> int:
  """Tokens a program folds: a power of two, as many as keep its float32 accumulators (tokens x
  d) at 64 a thread, at most `MAX_TOKENS_PER_PROGRAM`."""
  budget = 64 * 32 * num_warps(d)
  tokens = 1
  while tokens < MAX_TOKENS_PER_PROGRAM and 2 * tokens * d <= budget:
    tokens *= 2
  return tokens


def supports(rows: jax.Array) -> str | None:
  """None when the kernel takes this buffer, else why not."""
  if rows.ndim != 2:
    return f"rows (R, d) expected, got shape {rows.shape}"
  if block_columns(rows.shape[1]) is None:
    return f"d={rows.shape[1]} is not a multiple of {BLOCK_COLUMNS[-1]}"
  if rows.shape[0] < 1:
    return "no rows"
  return None


def _kernel(index_ref, extra_row_ref, extra_weight_ref, slot_row_ref, slot_weight_ref, rows_ref,
            out_ref, new_row_ref, new_weight_ref, *, num_tokens: int, num_experts: int,
            per_expert: int, tokens: int, bd: int, weighted: bool):
  del rows_ref  # aliased to out_ref
  num_rows = out_ref.shape[0]
  # Masked-off lanes of a store aim past the array (interpret mode writes them back otherwise).
  place_of = pl.program_id(0) * tokens + lax.broadcasted_iota(jnp.int32, (tokens,), 0)
  real = place_of < num_tokens
  token = jnp.minimum(place_of, num_tokens - 1)
  # Array indices on both axes (a gather), which interpret mode takes where mixed ones are not.
  expert = lax.broadcasted_iota(jnp.int32, (tokens, index_ref.shape[1]), 1)
  place = pltriton.load(index_ref.at[token[:, None], expert]).astype(jnp.int32)  # (tokens, E')
  named = (place >= 0) & (expert < num_experts) & real[:, None]
  entry_all = expert * per_expert + jnp.maximum(place, 0)
  row_all = pltriton.load(extra_row_ref.at[entry_all], mask=named, other=num_rows)
  has = named & (row_all >= 0) & (row_all < num_rows)  # a pair without a row is left out
  has_i = has.astype(jnp.int32)
  count = jnp.sum(has_i, axis=1)
  rank = jnp.cumsum(has_i, axis=1) - has_i  # the token's extras in expert order

  def extra(m):
    """Each token's m-th extra pair: its grouped row (0 where none), weight and presence."""
    pick = has & (rank == m)
    present = count > m
    weight = (pltriton.load(extra_weight_ref.at[jnp.sum(jnp.where(pick, entry_all, 0), axis=1)],
                            mask=present, other=0.0)
              if weighted else jnp.ones((tokens,), jnp.float32))
    return jnp.sum(jnp.where(pick, row_all, 0), axis=1), weight, present

  given_row = pltriton.load(slot_row_ref.at[token])
  has_slot = (given_row >= 0) & (given_row < num_rows)
  slot_row = jnp.clip(given_row, 0, num_rows - 1)
  slot_weight = (pltriton.load(slot_weight_ref.at[token]) if weighted
                 else jnp.ones((tokens,), jnp.float32))
  folds = count > 0
  first_row, _, _ = extra(0)
  target = jnp.where(folds, jnp.where(has_slot, slot_row, first_row), num_rows)
  pltriton.store(new_row_ref.at[place_of], jnp.where(folds & ~has_slot, first_row, given_row),
                 mask=real)
  pltriton.store(new_weight_ref.at[place_of], jnp.where(folds, 1.0, slot_weight), mask=real)

  @pl.when(jnp.max(count) > 0)
  def _():
    # Every column block of a row is loaded at once, one accumulator each: the loads are
    # latency-bound, so the chain is one dependent load per extra, not one per extra and block.
    blocks = [c * bd + lax.broadcasted_iota(jnp.int32, (1, bd), 1)
              for c in range(out_ref.shape[1] // bd)]

    def weighted_rows(row, weight, present):
      return tuple(weight[:, None] * pltriton.load(
          out_ref.at[row[:, None], columns], mask=present[:, None], other=0.0).astype(jnp.float32)
                   for columns in blocks)

    def add(m, acc):
      return tuple(a + b for a, b in zip(acc, weighted_rows(*extra(m))))

    # A slot routed nowhere points at a padding row (garbage): masked off, not weighted by zero.
    acc = weighted_rows(slot_row, slot_weight, has_slot & folds)
    acc = lax.fori_loop(0, jnp.max(count), add, acc)
    for columns, piece in zip(blocks, acc):
      pltriton.store(out_ref.at[target[:, None], columns], piece.astype(out_ref.dtype),
                     mask=folds[:, None])


@functools.partial(jax.jit, static_argnames=("interpret",))
def fold_extras(rows, slot_row, slot_weight, extra_index, extra_row, extra_weight, *,
                interpret: bool = False):
  """(rows', slot_row', slot_weight'): rows (R, d) with each token's extra pairs, weighted by
  extra_weight (X,), and its slot-0 pair, weighted by slot_weight (T,), summed in float32 into
  the slot's row (slot_row (T,), the layout's pair_row[:, 0]), or into the first extra row (in
  expert order) where the slot was routed nowhere (slot_row outside [0, R)); slot_row' names that
  row and slot_weight' is 1 for every token with extras. extra_index (T, E): the layout's
  (`extra_index`), places in an extra-pair list grouped by expert, X = E * J; extra_row (X,): the
  pairs' grouped rows (a pair whose row is outside [0, R), dropped by a capacity, is left out).
  Weights of None mean 1 (and slot_weight' is None). Rows other than those written are
  unchanged."""
  reason = supports(rows)
  if reason is not None:
    raise ValueError(f"extras kernel: {reason}")
  num_rows, d = rows.shape
  num_tokens, num_experts = extra_index.shape
  num_extra = extra_row.shape[0]
  if slot_row.shape != (num_tokens,):
    raise ValueError(f"slot_row must be ({num_tokens},), got {slot_row.shape}")
  if num_extra % num_experts:
    raise ValueError(f"extra_row must have E * J entries, got {num_extra} for E={num_experts}")
  weighted = slot_weight is not None
  if num_extra == 0 or num_tokens == 0:
    return rows, slot_row, slot_weight
  if num_experts != next_pow2(num_experts):  # Triton's blocks are powers of two
    extra_index = jnp.pad(extra_index, ((0, 0), (0, next_pow2(num_experts) - num_experts)),
                          constant_values=-1)
  tokens = tokens_per_program(d)
  # Whole arrays left in place (no blocks copied per program): each program reads its tokens'
  # rows of the index and of the buffer and writes only its tokens' target rows.
  whole = pl.BlockSpec(memory_space=pl.ANY)
  out, new_row, new_weight = pl.pallas_call(
      functools.partial(_kernel, num_tokens=num_tokens, num_experts=num_experts,
                        per_expert=num_extra // num_experts, tokens=tokens,
                        bd=block_columns(d), weighted=weighted),
      out_shape=(jax.ShapeDtypeStruct(rows.shape, rows.dtype),
                 jax.ShapeDtypeStruct((num_tokens,), jnp.int32),
                 jax.ShapeDtypeStruct((num_tokens,), jnp.float32)),
      grid=(pl.cdiv(num_tokens, tokens),),
      in_specs=[whole] * 6,
      out_specs=(whole, whole, whole),
      input_output_aliases={5: 0},
      compiler_params=pltriton.CompilerParams(num_warps=num_warps(d), num_stages=1),
      name="extras_fold",
      interpret=interpret,
  )(extra_index, extra_row.astype(jnp.int32),
    (extra_weight if weighted else jnp.ones((num_extra,))).astype(jnp.float32),
    slot_row.astype(jnp.int32),
    (slot_weight if weighted else jnp.ones((num_tokens,))).astype(jnp.float32), rows)
  new_weight = new_weight.astype(slot_weight.dtype) if weighted else None
  return out, new_row.astype(slot_row.dtype), new_weight


def reference(rows, slot_row, slot_weight, extra_index, extra_row, extra_weight):
  """`fold_extras` by a segment sum over the whole list (XLA)."""
  num_rows = rows.shape[0]
  num_tokens, num_experts = extra_index.shape
  num_extra = extra_row.shape[0]
  per_expert = num_extra // num_experts
  place = extra_index.astype(jnp.int32)
  has = place >= 0
  entry_all = lax.broadcasted_iota(jnp.int32, place.shape, 1) * per_expert + jnp.maximum(place, 0)
  token_all = lax.broadcasted_iota(jnp.int32, place.shape, 0)
  # Each entry's token (T where no token names it), and each token's first entry in expert order.
  extra_token = jnp.full((num_extra,), num_tokens, jnp.int32).at[
      jnp.where(has, entry_all, num_extra)].set(token_all, mode="drop")
  used = (extra_token < num_tokens) & (extra_row >= 0) & (extra_row < num_rows)
  first = jnp.min(jnp.where(has & used[entry_all], entry_all, num_extra), axis=1)
  folds = first < num_extra
  first_row = extra_row[jnp.minimum(first, num_extra - 1)]
  has_slot = (slot_row >= 0) & (slot_row < num_rows)
  new_row = jnp.where(folds & ~has_slot, first_row, slot_row).astype(slot_row.dtype)
  new_weight = None if slot_weight is None else jnp.where(folds, 1, slot_weight).astype(
      slot_weight.dtype)
  w = jnp.ones((num_extra,), jnp.float32) if extra_weight is None else extra_weight
  pieces = rows[jnp.clip(extra_row, 0, num_rows - 1)].astype(jnp.float32)
  pieces = jnp.where(used[:, None], pieces * w.astype(jnp.float32)[:, None], 0.0)
  sums = jax.ops.segment_sum(pieces, extra_token, num_segments=num_tokens)
  w0 = jnp.ones((num_tokens,), jnp.float32) if slot_weight is None else slot_weight
  sums = sums + jnp.where(has_slot[:, None], w0.astype(jnp.float32)[:, None] * rows[
      jnp.clip(slot_row, 0, num_rows - 1)].astype(jnp.float32), 0.0)
  target = jnp.where(folds, jnp.where(has_slot, slot_row, first_row), num_rows)
  return rows.at[jnp.where(folds, target, num_rows)].set(sums.astype(rows.dtype),
                                                         mode="drop"), new_row, new_weight
