"""Where every (token, expert) pair goes in the grouped buffer: a counting sort in two Pallas passes.

`sonic_jax.layout.build_grouped_layout` places the pairs with a stable argsort of their expert ids
and a handful of scatters: on an H100 that is 0.15-0.19 ms of XLA kernels per forward, most of it
the sort, for at most 0.5 M pairs. Expert ids are small integers, so a counting sort does it in
two passes over the ids (Pallas's Triton lowering, as `router_topk`):

1. `block_counts`: each program counts the expert ids of its PAIRS_PER_PROGRAM pairs (a one-hot
   compare and a column sum, SUB pairs at a time) into one row of a (blocks, E) table.
2. Between the passes XLA turns the table into each block's first free row per expert (the
   expert's first grouped row plus an exclusive prefix over the blocks: a few hundred rows).
3. `place`: each program walks its pairs in order, SUB at a time, with that row vector in
   registers: a pair of expert e goes to next[e] plus the number of earlier pairs of e among the SUB
   (a lower-triangular compare). It writes pair_row and scatters row_pair and row_token, whose
   padding entries were filled beforehand.

The placement is the stable sort's: inside an expert, pairs keep their flat order, so the layout
is identical to the argsort path (tested). Ids outside [0, E) are 'no expert'. Reference: the
argsort path in `sonic_jax.layout`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax.pallas.router_topk import AVAILABLE, pltriton

PAIRS_PER_PROGRAM = 2048
MAX_EXPERTS = 1024
_ELEMENTS_PER_STEP = 32768  # (SUB, bins) int32 one-hot per step: 128 per thread of 8 warps
_NUM_WARPS = 8

__all__ = ["AVAILABLE", "supports", "place_pairs"]


def _bins(num_experts: int) -> int:
  return 1 << (num_experts - 1).bit_length()  # Triton blocks are powers of two


def _sub(bins: int) -> int:
  return max(16, min(128, _ELEMENTS_PER_STEP // bins))


def supports(num_pairs: int, num_experts: int) -> str | None:
  """None when the kernels handle this problem, else the reason they do not."""
  if num_pairs < 1:
    return "no pairs"
  if not 1 <= num_experts <= MAX_EXPERTS:
    return f"E={num_experts} is not in [1, {MAX_EXPERTS}]"
  if num_pairs >= 2**31 - PAIRS_PER_PROGRAM:
    return f"{num_pairs} pairs overflow int32 row indices"
  return None


def _one_hot(ids, bins):
  return ids[:, None] == lax.broadcasted_iota(jnp.int32, (ids.shape[0], bins), 1)


def _count_kernel(ids_ref, counts_ref, *, bins: int, sub: int):
  base = pl.program_id(0) * PAIRS_PER_PROGRAM

  def step(j, counts):
    ids = ids_ref[pl.ds(base + j * sub, sub)]
    return counts + jnp.sum(_one_hot(ids, bins).astype(jnp.int32), axis=0)

  counts_ref[0, :] = lax.fori_loop(0, PAIRS_PER_PROGRAM // sub, step,
                                   jnp.zeros((bins,), jnp.int32))


def _place_kernel(ids_ref, token_ref, first_row_ref, _row_pair_in, _row_token_in,
                  pair_row_ref, row_pair_ref, row_token_ref, *, num_experts: int, num_rows: int,
                  bins: int, sub: int):
  del _row_pair_in, _row_token_in  # aliased with row_pair_ref / row_token_ref
  base = pl.program_id(0) * PAIRS_PER_PROGRAM
  lane = lax.broadcasted_iota(jnp.int32, (sub, sub), 0)
  earlier = lax.broadcasted_iota(jnp.int32, (sub, sub), 1) < lane

  def step(j, next_row):
    start = base + j * sub
    ids = ids_ref[pl.ds(start, sub)]
    hot = _one_hot(ids, bins)
    row = jnp.sum(jnp.where(hot, next_row[None, :], 0), axis=1)
    row += jnp.sum((ids[:, None] == ids[None, :]) & earlier, axis=1, dtype=jnp.int32)
    valid = (ids >= 0) & (ids < num_experts)
    pair_row_ref[pl.ds(start, sub)] = jnp.where(valid, row, num_rows)
    # Pairs routed nowhere write to the spare last entry, not through a mask: the interpreter's
    # masked scatter writes the old value back and could clobber a valid lane's row.
    target = jnp.where(valid, row, num_rows)
    row_pair_ref[target] = start + lax.broadcasted_iota(jnp.int32, (sub,), 0)
    row_token_ref[target] = token_ref[pl.ds(start, sub)]
    return next_row + jnp.sum(hot.astype(jnp.int32), axis=0)

  lax.fori_loop(0, PAIRS_PER_PROGRAM // sub, step, first_row_ref[0, :])


@functools.partial(jax.jit, static_argnames=("num_experts", "row_tile", "num_rows", "interpret"))
def place_pairs(expert_ids, pair_token, num_experts: int, row_tile: int, num_rows: int,
                interpret: bool = False):
  """The counting-sort placement of P pairs.

  expert_ids: (P,) int32, ids outside [0, E) for pairs routed nowhere; pair_token: (P,) int32.
  Returns (pair_row (P,): grouped row, num_rows for pairs routed nowhere; row_pair (num_rows,):
  pair of each row, -1 for padding; row_token (num_rows,): token of each row, 0 for padding;
  counts (E,): pairs per expert).
  """
  reason = supports(expert_ids.shape[0], num_experts)
  if reason is not None:
    raise ValueError(f"pair placement kernel: {reason}")
  (p,) = expert_ids.shape
  bins, sub = _bins(num_experts), _sub(_bins(num_experts))
  padded = p + -p % PAIRS_PER_PROGRAM
  ids = jnp.where((expert_ids >= 0) & (expert_ids < num_experts), expert_ids, bins)
  ids = jnp.pad(ids.astype(jnp.int32), (0, padded - p), constant_values=bins)
  tokens = jnp.pad(pair_token.astype(jnp.int32), (0, padded - p))
  blocks = padded // PAIRS_PER_PROGRAM
  params = pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1)

  block_counts = pl.pallas_call(
      functools.partial(_count_kernel, bins=bins, sub=sub),
      out_shape=jax.ShapeDtypeStruct((blocks, bins), jnp.int32),
      grid=(blocks,),
      out_specs=pl.BlockSpec((1, bins), lambda b: (b, 0)),
      compiler_params=params, interpret=interpret,
  )(ids)

  counts = jnp.sum(block_counts, axis=0)[:num_experts]
  group_sizes = (counts + row_tile - 1) // row_tile * row_tile
  expert_first_row = jnp.pad(jnp.cumsum(group_sizes) - group_sizes, (0, bins - num_experts))
  first_row = expert_first_row[None, :] + jnp.cumsum(block_counts, axis=0) - block_counts

  pair_row, row_pair, row_token = pl.pallas_call(
      functools.partial(_place_kernel, num_experts=num_experts, num_rows=num_rows, bins=bins,
                        sub=sub),
      out_shape=(jax.ShapeDtypeStruct((padded,), jnp.int32),
                 jax.ShapeDtypeStruct((num_rows + 1,), jnp.int32),
                 jax.ShapeDtypeStruct((num_rows + 1,), jnp.int32)),
      grid=(blocks,),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2
      + [pl.BlockSpec((1, bins), lambda b: (b, 0))] + [pl.BlockSpec(memory_space=pl.ANY)] * 2,
      out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 3,
      input_output_aliases={3: 1, 4: 2},
      compiler_params=params, interpret=interpret,
  )(ids, tokens, first_row, jnp.full((num_rows + 1,), -1, jnp.int32),
    jnp.zeros((num_rows + 1,), jnp.int32))
  return pair_row[:p], row_pair[:num_rows], row_token[:num_rows], counts
