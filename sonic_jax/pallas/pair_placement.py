"""Where every (token, expert) pair goes in the grouped buffer: a counting sort in two Pallas passes.

`sonic_jax.layout.build_grouped_layout` places the pairs with a stable argsort of their expert ids
and a handful of scatters: on an H100 that is 0.15-0.19 ms of XLA kernels per forward, most of it
the sort, for at most 0.5 M pairs. Expert ids are small integers, so a counting sort does it in
two passes over the ids (Pallas's Triton lowering, as `router_topk`):

1. Counting: each program counts the expert ids of its PAIRS_PER_PROGRAM pairs into one row of a
   (blocks, E) table, SUB pairs at a time: a (SUB, SUB) compare gives every pair the number of
   equal ids before and after it in the step, and the last pair of each id adds to its count (one
   writer per id, no atomics; the work does not grow with E).
2. Between the passes XLA turns the table into each block's first free row per expert (the
   expert's first grouped row plus an exclusive prefix over the blocks: a few hundred rows).
3. Placing: each program walks its pairs the same way with its row of that table: a pair of
   expert e goes to next[e] plus the number of earlier pairs of e in the step, and the last one
   moves next[e] on. It writes pair_row and scatters row_pair and row_token, whose padding entries
   were filled beforehand.

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
SUB = 128  # pairs per step: a (SUB, SUB) compare gives each pair's rank among equal ids
MAX_EXPERTS = 1024
_NUM_WARPS = 4

__all__ = ["AVAILABLE", "supports", "place_pairs"]


def _bins(num_experts: int) -> int:
  """Table width: a power of two (Triton blocks) with a spare column E for 'no expert'."""
  return 1 << num_experts.bit_length()


def supports(num_pairs: int, num_experts: int) -> str | None:
  """None when the kernels handle this problem, else the reason they do not."""
  if num_pairs < 1:
    return "no pairs"
  if not 1 <= num_experts <= MAX_EXPERTS:
    return f"E={num_experts} is not in [1, {MAX_EXPERTS}]"
  if num_pairs >= 2**31 - PAIRS_PER_PROGRAM:
    return f"{num_pairs} pairs overflow int32 row indices"
  return None


def _equal_ids(ids):
  """(pairs of the same id before, after) each of the SUB pairs."""
  lane = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0)
  other = lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)
  same = ids[:, None] == ids[None, :]
  return (jnp.sum(same & (other < lane), axis=1, dtype=jnp.int32),
          jnp.sum(same & (other > lane), axis=1, dtype=jnp.int32))


def _walk(ids_ref, state_ref, spare: int, interpret: bool, visit):
  """Walks the program's pairs SUB at a time with a per-id running value in `state_ref` (1, bins):
  visit(start, ids, value_before, rank) -> the running value after each pair; the last pair of each
  id in the step writes it back (a scatter without conflicts: one writer per id)."""
  base = pl.program_id(0) * PAIRS_PER_PROGRAM

  def step(j, carry):
    start = base + j * SUB
    ids = ids_ref[pl.ds(start, SUB)]
    rank, later = _equal_ids(ids)
    after = visit(start, ids, state_ref[0, ids], rank)
    # Warps run apart: every read of the state comes before any write of it, and this step's
    # writes before the next step's reads (the interpreter runs in program order).
    if not interpret:
      pltriton.debug_barrier()
    state_ref[0, jnp.where(later == 0, ids, spare)] = after
    if not interpret:
      pltriton.debug_barrier()
    return carry

  lax.fori_loop(0, PAIRS_PER_PROGRAM // SUB, step, 0)


def _count_kernel(ids_ref, counts_ref, *, spare: int, interpret: bool):
  counts_ref[...] = jnp.zeros(counts_ref.shape, jnp.int32)
  if not interpret:
    pltriton.debug_barrier()
  _walk(ids_ref, counts_ref, spare, interpret, lambda start, ids, before, rank: before + rank + 1)


def _place_kernel(ids_ref, token_ref, _next_row_in, _row_pair_in, _row_token_in,
                  next_row_ref, pair_row_ref, row_pair_ref, row_token_ref, *, num_experts: int,
                  num_rows: int, spare: int, interpret: bool):
  del _next_row_in, _row_pair_in, _row_token_in  # aliased with the outputs of the same name

  def visit(start, ids, first, rank):
    row = first + rank
    valid = ids < num_experts
    pair_row_ref[pl.ds(start, SUB)] = jnp.where(valid, row, num_rows)
    # Pairs routed nowhere write to the spare last entry rather than through a mask: the
    # interpreter's masked scatter writes the old value back and could undo a valid lane's write.
    target = jnp.where(valid, row, num_rows)
    row_pair_ref[target] = start + lax.broadcasted_iota(jnp.int32, (SUB,), 0)
    row_token_ref[target] = token_ref[pl.ds(start, SUB)]
    return row + 1

  _walk(ids_ref, next_row_ref, spare, interpret, visit)


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
  bins = _bins(num_experts)
  padded = p + -p % PAIRS_PER_PROGRAM
  ids = jnp.where((expert_ids >= 0) & (expert_ids < num_experts), expert_ids, num_experts)
  ids = jnp.pad(ids.astype(jnp.int32), (0, padded - p), constant_values=num_experts)
  tokens = jnp.pad(pair_token.astype(jnp.int32), (0, padded - p))
  blocks = padded // PAIRS_PER_PROGRAM
  params = pltriton.CompilerParams(num_warps=_NUM_WARPS, num_stages=1)
  whole = pl.BlockSpec(memory_space=pl.ANY)
  table_row = pl.BlockSpec((1, bins), lambda b: (b, 0))

  block_counts = pl.pallas_call(
      functools.partial(_count_kernel, spare=num_experts, interpret=interpret),
      out_shape=jax.ShapeDtypeStruct((blocks, bins), jnp.int32),
      grid=(blocks,), in_specs=[whole], out_specs=table_row,
      compiler_params=params, interpret=interpret,
  )(ids)

  counts = jnp.sum(block_counts[:, :num_experts], axis=0)
  group_sizes = (counts + row_tile - 1) // row_tile * row_tile
  expert_first_row = jnp.pad(jnp.cumsum(group_sizes) - group_sizes, (0, bins - num_experts))
  first_row = expert_first_row[None, :] + jnp.cumsum(block_counts, axis=0) - block_counts

  _, pair_row, row_pair, row_token = pl.pallas_call(
      functools.partial(_place_kernel, num_experts=num_experts, num_rows=num_rows,
                        spare=num_experts, interpret=interpret),
      out_shape=(jax.ShapeDtypeStruct((blocks, bins), jnp.int32),
                 jax.ShapeDtypeStruct((padded,), jnp.int32),
                 jax.ShapeDtypeStruct((num_rows + 1,), jnp.int32),
                 jax.ShapeDtypeStruct((num_rows + 1,), jnp.int32)),
      grid=(blocks,),
      in_specs=[whole, whole, table_row, whole, whole],
      out_specs=[table_row, whole, whole, whole],
      input_output_aliases={2: 0, 3: 2, 4: 3},
      compiler_params=params, interpret=interpret,
  )(ids, tokens, first_row, jnp.full((num_rows + 1,), -1, jnp.int32),
    jnp.zeros((num_rows + 1,), jnp.int32))
  return pair_row[:p], row_pair[:num_rows], row_token[:num_rows], counts
