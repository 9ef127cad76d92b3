"""Token rounding's selection: which token-choice pairs each expert drops, which tokens it adds.

Token rounding (`sonic_jax.routing.round_tokens`) gives expert e a target count r_e, a multiple of
the tile near its token-choice (TC) count c_e, and keeps the first r_e tokens of its ranking: its
TC tokens by score, then the others by probability, ties to the lower token. When r_e <= c_e that
drops the m_e = c_e - r_e last of its TC tokens (lowest score, ties to the higher token); when
r_e > c_e it adds the m_e = r_e - c_e first others (highest probability, ties to the lower
token). Either way m_e is at most a tile, and the pick is the top m_e of one region of the
expert's column of the (T, E) routing under a strict order: a 31-bit priority u (the probability's
bits; for a drop, the score's bits subtracted from 2^31 - 1), then token order.

Two Pallas (Triton) passes, no sort and no transposed copy of the probabilities:
- `_block_top`: a program per block of tokens and experts reads the probabilities (T, E) and the
  TC pairs (T, K) in place and writes each column's top m_e within the block (at most a tile of
  candidates, in token order), found by bisection over u's bits with a count per column.
- `_merge_top`: a program per expert picks the top m_e among its blocks' candidates the same way.
  It writes the added tokens in increasing order and, for a drop, the pick's boundary (threshold
  and tie position), from which an elementwise pass over the (T, K) pairs marks the dropped ones.
The top m of a union is the top m of the blocks' top-m lists, since the order is strict.

Pallas's Triton lowering is deprecated in jax 0.11 but present in 0.11.2; `AVAILABLE` is False
where it is gone, and rounding uses the XLA path. Reference: `sonic_jax.routing.round_tokens` with
method="xla".
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax.pallas import TRITON_AVAILABLE, next_pow2, pltriton

AVAILABLE = TRITON_AVAILABLE  # without the Triton lowering rounding uses XLA

MODES = ("down", "up", "nearest")  # `sonic_jax.routing.TOKEN_ROUNDINGS`
TOKEN_BLOCK = 1024  # tokens per `_block_top` program
EXPERT_BLOCK = 8  # experts per `_block_top` program: 32-byte pieces of each (T, E) row
MAX_CANDIDATES = 32768  # the merge holds one expert's candidates in registers
_TOP = 0x7FFFFFFF  # 2^31 - 1: a drop's priority is _TOP - bits(score)


def moved_bound(mode: str, tile: int, num_tokens: int | None = None) -> int:
  """The most pairs the mode adds to or drops from one expert (at most T when given)."""
  bound = {"down": tile - 1, "up": tile - 1, "nearest": tile // 2}[mode]
  return bound if num_tokens is None else min(bound, num_tokens)


def added_bound(mode: str, tile: int, num_tokens: int | None = None) -> int:
  """The most pairs the mode can add to one expert: its target is at most tile - 1 ("up") or
  tile // 2 ("nearest") past its TC count, and at most T."""
  bound = {"down": 0, "up": tile - 1, "nearest": tile // 2}[mode]
  return bound if num_tokens is None else min(bound, num_tokens)


def _layout(num_tokens: int, mode: str, tile: int, token_block: int):
  """(blocks, slots): token blocks rounded up to a power of two, and candidate slots per block and
  expert (a power of two at least the moved bound). Each block's slots are followed by as many
  spare ones (see `_block_top`)."""
  blocks = next_pow2(-(-num_tokens // token_block))
  return blocks, next_pow2(max(moved_bound(mode, tile, num_tokens), 1))


def supports(num_tokens: int, num_experts: int, added_per_expert: int, *, mode: str = "up",
             tile: int = 128, token_block: int = TOKEN_BLOCK) -> str | None:
  """None when the kernels take this problem, else why not."""
  if num_tokens < 1:
    return f"T={num_tokens} is not positive"
  if num_experts < 1:
    return "no experts"
  if added_per_expert < 0:
    return f"added_per_expert={added_per_expert} is negative"
  blocks, slots = _layout(num_tokens, mode, tile, token_block)
  if blocks * 2 * slots > MAX_CANDIDATES:
    return (f"T={num_tokens} with tile={tile} ({mode!r}) gives {blocks * 2 * slots} candidate "
            f"slots per expert, over {MAX_CANDIDATES}")
  return None


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


def _bits(v):
  """A float's bits as int32, negative values (and -0.0) as 0: non-negative floats' bit patterns
  order as the values do."""
  b = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
  return jnp.where(b < 0, 0, b)


def _top(u, take, tie_first, axis, bits_per_round=1):
  """The top `take` of u along `axis` (per column) under (u descending, then position ascending,
  or descending where `tie_first` is False); u < 0 never. Returns the chosen mask. Bisection over
  u's 31 bits, `bits_per_round` at a time (2^b - 1 counts per round, independent): the largest
  threshold with at least `take` values at or above it, stopping once exactly `take` are
  (distinct values usually separate before the last bits); a column whose candidates are at most
  `take` takes them all."""
  count = lambda mask: jnp.sum(mask.astype(jnp.int32), axis=axis)
  expand = lambda v: jnp.expand_dims(v, axis)
  take = jnp.maximum(take, 0)
  done = (count(u >= 0) <= take) | (take == 0)
  rounds = -(-31 // bits_per_round)

  def body(state):
    r, threshold, done = state
    low = jnp.maximum(31 - (r + 1) * bits_per_round, 0)
    width = 31 - r * bits_per_round - low
    best, exact = threshold, done
    for j in range(1, 1 << bits_per_round):
      candidate = threshold | (j << low)
      at_or_above = count(u >= expand(candidate))
      fits = (j < (1 << width)) & (at_or_above >= take)
      best = jnp.where(fits & ~done, candidate, best)
      exact = exact | (fits & (at_or_above == take))
    return r + 1, best, exact

  _, threshold, _ = lax.while_loop(
      lambda state: (state[0] < rounds) & (jnp.sum((~state[2]).astype(jnp.int32)) > 0), body,
      (jnp.int32(0), jnp.zeros_like(take), done))
  above = u > expand(threshold)
  ties = (u == expand(threshold)).astype(jnp.int32)
  before = jnp.cumsum(ties, axis=axis) - ties
  rank = jnp.where(expand(tie_first), before, expand(count(ties)) - before - ties)
  return (above | ((ties > 0) & (rank < expand(take - count(above))))) & expand(take > 0)




def _block_kernel(probs_ref, ids_ref, scores_ref, take_ref, down_ref, cand_u_ref, cand_t_ref, *,
                  num_tokens: int, token_block: int, expert_block: int, blocks: int, slots: int,
                  bits_per_round: int):
  i, j = pl.program_id(0), pl.program_id(1)
  num_experts, top_k = probs_ref.shape[1], ids_ref.shape[1]
  rows = pl.ds(i * token_block, token_block)
  cols = pl.ds(j * expert_block, expert_block)
  token = i * token_block + lax.broadcasted_iota(jnp.int32, (token_block,), 0)
  expert = j * expert_block + lax.broadcasted_iota(jnp.int32, (expert_block,), 0)
  real_t, real_e = token < num_tokens, expert < num_experts
  real = real_t[:, None] & real_e[None, :]
  probs = pltriton.load(probs_ref.at[rows, cols], mask=real, other=0.0)
  take = pltriton.load(take_ref.at[cols], mask=real_e, other=0)
  down = pltriton.load(down_ref.at[cols], mask=real_e, other=0) > 0
  # The TC pairs' score bits in place, -1 where the token did not choose the expert.
  tc_bits = jnp.full((token_block, expert_block), -1, jnp.int32)
  for k in range(top_k):  # (token_block, 1) columns
    column = (rows, pl.ds(k, 1))
    ids = pltriton.load(ids_ref.at[column], mask=real_t[:, None], other=-1)
    score = _bits(pltriton.load(scores_ref.at[column], mask=real_t[:, None], other=0.0))
    tc_bits = jnp.where(ids == expert[None, :], score, tc_bits)
  tc = tc_bits >= 0
  u = jnp.where(down[None, :], jnp.where(tc, _TOP - tc_bits, -1),
                jnp.where(tc | ~real, -1, _bits(probs)))
  chosen = _top(u, take, ~down, axis=0, bits_per_round=bits_per_round)
  # Candidates in token order into this block's slots; the rest of them (and the spare slots) -1.
  picked = chosen.astype(jnp.int32)
  slot = jnp.cumsum(picked, axis=0) - picked
  base = (expert * blocks + i) * (2 * slots)  # (expert_block,): this block's slots per expert
  column = lax.broadcasted_iota(jnp.int32, (expert_block, 2 * slots), 1)
  unused = column >= jnp.sum(picked, axis=0)[:, None]
  for ref in (cand_u_ref, cand_t_ref):
    pltriton.store(ref.at[base[:, None] + column], jnp.full(column.shape, -1, jnp.int32),
                   mask=unused & real_e[:, None])
  # Lanes not chosen are masked off but still need an address, and interpret mode writes their old
  # values back: they aim at the spare slots, which no chosen lane shares.
  dest = base[None, :] + jnp.where(chosen, slot, slots + (token[:, None] & (slots - 1)))
  pltriton.store(cand_u_ref.at[dest], u, mask=chosen)
  pltriton.store(cand_t_ref.at[dest], jnp.broadcast_to(token[:, None], u.shape), mask=chosen)


def _top_columns(us, takes, tie_firsts, bits_per_round=1):
  """`_top` of several 1-D columns at once: one bisection loop whose rounds count every column
  still searching (independent reductions)."""
  count = lambda mask: jnp.sum(mask.astype(jnp.int32))
  takes = [jnp.maximum(t, 0) for t in takes]
  dones = tuple((count(u >= 0) <= t) | (t == 0) for u, t in zip(us, takes))
  rounds = -(-31 // bits_per_round)

  def body(state):
    r, thresholds, dones = state
    low = jnp.maximum(31 - (r + 1) * bits_per_round, 0)
    width = 31 - r * bits_per_round - low
    new_t, new_d = [], []
    for u, take, threshold, done in zip(us, takes, thresholds, dones):
      best, exact = threshold, done
      for j in range(1, 1 << bits_per_round):
        candidate = threshold | (j << low)
        at_or_above = count(u >= candidate)
        fits = (j < (1 << width)) & (at_or_above >= take)
        best = jnp.where(fits & ~done, candidate, best)
        exact = exact | (fits & (at_or_above == take))
      new_t.append(best)
      new_d.append(exact)
    return r + 1, tuple(new_t), tuple(new_d)

  def searching(state):
    left = functools.reduce(jnp.add, [(~d).astype(jnp.int32) for d in state[2]])
    return (state[0] < rounds) & (left > 0)

  _, thresholds, _ = lax.while_loop(
      searching, body, (jnp.int32(0), tuple(jnp.int32(0) for _ in us), dones))
  out = []
  for u, take, tie_first, threshold in zip(us, takes, tie_firsts, thresholds):
    above = u > threshold
    ties = (u == threshold).astype(jnp.int32)
    before = jnp.cumsum(ties) - ties
    rank = jnp.where(tie_first, before, count(ties) - before - ties)
    out.append((above | ((ties > 0) & (rank < take - count(above)))) & (take > 0))
  return out


def _block_kernel_1d(probs_ref, ids_ref, scores_ref, take_ref, down_ref, cand_u_ref, cand_t_ref,
                     *, num_tokens: int, token_block: int, expert_block: int, blocks: int,
                     slots: int, bits_per_round: int):
  i, j = pl.program_id(0), pl.program_id(1)
  num_experts, top_k = probs_ref.shape[1], ids_ref.shape[1]
  rows = pl.ds(i * token_block, token_block)
  token = i * token_block + lax.broadcasted_iota(jnp.int32, (token_block,), 0)
  real_t = token < num_tokens
  ids = [pltriton.load(ids_ref.at[rows, jnp.int32(k)], mask=real_t, other=-1)
         for k in range(top_k)]
  score = [_bits(pltriton.load(scores_ref.at[rows, jnp.int32(k)], mask=real_t, other=0.0))
           for k in range(top_k)]
  us, takes, downs, reals = [], [], [], []
  for c in range(expert_block):
    expert = j * expert_block + c
    real_e = expert < num_experts
    e_safe = jnp.minimum(expert, num_experts - 1)
    probs = pltriton.load(probs_ref.at[rows, e_safe], mask=real_t & real_e, other=0.0)
    take = jnp.where(real_e, take_ref[e_safe], 0)
    down = down_ref[e_safe] > 0
    tc_bits = jnp.full((token_block,), -1, jnp.int32)
    for k in range(top_k):
      tc_bits = jnp.where(ids[k] == expert, score[k], tc_bits)
    tc = tc_bits >= 0
    us.append(jnp.where(down, jnp.where(tc, _TOP - tc_bits, -1),
                        jnp.where(tc | ~real_t, -1, _bits(probs))))
    takes.append(take)
    downs.append(down)
    reals.append(real_e)
  chosen = _top_columns(us, takes, [~d for d in downs], bits_per_round)
  column = lax.broadcasted_iota(jnp.int32, (2 * slots,), 0)
  for c in range(expert_block):
    picked = chosen[c].astype(jnp.int32)
    base = ((j * expert_block + c) * blocks + i) * (2 * slots)
    for ref in (cand_u_ref, cand_t_ref):
      pltriton.store(ref.at[base + column], jnp.full(column.shape, -1, jnp.int32),
                     mask=(column >= jnp.sum(picked)) & reals[c])
    dest = base + jnp.where(chosen[c], jnp.cumsum(picked) - picked,
                            slots + (token & (slots - 1)))
    pltriton.store(cand_u_ref.at[dest], us[c], mask=chosen[c])
    pltriton.store(cand_t_ref.at[dest], token, mask=chosen[c])


def _merge_kernel(cand_u_ref, cand_t_ref, take_ref, down_ref, added_ref, bound_ref, *,
                  num_tokens: int, added_slots: int, bits_per_round: int):
  e = pl.program_id(0)
  u, token = cand_u_ref[...], cand_t_ref[...]
  take, down = take_ref[e], down_ref[e] > 0
  chosen = _top(u, take, ~down, axis=0, bits_per_round=bits_per_round)
  # A drop's boundary, the last chosen pair: a pair is dropped when its u is above the least chosen
  # u, or equal to it with its tie position (T - 1 - token) below the chosen ones' largest plus
  # one. Nothing is dropped past (_TOP, 0).
  threshold = jnp.min(jnp.where(chosen & down, u, _TOP))
  tie_end = jnp.max(jnp.where(chosen & down & (u == threshold), num_tokens - token, 0))
  pltriton.store(bound_ref.at[2 * e], threshold)
  pltriton.store(bound_ref.at[2 * e + 1], tie_end)
  if added_slots:
    added = chosen & ~down
    picked = added.astype(jnp.int32)
    column = lax.broadcasted_iota(jnp.int32, (2 * added_slots,), 0)
    pltriton.store(added_ref, jnp.full(column.shape, num_tokens, jnp.int32),
                   mask=column >= jnp.sum(picked))
    # Masked lanes aim at the spare upper half, as in `_block_kernel`.
    position = lax.broadcasted_iota(jnp.int32, u.shape, 0)
    dest = jnp.where(added, jnp.cumsum(picked) - picked,
                     added_slots + (position & (added_slots - 1)))
    pltriton.store(added_ref.at[dest], token, mask=added)


@functools.partial(jax.jit, static_argnames=("tile", "mode", "added_per_expert", "interpret",
                                             "token_block", "expert_block", "block_bits",
                                             "merge_bits", "block_warps", "columns"))
def select(probs, expert_ids, scores, *, tile: int, mode: str, added_per_expert: int,
           interpret: bool = False, token_block: int = TOKEN_BLOCK,
           expert_block: int = EXPERT_BLOCK, block_bits: int = 1, merge_bits: int = 1,
           block_warps: int | None = None, columns: bool = False):
  """(keep (T, K) bool, added (E, J) int32) of token rounding (module doc): keep says which TC
  pairs stay (pairs routed nowhere, expert id outside [0, E), stay as they are), added the tokens
  each expert adds in increasing order, T past its last; J = added_per_expert, at least what the
  mode can add to one expert. probs (T, E), expert_ids (T, K), scores (T, K), read without
  gradient. token_block, expert_block: the first pass's block (powers of two)."""
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  if tile < 1:
    raise ValueError(f"tile must be >= 1, got {tile}")
  for name, v in (("token_block", token_block), ("expert_block", expert_block)):
    if v < 1 or v & (v - 1):
      raise ValueError(f"{name} must be a power of two, got {v}")
  t_count, e_count = probs.shape
  if expert_ids.shape != scores.shape or expert_ids.shape[0] != t_count:
    raise ValueError(f"expert_ids {expert_ids.shape} and scores {scores.shape} must both be "
                     f"(T, K) with T = probs.shape[0] = {t_count}")
  reason = supports(t_count, e_count, added_per_expert, mode=mode, tile=tile,
                    token_block=token_block)
  if reason is not None:
    raise ValueError(f"rounding selection kernel: {reason}")
  bound = added_bound(mode, tile, t_count)
  if added_per_expert < bound:  # the added tokens' scatter would run past the expert's columns
    raise ValueError(f"added_per_expert={added_per_expert} is below what mode={mode!r} can add "
                     f"to one expert ({bound})")
  probs = lax.stop_gradient(probs).astype(jnp.float32)
  scores = lax.stop_gradient(scores).astype(jnp.float32)
  ids = expert_ids.astype(jnp.int32)
  valid = (ids >= 0) & (ids < e_count)
  # A compare-and-sum over (T, K, E), not a scatter-add histogram: T * K atomics on E counters.
  counts = jnp.sum(ids[..., None] == lax.broadcasted_iota(jnp.int32, (1, 1, e_count), 2),
                   axis=(0, 1), dtype=jnp.int32)
  target = target_count(counts, tile, mode, t_count)
  down = (target <= counts).astype(jnp.int32)
  take = jnp.abs(target - counts)

  blocks, slots = _layout(t_count, mode, tile, token_block)
  e_pad = -(-e_count // expert_block) * expert_block
  width = blocks * 2 * slots
  cand = jax.ShapeDtypeStruct((e_pad * width,), jnp.int32)
  cand_u, cand_t = pl.pallas_call(
      functools.partial(_block_kernel_1d if columns else _block_kernel, num_tokens=t_count, token_block=token_block,
                        expert_block=expert_block, blocks=blocks, slots=slots,
                        bits_per_round=block_bits),
      out_shape=(cand, cand),
      grid=(blocks, e_pad // expert_block),
      compiler_params=pltriton.CompilerParams(
          num_warps=block_warps or max(1, min(8, token_block * expert_block // 2048)),
          num_stages=1),
      interpret=interpret,
  )(probs, ids, scores, take, down)

  added_slots = next_pow2(added_per_expert) if added_per_expert else 0
  row = lambda: pl.BlockSpec((None, width), lambda e: (e, 0))
  added, bounds = pl.pallas_call(
      functools.partial(_merge_kernel, num_tokens=t_count, added_slots=added_slots,
                        bits_per_round=merge_bits),
      out_shape=(jax.ShapeDtypeStruct((e_count, 2 * max(added_slots, 1)), jnp.int32),
                 jax.ShapeDtypeStruct((2 * e_count,), jnp.int32)),
      grid=(e_count,),
      in_specs=[row(), row(), pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=(pl.BlockSpec((None, 2 * max(added_slots, 1)), lambda e: (e, 0)),
                 pl.BlockSpec(memory_space=pl.ANY)),
      compiler_params=pltriton.CompilerParams(num_warps=max(4, min(32, width // 1024)),
                                              num_stages=1),
      interpret=interpret,
  )(cand_u.reshape(e_pad, width), cand_t.reshape(e_pad, width), take, down)

  # A TC pair is dropped when its expert rounds down and it lies past the merge's boundary.
  threshold, tie_end = bounds[0::2], bounds[1::2]
  e = jnp.where(valid, ids, 0)
  u = _TOP - _bits(scores)
  position = (t_count - 1) - lax.broadcasted_iota(jnp.int32, ids.shape, 0)
  dropped = valid & (down[e] > 0) & (take[e] > 0) & (
      (u > threshold[e]) | ((u == threshold[e]) & (position < tie_end[e])))
  return ~dropped, added[:, :added_per_expert]
