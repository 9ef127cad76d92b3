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

The pairs are sorted by token first (X small integers). One Pallas (Triton) program per sorted
entry: the program at the first entry of a token's run adds the slot row and the run's rows in
order in float32, every column block of a row loaded at once, and stores the sum, in the buffer's
dtype, over the slot row (or the run's first row, which it has already read); every other program
returns at once. Each row of the buffer belongs to one pair, so no two programs touch the same
row: no atomics, deterministic. The buffer is updated in place (aliased); the rows are the
forward's Y or the backward's dX rows, which nothing reads after the gather-sum. Uses Pallas's
Triton lowering (deprecated in jax 0.11, present in 0.11.2; `AVAILABLE` is False where it is
gone). Reference: `reference`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax import layout
from sonic_jax.pallas import TRITON_AVAILABLE, pltriton

AVAILABLE = TRITON_AVAILABLE  # without the Triton lowering the sum is XLA's

BLOCK_COLUMNS = (1024, 512, 256, 128)


def block_columns(d: int) -> int | None:
  return next((b for b in BLOCK_COLUMNS if d % b == 0), None)


def supports(rows: jax.Array) -> str | None:
  """None when the kernel takes this buffer, else why not."""
  if rows.ndim != 2:
    return f"rows (R, d) expected, got shape {rows.shape}"
  if block_columns(rows.shape[1]) is None:
    return f"d={rows.shape[1]} is not a multiple of {BLOCK_COLUMNS[-1]}"
  if rows.shape[0] < 1:
    return "no rows"
  return None


def _sorted_runs(num_tokens, num_rows, extra_token, extra_row, extra_weight):
  """The pairs in use sorted by token (unused last), and each token's first extra row in that
  order (R for a token without extras)."""
  used = (extra_token >= 0) & (extra_token < num_tokens) & (extra_row >= 0) & (
      extra_row < num_rows)
  token = jnp.where(used, extra_token, num_tokens).astype(jnp.int32)
  order, token = layout.stable_sort_ids(token, num_tokens)
  row = jnp.clip(extra_row[order], 0, num_rows - 1).astype(jnp.int32)
  weight = (jnp.ones(token.shape, jnp.float32) if extra_weight is None
            else extra_weight.astype(jnp.float32)[order])
  first = jnp.ones(token.shape, bool)
  if token.shape[0] > 1:
    first = first.at[1:].set(token[1:] != token[:-1])
  first = first & (token < num_tokens)
  # A unique scatter: one first entry per token; the other entries each aim past the end at their
  # own place (dropped), so that the indices are unique as promised.
  beyond = num_tokens + lax.iota(jnp.int32, token.shape[0])
  first_row = jnp.full((num_tokens,), num_rows, jnp.int32).at[
      jnp.where(first, token, beyond)].set(row, mode="drop", unique_indices=True)
  return token, row, weight, first_row


def _slot_valid(slot_row, num_rows):
  return (slot_row >= 0) & (slot_row < num_rows)


def _folded_slot(slot_row, slot_weight, first_row, num_rows):
  """Slot 0's row and weight after the fold: the first extra row where the slot was routed
  nowhere, and weight 1 wherever the token has extras (the sum is weighted already)."""
  has = first_row < num_rows
  new_row = jnp.where(has & ~_slot_valid(slot_row, num_rows), first_row, slot_row)
  new_weight = None if slot_weight is None else jnp.where(has, 1, slot_weight).astype(
      slot_weight.dtype)
  return new_row.astype(slot_row.dtype), new_weight


def _kernel(token_ref, row_ref, weight_ref, slot_row_ref, slot_weight_ref, rows_ref, out_ref, *,
            num_tokens: int, num_extra: int, bd: int, weighted: bool):
  del rows_ref  # aliased to out_ref
  i = pl.program_id(0)
  token = token_ref[i]
  previous = token_ref[jnp.maximum(i - 1, 0)]
  num_rows = out_ref.shape[0]

  @pl.when((token < num_tokens) & ((i == 0) | (previous != token)))
  def _():
    slot_row = slot_row_ref[token]
    has_slot = (slot_row >= 0) & (slot_row < num_rows)
    slot_row = jnp.clip(slot_row, 0, num_rows - 1)
    slot_weight = slot_weight_ref[token] if weighted else jnp.float32(1.0)
    target = jnp.where(has_slot, slot_row, row_ref[i])
    # Every column block of a row is loaded at once, one accumulator each: a run's loads are
    # latency-bound, so the chain is one dependent load per row, not one per row and block.
    blocks = [pl.ds(c * bd, bd) for c in range(out_ref.shape[1] // bd)]

    def weighted_row(row, weight):
      return tuple(weight * out_ref[row, columns].astype(jnp.float32) for columns in blocks)

    def more(carry):
      j, _ = carry
      return (j < num_extra) & (token_ref[jnp.minimum(j, num_extra - 1)] == token)

    def add(carry):
      j, acc = carry
      return j + 1, tuple(a + b for a, b in zip(acc, weighted_row(row_ref[j], weight_ref[j])))

    # where(), not a zero weight: a slot routed nowhere points at a padding row (garbage).
    start = tuple(jnp.where(has_slot, piece, 0.0) for piece in weighted_row(slot_row, slot_weight))
    _, acc = lax.while_loop(more, add, (i, start))
    for columns, piece in zip(blocks, acc):
      out_ref[target, columns] = piece.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def fold_extras(rows, slot_row, slot_weight, extra_token, extra_row, extra_weight, *,
                interpret: bool = False):
  """(rows', slot_row', slot_weight'): rows (R, d) with each token's extra pairs, weighted by
  extra_weight (X,), and its slot-0 pair, weighted by slot_weight (T,), summed in float32 into
  the slot's row (slot_row (T,), the layout's pair_row[:, 0]), or into the first extra row where
  the slot was routed nowhere (slot_row outside [0, R)); slot_row' names that row and
  slot_weight' is 1 for every token with extras. Weights of None mean 1 (and slot_weight' is
  None). Pairs with extra_token outside [0, T) or extra_row outside [0, R) are unused. Rows other
  than those written are unchanged."""
  reason = supports(rows)
  if reason is not None:
    raise ValueError(f"extras kernel: {reason}")
  num_rows, d = rows.shape
  num_tokens = slot_row.shape[0]
  num_extra = extra_token.shape[0]
  token, row, weight, first_row = _sorted_runs(num_tokens, num_rows, extra_token, extra_row,
                                               extra_weight)
  new_row, new_weight = _folded_slot(slot_row, slot_weight, first_row, num_rows)
  if num_extra == 0:
    return rows, new_row, new_weight
  weighted = slot_weight is not None
  bd = block_columns(d)
  # Whole arrays left in place (no blocks copied per program): each program reads and writes only
  # the rows of its token.
  whole = pl.BlockSpec(memory_space=pl.ANY)
  out = pl.pallas_call(
      functools.partial(_kernel, num_tokens=num_tokens, num_extra=num_extra, bd=bd,
                        weighted=weighted),
      out_shape=jax.ShapeDtypeStruct(rows.shape, rows.dtype),
      grid=(num_extra,),
      in_specs=[whole] * 6,
      out_specs=whole,
      input_output_aliases={5: 0},
      # A thread holds d / (32 * num_warps) float32 accumulators.
      compiler_params=pltriton.CompilerParams(num_warps=4 if d <= 4096 else 8, num_stages=1),
      name="extras_fold",
      interpret=interpret,
  )(token, row, weight, slot_row.astype(jnp.int32),
    (slot_weight if weighted else jnp.ones((num_tokens,))).astype(jnp.float32), rows)
  return out, new_row, new_weight


def reference(rows, slot_row, slot_weight, extra_token, extra_row, extra_weight):
  """`fold_extras` by a segment sum over the whole list (XLA)."""
  num_rows = rows.shape[0]
  num_tokens = slot_row.shape[0]
  _, _, _, first_row = _sorted_runs(num_tokens, num_rows, extra_token, extra_row, extra_weight)
  new_row, new_weight = _folded_slot(slot_row, slot_weight, first_row, num_rows)
  used = (extra_token >= 0) & (extra_token < num_tokens) & (extra_row >= 0) & (
      extra_row < num_rows)
  w = jnp.ones(extra_token.shape, jnp.float32) if extra_weight is None else extra_weight
  pieces = rows[jnp.clip(extra_row, 0, num_rows - 1)].astype(jnp.float32)
  pieces = jnp.where(used[:, None], pieces * w.astype(jnp.float32)[:, None], 0.0)
  sums = jax.ops.segment_sum(pieces, jnp.where(used, extra_token, num_tokens),
                             num_segments=num_tokens)
  has_slot = _slot_valid(slot_row, num_rows)
  w0 = jnp.ones((num_tokens,), jnp.float32) if slot_weight is None else slot_weight
  sums = sums + jnp.where(has_slot[:, None], w0.astype(jnp.float32)[:, None] * rows[
      jnp.clip(slot_row, 0, num_rows - 1)].astype(jnp.float32), 0.0)
  has = first_row < num_rows
  return rows.at[jnp.where(has, new_row, num_rows)].set(sums.astype(rows.dtype),
                                                        mode="drop"), new_row, new_weight
