"""Token rounding's selection: for every expert, which tokens it keeps, one pass over its row.

Token rounding (`sonic_jax.routing.round_tokens`) gives expert e a target count r_e, a multiple of
the tile near its token-choice (TC) count c_e, and keeps the first r_e tokens of its ranking: its TC
tokens by score, then the others by probability, ties to the lower token. When r_e <= c_e that drops
the c_e - r_e lowest-scored TC tokens; when r_e > c_e it adds the r_e - c_e most probable others.
Either way it is the m largest values of one region of the expert's row (TC scores, or the others'
probabilities), which this kernel finds without a sort: one Pallas (Triton) program per expert holds
its row in registers, one int32 per token, and finds the m-th largest by bisection over its 31 bits
(a count of the keys at or above a candidate per bit, stopping early once exactly m are), then keeps
the keys above it and the first ties in token order (a prefix sum). XLA's `lax.top_k` over the (E,
T) matrix is a segmented sort of all of it, and ranking the TC pairs a three-key sort.

Keys, int32 (E, T): a TC pair's is -bits(score) - 1, every other pair's bits(probability), where
bits (`order_bits`) is 1 + a float32's bit pattern, -0.0 (any negative) 1 and NaN 0; floats >= 0
order as their bit patterns do, so one array holds both regions (key < 0: TC) and each region's
order, and XLA's reference ranks by the same bits. Outputs: `keep_tc` (E, T) int8, 1 where a TC
pair is kept, and `added` (E, J) int32, the tokens the expert adds in increasing order, T past its
last. It uses Pallas's Triton lowering, deprecated in jax 0.11 but present in 0.11.2; `AVAILABLE`
is False where it is gone, and rounding uses the XLA path. Reference:
`sonic_jax.routing.round_tokens` with method="xla".
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax.pallas import TRITON_AVAILABLE, next_pow2, pltriton

AVAILABLE = TRITON_AVAILABLE  # without the Triton lowering rounding uses XLA

# A program keeps its expert's whole row in registers: 64 keys a thread up to 16 warps, then up to
# 96 at 16 warps (cheaper block-wide reductions than 32 warps'), and 32 warps beyond (more keys a
# thread spill: docs/decisions.md).
MAX_TOKENS = 65536
KEYS_PER_THREAD = 64
MAX_KEYS_PER_THREAD = 96
CHUNK = 16384  # the most keys per prefix sum (its SMEM scratch)
MIN_CHUNK = 4096  # the shortest piece the row is cut into (each piece adds two prefix sums)
MODES = ("down", "up", "nearest")  # `sonic_jax.routing.TOKEN_ROUNDINGS`


def supports(num_tokens: int, num_experts: int, added_per_expert: int) -> str | None:
  """None when the kernel takes this problem, else why not."""
  if not 1 <= num_tokens <= MAX_TOKENS:
    return f"T={num_tokens} is not in [1, {MAX_TOKENS}]"
  if num_experts < 1:
    return "no experts"
  if added_per_expert < 0:
    return f"added_per_expert={added_per_expert} is negative"
  return None


def row_chunk(num_tokens: int) -> int:
  """Keys per piece of the row (a power of two, at most `CHUNK`): the one that pads T least, the
  longest among equals. 40,960 tokens: 5 pieces of 8,192, no padding (16,384 would pad to
  49,152); 24,576: 3 of 8,192 (rather than 32,768 keys). Padding keys cost bisection work, more
  pieces cost prefix sums (docs/decisions.md has the figures)."""
  pow2 = next_pow2(num_tokens)
  pieces = {min(c, pow2) for c in (CHUNK, CHUNK // 2, MIN_CHUNK)}
  return min(pieces, key=lambda c: (padded_tokens(num_tokens, c), -c))


def padded_tokens(num_tokens: int, chunk: int | None = None) -> int:
  """The key row's length for `select` with this chunk (a power of two; `row_chunk(T)` by
  default): T rounded up to a power of two within one chunk, else to a multiple of the chunk. The
  kernel loads and stores the row a chunk at a time, and only those must be powers of two."""
  if chunk is None:
    chunk = row_chunk(num_tokens)
  if num_tokens <= chunk:
    return next_pow2(num_tokens)
  return -(-num_tokens // chunk) * chunk


def num_warps(num_tokens: int) -> int:
  """The program's warps: one per 32 * 64 keys, 4 to 16, then 32 once 16 warps would hold more
  than 96 keys a thread (T > 49,152)."""
  warps = max(4, min(16, next_pow2(num_tokens) // (32 * KEYS_PER_THREAD)))
  if padded_tokens(num_tokens) > warps * 32 * MAX_KEYS_PER_THREAD:
    warps *= 2
  return warps


def order_bits(v):
  """Non-negative integers (int64 for float64, else int32 of float32) ordered as the values are:
  1 + a float's bit pattern for v >= 0, -0.0 (and any negative) 1, NaN 0. Integer ops, so
  subnormals keep their order where XLA flushes them to zero. NaN ranks below every number: its
  bits rank above +inf's, so a token with NaN probabilities (a NaN in its row of x) would be every
  expert's first to add and its TC pairs the last to drop, spreading its NaN to every expert's
  weight gradients."""
  wide = v.dtype == jnp.float64
  v = v.astype(jnp.float64 if wide else jnp.float32)
  bits = lax.bitcast_convert_type(v, jnp.int64 if wide else jnp.int32)
  return jnp.where(jnp.isnan(v), 0, jnp.maximum(bits, 0) + 1)


def added_bound(mode: str, tile: int, num_tokens: int) -> int:
  """The most pairs the mode can add to one expert: its target is at most tile - 1 ("up") or
  tile // 2 ("nearest") past its TC count, and at most T."""
  return min({"down": 0, "up": tile - 1, "nearest": tile // 2}[mode], num_tokens)


def target_count(counts, tile: int, mode: str, num_tokens: int):
  """r_e: the TC count moved to a multiple of the tile ("nearest": half to even), at most T."""
  if mode == "down":
    return counts // tile * tile
  if mode == "up":
    return jnp.minimum((counts + tile - 1) // tile * tile, num_tokens)
  # Round half to even in integers: q = counts // tile, and up when the remainder passes half the
  # tile, or is exactly half with q odd.
  q, rem = counts // tile, counts % tile
  up = (2 * rem > tile) | ((2 * rem == tile) & (q % 2 == 1))
  return jnp.minimum((q + up.astype(q.dtype)) * tile, num_tokens)


def selection_keys(probs, expert_ids, scores, t_pad: int):
  """(E, t_pad) int32 keys (module doc) of a TC routing, t_pad = `padded_tokens(T, chunk)` for
  `select`; padding tokens get 0 (the kernel masks them). probs (T, E) and scores (T, K) are read
  without gradient. The probabilities' bits, transposed, then the TC pairs' keys scattered in
  (T * K unique places): a (T, K, E) comparison that finds the TC pairs in place costs several
  times more."""
  t_count, e_count = probs.shape
  probs = lax.stop_gradient(probs).astype(jnp.float32)
  scores = lax.stop_gradient(scores).astype(jnp.float32)
  keys = jnp.pad(order_bits(probs).T, ((0, 0), (0, t_pad - t_count)))
  valid = (expert_ids >= 0) & (expert_ids < e_count)
  token = lax.broadcasted_iota(jnp.int32, expert_ids.shape, 0)
  # Top-K's pairs are distinct; a pair routed nowhere goes past the rows, each to its own place.
  pair = token * expert_ids.shape[1] + lax.broadcasted_iota(jnp.int32, expert_ids.shape, 1)
  return keys.at[jnp.where(valid, expert_ids, e_count + pair), token].set(
      -order_bits(scores) - 1, mode="drop", unique_indices=True)


def _kernel(keys_ref, keep_ref, added_ref, *, num_tokens: int, tile: int, mode: str,
            added_per_expert: int, chunk: int):
  # The row as a few chunks of `chunk` keys: a prefix sum over a chunk takes SMEM for its length.
  pieces = range(keys_ref.shape[0] // chunk)
  span = lambda i: pl.ds(i * chunk, chunk)
  def total(parts):
    """The True count over the row's chunks: their counts added elementwise, then one block-wide
    reduction (the bisection's 31 rounds each pay one, whatever the number of chunks)."""
    parts = [p.astype(jnp.int32) for p in parts]
    return jnp.sum(functools.reduce(jnp.add, parts[1:], parts[0]))

  # Token indices are recomputed where used rather than held through the bisection.
  token = lambda i: lax.broadcasted_iota(jnp.int32, (chunk,), 0) + i * chunk
  key = [keys_ref[span(i)] for i in pieces]
  count = total((k < 0) & (token(i) < num_tokens) for i, k in zip(pieces, key))
  target = target_count(count, tile, mode, num_tokens)
  down = target <= count
  # The region the boundary lies in, and how many of its largest values the expert keeps there.
  take = jnp.where(down, target, target - count)
  # One int32 per token orders the region: ~key (= -key - 1, a TC score's bits) when dropping,
  # the key (an other token's probability bits) when adding; the other region's values and the
  # padding are negative, below every candidate. Only these values stay live through the
  # bisection (the key is value ^ flip again): a thread holds up to 96 of them in registers.
  flip = jnp.where(down, jnp.int32(-1), jnp.int32(0))
  value = [jnp.where(token(i) < num_tokens, k ^ flip, -1) for i, k in zip(pieces, key)]

  def bisect(state):
    i, threshold, _ = state
    candidate = threshold | (1 << (30 - i))
    at_or_above = total(v >= candidate for v in value)
    return (i + 1, jnp.where(at_or_above >= take, candidate, threshold),
            at_or_above == take)

  # The largest threshold with at least `take` values at or above it: the take-th largest value.
  # Once exactly `take` values are at or above a candidate, they are the chosen set (the take-th
  # largest and every value equal to it among them), so the search stops there: distinct scores
  # usually separate before the last bits.
  _, threshold, _ = lax.while_loop(lambda state: (state[0] < 31) & ~state[2], bisect,
                                   (jnp.int32(0), jnp.int32(0), jnp.bool_(False)))
  ties_wanted = take - total(v > threshold for v in value)

  def exclusive_ranks(masks):
    """Per chunk, each position's count of True before it in the row."""
    ranks, before = [], jnp.int32(0)
    for m in masks:
      m = m.astype(jnp.int32)
      ranks.append(jnp.cumsum(m) - m + before)
      before = before + jnp.sum(m)
    return ranks

  ties = [v == threshold for v in value]
  chosen = [((v > threshold) | (t & (r < ties_wanted))) & (take > 0)
            for v, t, r in zip(value, ties, exclusive_ranks(ties))]
  # A TC pair's key is negative (padding columns come out as TC when adding; they are cut off).
  for i, v, ch in zip(pieces, value, chosen):
    keep_ref[span(i)] = (((v ^ flip) < 0) & (ch | ~down)).astype(jnp.int8)
  if added_per_expert:
    added = [ch & ~down for ch in chosen]
    j_pad = added_ref.shape[0] // 2
    column = lax.broadcasted_iota(jnp.int32, (added_ref.shape[0],), 0)
    # Unused entries hold T; the scatters below write the used ones (disjoint columns). Lanes of
    # tokens not added are masked off but still need an address, and interpret mode writes their
    # old values back: they aim at a spare upper half that no used column shares.
    num_added = total(added)
    pltriton.store(added_ref, jnp.full(column.shape, num_tokens, jnp.int32),
                   mask=column >= num_added)

    @pl.when(num_added > 0)  # an expert rounding down adds none: no prefix sums
    def _():
      for i, a, r in zip(pieces, added, exclusive_ranks(added)):
        t = token(i)
        pltriton.store(added_ref.at[jnp.where(a, r, j_pad + (t & (j_pad - 1)))], t, mask=a)


@functools.partial(jax.jit, static_argnames=("num_tokens", "tile", "mode", "added_per_expert",
                                             "interpret", "chunk", "warps"))
def select(keys, *, num_tokens: int, tile: int, mode: str, added_per_expert: int,
           interpret: bool = False, chunk: int | None = None, warps: int | None = None):
  """(keep_tc (E, T) int8, added (E, J) int32) from `selection_keys` (E, padded_tokens(T,
  chunk)); J = added_per_expert, at least what the mode can add to one expert. chunk: keys per
  prefix sum (a power of two; `row_chunk(T)` by default). warps: the program's warps,
  `num_warps(T)` by default (set for tuning, `benchmarks.rounding_select_bench`)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if tile < 1:
    raise ValueError(f"tile must be >= 1, got {tile}")
  if chunk is None:
    chunk = row_chunk(num_tokens)
  if chunk < 1 or chunk & (chunk - 1) or chunk > CHUNK:
    raise ValueError(f"chunk must be a power of two of at most {CHUNK}, got {chunk}")
  if warps is not None and (warps < 1 or warps & (warps - 1) or warps > 32):
    raise ValueError(f"warps must be a power of two in [1, 32], got {warps}")
  e_count, t_pad = keys.shape
  reason = supports(num_tokens, e_count, added_per_expert)
  if reason is not None:
    raise ValueError(f"rounding selection kernel: {reason}")
  if t_pad != padded_tokens(num_tokens, chunk):
    raise ValueError(f"keys must be (E, {padded_tokens(num_tokens, chunk)}) for T={num_tokens} "
                     f"and chunk={chunk}, got {keys.shape}")
  bound = added_bound(mode, tile, num_tokens)
  if added_per_expert < bound:  # the added tokens' scatter would run past the expert's columns
    raise ValueError(f"added_per_expert={added_per_expert} is below what mode={mode!r} can add "
                     f"to one expert ({bound})")
  j_pad = next_pow2(max(added_per_expert, 1))
  keep, added = pl.pallas_call(
      functools.partial(_kernel, num_tokens=num_tokens, tile=tile, mode=mode,
                        added_per_expert=added_per_expert, chunk=min(t_pad, chunk)),
      out_shape=(jax.ShapeDtypeStruct((e_count, t_pad), jnp.int8),
                 jax.ShapeDtypeStruct((e_count, 2 * j_pad), jnp.int32)),
      grid=(e_count,),
      in_specs=[pl.BlockSpec((None, t_pad), lambda e: (e, 0))],
      out_specs=(pl.BlockSpec((None, t_pad), lambda e: (e, 0)),
                 pl.BlockSpec((None, 2 * j_pad), lambda e: (e, 0))),
      compiler_params=pltriton.CompilerParams(num_warps=warps or num_warps(num_tokens),
                                              num_stages=1),
      name="rounding_select",
      interpret=interpret,
  )(keys)
  return keep[:, :num_tokens], added[:, :added_per_expert]
