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

The list comes grouped by expert (token rounding's: X = E * J, entry e * J + j expert e's, its
tokens increasing, unused entries last), so a token's extras are found without sorting the list:
XLA marks each token's first entry (a scatter-min of the entries' indices by token), and one
Pallas (Triton) program per entry returns at once unless it is that first entry; the program of a
first entry finds the token in every expert's part by a binary search (all experts at once, one
lane each), then adds the slot row and the found rows, in expert order, in float32, every column
block of a row loaded at once, and stores the sum, in the buffer's dtype, over the slot row (or
its first extra row, which it has already read), and the token's new slot row and weight. Each
row of the buffer belongs to one pair, so no two programs touch the same row: no atomics,
deterministic. The buffer is updated in place (aliased); the rows are the forward's Y or the
backward's dX rows, which nothing reads after the gather-sum. Uses Pallas's Triton lowering
(deprecated in jax 0.11, present in 0.11.2; `AVAILABLE` is False where it is gone). Reference:
`reference`.
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


def _used(extra_token, extra_row, num_tokens, num_rows):
  return (extra_token >= 0) & (extra_token < num_tokens) & (extra_row >= 0) & (extra_row < num_rows)


def _first_entries(num_tokens, num_rows, extra_token, extra_row):
  """(T,) each token's first extra entry (the smallest index: its first expert's), X where it has
  none. A scatter-min: its order does not matter."""
  num_extra = extra_token.shape[0]
  used = _used(extra_token, extra_row, num_tokens, num_rows)
  return jnp.full((num_tokens,), num_extra, jnp.int32).at[
      jnp.where(used, extra_token, num_tokens)].min(lax.iota(jnp.int32, num_extra), mode="drop")


def _slot_valid(slot_row, num_rows):
  return (slot_row >= 0) & (slot_row < num_rows)


def _kernel(token_ref, row_ref, weight_ref, first_ref, slot_row_ref, slot_weight_ref, rows_ref,
            new_row_in_ref, new_weight_in_ref, out_ref, new_row_ref, new_weight_ref, *,
            num_tokens: int, num_experts: int, per_expert: int, bd: int, weighted: bool):
  del rows_ref, new_row_in_ref, new_weight_in_ref  # aliased to the outputs
  x = pl.program_id(0)
  token = token_ref[x]
  safe_token = jnp.clip(token, 0, num_tokens - 1)
  num_rows = out_ref.shape[0]
  num_extra = token_ref.shape[0]

  @pl.when((token >= 0) & (token < num_tokens) & (first_ref[safe_token] == x))
  def _():
    # The token in every expert's part: a lower-bound binary search per expert, one lane each
    # (each part's tokens increase; unused entries hold T, past every token).
    expert = lax.broadcasted_iota(jnp.int32, (next_pow2(num_experts),), 0)
    real = expert < num_experts
    lo = expert * per_expert
    hi = jnp.where(real, lo + per_expert, lo)
    for _ in range(per_expert.bit_length()):
      open_ = lo < hi
      mid = (lo + hi) // 2
      below = pltriton.load(token_ref.at[jnp.minimum(mid, num_extra - 1)], mask=open_,
                            other=num_tokens) < token
      lo = jnp.where(open_ & below, mid + 1, lo)
      hi = jnp.where(open_ & ~below, mid, hi)
    entry = jnp.minimum(lo, num_extra - 1)
    inside = real & (lo < expert * per_expert + per_expert)
    row = pltriton.load(row_ref.at[entry], mask=inside, other=num_rows)
    found = inside & (pltriton.load(token_ref.at[entry], mask=inside, other=-1) == token) & (
        row >= 0) & (row < num_rows)
    found_i = found.astype(jnp.int32)
    rank = jnp.cumsum(found_i) - found_i  # the token's extras in expert order

    def pick(m, values):
      return jnp.sum(jnp.where(found & (rank == m), values, 0))

    slot_row = slot_row_ref[safe_token]
    has_slot = _slot_valid(slot_row, num_rows)
    first_row = row_ref[x]  # this entry is the token's first
    target = jnp.where(has_slot, slot_row, first_row)
    slot_weight = slot_weight_ref[safe_token] if weighted else jnp.float32(1.0)
    # Every column block of a row is loaded at once, one accumulator each: the loads are
    # latency-bound, so the chain is one dependent load per row, not one per row and block.
    blocks = [pl.ds(c * bd, bd) for c in range(out_ref.shape[1] // bd)]

    def weighted_row(r, w):
      return tuple(w * out_ref[r, columns].astype(jnp.float32) for columns in blocks)

    def add(m, acc):
      entry_m = pick(m, entry)
      w = weight_ref[entry_m] if weighted else jnp.float32(1.0)
      return tuple(a + b for a, b in zip(acc, weighted_row(pick(m, row), w)))

    # where(), not a zero weight: a slot routed nowhere points at a padding row (garbage).
    start = tuple(jnp.where(has_slot, piece, 0.0) for piece in
                  weighted_row(jnp.clip(slot_row, 0, num_rows - 1), slot_weight))
    acc = lax.fori_loop(0, jnp.sum(found_i), add, start)
    for columns, piece in zip(blocks, acc):
      out_ref[target, columns] = piece.astype(out_ref.dtype)
    new_row_ref[safe_token] = target
    new_weight_ref[safe_token] = jnp.float32(1.0)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def fold_extras(rows, slot_row, slot_weight, extra_token, extra_row, extra_weight, *,
                num_experts: int, interpret: bool = False):
  """(rows', slot_row', slot_weight'): rows (R, d) with each token's extra pairs, weighted by
  extra_weight (X,), and its slot-0 pair, weighted by slot_weight (T,), summed in float32 into
  the slot's row (slot_row (T,), the layout's pair_row[:, 0]), or into the first extra row (its
  first expert's) where the slot was routed nowhere (slot_row outside [0, R)); slot_row' names
  that row and slot_weight' is 1 for every token with extras. The extra pairs (extra_token,
  extra_row (X,)) come grouped by expert: X = E * J (E = num_experts), entry e * J + j expert e's,
  its tokens increasing and its unused entries (token T) last. Pairs with extra_token outside
  [0, T) or extra_row outside [0, R) are unused. Weights of None mean 1 (and slot_weight' is
  None). Rows other than those written are unchanged."""
  reason = supports(rows)
  if reason is not None:
    raise ValueError(f"extras kernel: {reason}")
  num_rows, d = rows.shape
  num_tokens = slot_row.shape[0]
  num_extra = extra_token.shape[0]
  if num_experts < 1 or num_extra % num_experts:
    raise ValueError(f"the extra pairs must be E * J, got {num_extra} for E={num_experts}")
  weighted = slot_weight is not None
  if num_extra == 0 or num_tokens == 0:
    return rows, slot_row, slot_weight
  first = _first_entries(num_tokens, num_rows, extra_token.astype(jnp.int32),
                         extra_row.astype(jnp.int32))
  slot_row = slot_row.astype(jnp.int32)
  slot_weight_f32 = (slot_weight if weighted else jnp.ones((num_tokens,))).astype(jnp.float32)
  bd = block_columns(d)
  # Whole arrays left in place (no blocks copied per program): each program reads and writes only
  # the rows of its token. The new slot rows and weights start as copies of the old (aliased), so
  # only tokens with extras are written.
  whole = pl.BlockSpec(memory_space=pl.ANY)
  out, new_row, new_weight = pl.pallas_call(
      functools.partial(_kernel, num_tokens=num_tokens, num_experts=num_experts,
                        per_expert=num_extra // num_experts, bd=bd, weighted=weighted),
      out_shape=(jax.ShapeDtypeStruct(rows.shape, rows.dtype),
                 jax.ShapeDtypeStruct((num_tokens,), jnp.int32),
                 jax.ShapeDtypeStruct((num_tokens,), jnp.float32)),
      grid=(num_extra,),
      in_specs=[whole] * 9,
      out_specs=(whole, whole, whole),
      input_output_aliases={6: 0, 7: 1, 8: 2},
      # A thread holds d / (32 * num_warps) float32 accumulators.
      compiler_params=pltriton.CompilerParams(num_warps=4 if d <= 4096 else 8, num_stages=1),
      name="extras_fold",
      interpret=interpret,
  )(extra_token.astype(jnp.int32), extra_row.astype(jnp.int32),
    (extra_weight if weighted else jnp.ones((num_extra,))).astype(jnp.float32), first,
    slot_row, slot_weight_f32, rows, slot_row, slot_weight_f32)
  return out, new_row, new_weight.astype(slot_weight.dtype) if weighted else None


def reference(rows, slot_row, slot_weight, extra_token, extra_row, extra_weight):
  """`fold_extras` by a segment sum over the whole list (XLA); the list in any order."""
  num_rows = rows.shape[0]
  num_tokens = slot_row.shape[0]
  num_extra = extra_token.shape[0]
  first = _first_entries(num_tokens, num_rows, extra_token, extra_row)
  folds = first < num_extra
  first_row = extra_row[jnp.minimum(first, num_extra - 1)]
  has_slot = _slot_valid(slot_row, num_rows)
  target = jnp.where(has_slot, slot_row, first_row)
  new_row = jnp.where(folds, target, slot_row).astype(slot_row.dtype)
  new_weight = None if slot_weight is None else jnp.where(folds, 1, slot_weight).astype(
      slot_weight.dtype)
  used = _used(extra_token, extra_row, num_tokens, num_rows)
  w = jnp.ones(extra_token.shape, jnp.float32) if extra_weight is None else extra_weight
  pieces = rows[jnp.clip(extra_row, 0, num_rows - 1)].astype(jnp.float32)
  pieces = jnp.where(used[:, None], pieces * w.astype(jnp.float32)[:, None], 0.0)
  sums = jax.ops.segment_sum(pieces, jnp.where(used, extra_token, num_tokens),
                             num_segments=num_tokens)
  w0 = jnp.ones((num_tokens,), jnp.float32) if slot_weight is None else slot_weight
  sums = sums + jnp.where(has_slot[:, None], w0.astype(jnp.float32)[:, None] * rows[
      jnp.clip(slot_row, 0, num_rows - 1)].astype(jnp.float32), 0.0)
  return rows.at[jnp.where(folds, target, num_rows)].set(sums.astype(rows.dtype),
                                                         mode="drop"), new_row, new_weight
