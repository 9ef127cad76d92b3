"""Block counts and in-block ranks of routed pairs: the counting sort behind the grouped layout.

The grouped layout places pair p = t*S + s (token t, slot s, expert e = ids[t, s]) at
row_start[e] + (number of pairs before p that go to e): a stable counting sort by expert. Split the
tokens into blocks of `bt`; then that count is (pairs of e in earlier blocks) + (pairs of e before
p in p's block). This kernel gives the second term (`ranks`, (T, S)) and each block's per-expert
totals (`block_counts`, (T / bt, E)); the layout adds a prefix sum over blocks (XLA, small).

One Pallas (Triton) program per block of tokens, everything in registers, no atomics and no sort:
the (bt, E) matrix of how often each token picked each expert, an exclusive prefix sum down its
tokens (pairs of e in earlier tokens of the block), and for each slot that matrix's entry at the
slot's expert plus the earlier slots of the same token with the same expert (repeated ids happen
only in hand-made routings; top-K never repeats). Where it applies (`layout.build_grouped_layout`'s
"block_ranks") it stands in for the layout's radix sort and about a dozen small XLA kernels.

Ids outside [0, E) count nowhere (their rank is meaningless; the layout masks them). Uses Pallas's
Triton lowering, deprecated in jax 0.11 but present in 0.11.2; `AVAILABLE` is False where it is
gone, and the layout sorts instead. Reference: `block_ranks_reference`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax.pallas import TRITON_AVAILABLE, next_pow2, pltriton

AVAILABLE = TRITON_AVAILABLE  # without the Triton lowering the layout sorts

MAX_EXPERTS = 1024
MAX_SLOTS = 32  # the per-slot loops are unrolled
VALUES_PER_PROGRAM = 4096  # (tokens, E) counts per program: 16 int32 words per thread of 4 warps


def block_tokens(num_experts: int) -> int:
  """Tokens per program (a power of two): the (tokens, E) count matrix stays in registers."""
  return max(16, min(128, VALUES_PER_PROGRAM // next_pow2(num_experts)))


def supports(expert_ids: jax.Array, num_experts: int) -> str | None:
  """None when the kernel handles this routing, else the reason it does not."""
  if expert_ids.ndim != 2:
    return f"expert_ids must be (T, S), got shape {expert_ids.shape}"
  if expert_ids.dtype != jnp.int32:
    return f"expert_ids dtype {expert_ids.dtype} (the kernel takes int32)"
  if not 1 <= num_experts <= MAX_EXPERTS:
    return f"E={num_experts} is not in [1, {MAX_EXPERTS}]"
  if not 1 <= expert_ids.shape[1] <= MAX_SLOTS:
    return f"S={expert_ids.shape[1]} slots is not in [1, {MAX_SLOTS}]"
  if expert_ids.shape[0] < 1:
    return "no tokens"
  return None


def _kernel(ids_ref, ranks_ref, counts_ref, *, slots: int):
  ids = ids_ref[...]  # (bt, S_block)
  bt, half_e = ids.shape[0], counts_ref.shape[1]
  # Two experts per int32 (expert 2c in the low 16 bits of column c, 2c + 1 in the high ones):
  # half the compares, selects and sums of one expert per lane. A field holds at most bt * S
  # <= 4096 pairs, so sums never carry into the next field.
  column = lax.broadcasted_iota(jnp.int32, (bt, half_e), 1)
  slot = lax.broadcasted_iota(jnp.int32, ids.shape, 1)
  # Column s of the block, as a (bt,) vector (Triton has no register column slice).
  cols = [jnp.sum(jnp.where(slot == s, ids, 0), axis=1) for s in range(slots)]
  fields = [(col >> 1, (col & 1) * 16) for col in cols]  # ids < 0 match no column
  picks = jnp.zeros((bt, half_e), jnp.int32)  # how often token t picked each expert
  for c, shift in fields:
    picks += jnp.where(column == c[:, None], (1 << shift)[:, None], 0)
  before = jnp.cumsum(picks, axis=0) - picks  # pairs of each expert in the earlier tokens
  ranks = jnp.zeros(ids.shape, jnp.int32)
  for s, (c, shift) in enumerate(fields):
    rank = (jnp.sum(jnp.where(column == c[:, None], before, 0), axis=1) >> shift) & 0xFFFF
    for earlier in cols[:s]:  # the same token's earlier slots with the same expert
      rank += (earlier == cols[s]).astype(jnp.int32)
    ranks = jnp.where(slot == s, rank[:, None], ranks)
  ranks_ref[...] = ranks
  counts_ref[...] = jnp.sum(picks, axis=0)[None, :]


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def block_ranks(expert_ids: jax.Array, num_experts: int, interpret: bool = False):
  """(ranks (T, S) int32, block_counts (ceil(T / bt), E) int32) of expert_ids (T, S) int32.

  ranks[t, s]: pairs before (t, s) in its token block (flat pair order) with the same expert;
  block_counts[b, e]: pairs of expert e in token block b; bt = `block_tokens(E)`.
  """
  reason = supports(expert_ids, num_experts)
  if reason is not None:
    raise ValueError(f"layout block-rank kernel: {reason}")
  t, s = expert_ids.shape
  bt = block_tokens(num_experts)
  s_block, half_e = next_pow2(s), max(1, next_pow2(num_experts) // 2)
  padded = expert_ids
  if t % bt or s_block != s:  # Triton blocks are powers of two: pad with 'no expert'
    padded = jnp.pad(expert_ids, ((0, -t % bt), (0, s_block - s)), constant_values=-1)
  blocks = padded.shape[0] // bt
  ranks, counts = pl.pallas_call(
      functools.partial(_kernel, slots=s),
      out_shape=(jax.ShapeDtypeStruct(padded.shape, jnp.int32),
                 jax.ShapeDtypeStruct((blocks, half_e), jnp.int32)),
      grid=(blocks,),
      in_specs=[pl.BlockSpec((bt, s_block), lambda i: (i, 0))],
      out_specs=(pl.BlockSpec((bt, s_block), lambda i: (i, 0)),
                 pl.BlockSpec((1, half_e), lambda i: (i, 0))),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      name="layout_ranks",
      interpret=interpret,
  )(padded)
  counts = jnp.stack([counts & 0xFFFF, counts >> 16], axis=-1).reshape(blocks, 2 * half_e)
  return ranks[:t, :s], counts[:, :num_experts]


def block_ranks_reference(expert_ids, num_experts: int, bt: int):
  """NumPy reference of `block_ranks` with bt tokens per block (ranks of invalid ids are 0)."""
  import numpy as np
  ids = np.asarray(expert_ids)
  t, s = ids.shape
  ranks = np.zeros((t, s), np.int32)
  counts = np.zeros((-(-t // bt), num_experts), np.int32)
  for b in range(counts.shape[0]):
    seen = np.zeros(num_experts, np.int32)
    for p, e in enumerate(ids[b * bt:(b + 1) * bt].reshape(-1)):  # flat pair order
      if 0 <= e < num_experts:
        ranks[b * bt + p // s, p % s] = seen[e]
        seen[e] += 1
    counts[b] = seen
  return ranks, counts
