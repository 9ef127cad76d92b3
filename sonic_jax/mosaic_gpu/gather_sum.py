"""Aggregation role: out[t] = sum_s w[t, s] * rows[pair_row[t, s]], each token's S grouped rows
weighted and summed in float32, in slot order: no atomics, deterministic. The forward's
y = sum_k s_k Y[row(t, k)] runs it where its pieces are large (`sonic_jax.Config`).

The rows are read once, by TMA, a whole row piece per copy: seen as (R * d / C, C) (C = 256
columns where d allows), a token's piece of `block_columns` columns of row r is
`block_columns // C` consecutive rows of that view, one box (2-8 KB at d = 4096): TMA issue from
one thread limits copies of a few hundred bytes. A work item is one token's piece: the
memory warpgroup loads its S row pieces into a ring stage; two summing warpgroups take the items in
turn (an even number of stages, so that each stage always goes to the same warpgroup), add the
pieces weighted in float32 and store the sum through SMEM by TMA. Each loop loads its next item's
scalars (row indices, weights) before it waits on this item's barriers: their latency then runs
under the waits instead of making the memory warpgroup the bottleneck.

Pairs routed nowhere (pair_row outside [0, R)) add nothing: their copy reads row 0 and the sum
selects zero in its place (rows that no GEMM wrote may hold NaN). Reference:
`sonic_jax.xla_backend.gather_sum` (or `reference` here, in float64).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import numpy as np

from sonic_jax.interpret import interpreting, warn_if_interpreter_may_hang
from sonic_jax.mosaic_gpu.grouped_gemm import drain_ring, num_sms, persistent_launch

# The view's width C: the widest that divides d (a TMA box is at most 256 wide); a piece of C
# columns spreads over a warpgroup's 128 threads.
VIEW_COLUMNS = (256, 128)
MAX_SLOTS = 32
STAGE_BYTES = 32 * 1024  # default piece: S row pieces of about this many bytes a stage
PIECE_BYTES = 2 * 1024  # ... but no smaller a row piece (one TMA copy) where d allows
SMEM_BYTES = 200 * 1024  # for the ring and the output staging
_SUMMING_WGS = 2


def view_columns(d: int) -> int | None:
  return next((c for c in VIEW_COLUMNS if d % c == 0), None)


@dataclasses.dataclass(frozen=True)
class GatherSumConfig:
  """block_columns: columns of a work item (one token's piece; divides d, a multiple of the view's
  width). num_stages: ring depth, even (the two summing warpgroups alternate)."""

  block_columns: int
  num_stages: int

  def __post_init__(self):
    if self.num_stages < 2 or self.num_stages % 2:
      raise ValueError(f"num_stages must be even and >= 2, got {self.num_stages}")


def smem_bytes(block_columns: int, slots: int, stages: int, itemsize: int = 2,
               out_itemsize: int = 2) -> int:
  """SMEM of a configuration: the ring of `stages` x `slots` row pieces and the output staging."""
  staging = _SUMMING_WGS * 2 * block_columns * out_itemsize
  return staging + stages * slots * block_columns * itemsize


def ring_stages(block_columns: int, slots: int, itemsize: int = 2, out_itemsize: int = 2) -> int:
  """As many ring stages of `slots` pieces of `block_columns` as SMEM_BYTES hold next to the output
  staging: even, 2 to 8."""
  staging = smem_bytes(block_columns, slots, 0, itemsize, out_itemsize)
  stages = min(8, (SMEM_BYTES - staging) // (slots * block_columns * itemsize)) // 2 * 2
  return max(2, stages)


def default_config(d: int, slots: int, itemsize: int = 2, out_itemsize: int = 2) -> GatherSumConfig:
  """Pieces of about STAGE_BYTES a stage but at least PIECE_BYTES a row (the widest divisor of d up
  to that), on `ring_stages`: the copy's size matters more than the ring's depth."""
  c = view_columns(d)
  if c is None:
    raise ValueError(f"d={d} is not a multiple of {VIEW_COLUMNS[-1]}")
  want = max(c, STAGE_BYTES // (slots * itemsize), PIECE_BYTES // itemsize)
  fits = lambda b: smem_bytes(b, slots, 2, itemsize, out_itemsize) <= SMEM_BYTES
  block = max(b for b in range(c, d + 1, c) if d % b == 0 and ((b <= want and fits(b)) or b == c))
  return GatherSumConfig(block_columns=block,
                         num_stages=ring_stages(block, slots, itemsize, out_itemsize))


def supports(rows: jax.Array, pair_row: jax.Array, weights: jax.Array) -> str | None:
  """None when the kernel takes these operands, else why not."""
  if rows.ndim != 2 or pair_row.ndim != 2:
    return f"rows (R, d) and pair_row (T, S) expected, got shapes {rows.shape}, {pair_row.shape}"
  if rows.dtype not in (jnp.bfloat16, jnp.float16):
    return f"rows dtype {rows.dtype} (the kernel takes bfloat16 or float16)"
  if pair_row.dtype != jnp.int32:
    return f"pair_row dtype {pair_row.dtype} (int32 expected)"
  if view_columns(rows.shape[1]) is None:
    return f"d={rows.shape[1]} is not a multiple of {VIEW_COLUMNS[-1]}"
  if not 1 <= pair_row.shape[1] <= MAX_SLOTS:
    return f"S={pair_row.shape[1]} slots per token (1 to {MAX_SLOTS} taken)"
  if pair_row.shape[0] < 1 or rows.shape[0] < 1:
    return "no tokens or no rows"
  if weights.shape != pair_row.shape:
    return f"weights must be {pair_row.shape} like pair_row, got {weights.shape}"
  return None


def gather_sum(rows, pair_row, weights, out_dtype, config: GatherSumConfig | None = None):
  """(T, d) `out_dtype`: out[t] = sum_s weights[t, s] * rows[pair_row[t, s]], float32
  accumulation; pairs with pair_row outside [0, R) add nothing.
  rows: (R, d) bfloat16 or float16; pair_row: (T, S) int32; weights: (T, S)."""
  reason = supports(rows, pair_row, weights)
  if reason is not None:
    raise ValueError(f"gather-sum kernel: {reason}")
  num_rows, d = rows.shape
  t_count, slots = pair_row.shape
  out_dtype = jnp.dtype(out_dtype)
  if config is None:
    config = default_config(d, slots, rows.dtype.itemsize, out_dtype.itemsize)
  c = view_columns(d)
  bc, stages = config.block_columns, config.num_stages
  if bc % c or d % bc:
    raise ValueError(f"block_columns={bc} must divide d={d} and be a multiple of {c}")
  per_row, piece_rows, pieces = d // c, bc // c, d // bc
  items = t_count * pieces
  num_ctas = num_sms()
  weights = weights.astype(jnp.float32)
  if interpreting():
    warn_if_interpreter_may_hang()

  def body(pair_row_ref, weights_ref, rows_ref, out_ref):
    pl.run_scoped(
        functools.partial(scoped, pair_row_ref, weights_ref, rows_ref, out_ref),
        plgpu.SMEM((stages, slots, piece_rows, c), rows.dtype),
        plgpu.SMEM((_SUMMING_WGS, 2, piece_rows, c), out_dtype),
        plgpu.Barrier(num_arrivals=slots, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        collective_axes="wg")

  def scoped(pair_row_ref, weights_ref, rows_ref, out_ref, ring, staging, full, empty):
    wg = lax.axis_index("wg")

    cta = lax.axis_index("sm")
    count = lax.div(items - cta + num_ctas - 1, num_ctas)  # this CTA's items: cta + j * num_ctas

    def coords(j):
      """(token, piece) of this CTA's item j (clamped: a prefetch may look one item past)."""
      i = jnp.minimum(cta + j * num_ctas, items - 1)
      return lax.div(i, pieces), lax.rem(i, pieces)

    def scalars(j, read):
      t, _ = coords(j)
      return tuple(read(t, s) for s in range(slots))

    def pick(r):
      return (r >= 0) & (r < num_rows)

    # Both loops load the scalars of their next item before the barrier waits of this one, so
    # that their latency runs under the waits (the memory warpgroup's copies need them first).
    @pl.when(wg == _SUMMING_WGS)
    def _memory_wg():
      def load(j, rows_j):
        rows_next = scalars(j + 1, lambda t, s: pair_row_ref[t, s])
        _, q = coords(j)
        slot = lax.rem(j, stages)

        @pl.when(j >= stages)
        def _():
          plgpu.barrier_wait(empty.at[slot])

        for s, r in enumerate(rows_j):
          first = jnp.where(pick(r), r, 0) * per_row + q * piece_rows
          plgpu.copy_gmem_to_smem(rows_ref.at[pl.ds(first, piece_rows)], ring.at[slot, s],
                                  full.at[slot])
        return rows_next

      lax.fori_loop(0, count, load, scalars(0, lambda t, s: pair_row_ref[t, s]))
      drain_ring(empty, count, stages)

    @pl.when(wg < _SUMMING_WGS)
    def _summing_wg():
      # This warpgroup's items: j = wg, wg + 2, ... (each ring slot always comes to one of them).
      def read(t, s):
        return (pair_row_ref[t, s], weights_ref[t, s])

      def add(m, now):
        j = m * _SUMMING_WGS + wg
        nxt = scalars(j + _SUMMING_WGS, read)
        t, q = coords(j)
        slot = lax.rem(j, stages)
        plgpu.barrier_wait(full.at[slot])
        acc = None
        for s, (r, scale) in enumerate(now):
          piece = ring[slot, s].astype(jnp.float32) * scale
          # A select, not a product with 0: an unwritten row may hold NaN.
          piece = jnp.where(lax.broadcast(pick(r), piece.shape), piece, jnp.zeros_like(piece))
          acc = piece if acc is None else acc + piece
        plgpu.barrier_arrive(empty.at[slot])
        buf = lax.rem(m, 2)
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store that last read buf did
        staging[wg, buf] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(staging.at[wg, buf],
                                out_ref.at[pl.ds(t * per_row + q * piece_rows, piece_rows)])
        return nxt

      mine = lax.div(count - wg + _SUMMING_WGS - 1, _SUMMING_WGS)
      lax.fori_loop(0, mine, add, scalars(wg, read))
      plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((t_count * per_row, c), out_dtype),
      **persistent_launch(1),
      kernel_name="gather_sum",
      num_threads=_SUMMING_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, reduction_scratch_bytes=0),
  )
  out = kernel(pair_row, weights, rows.reshape(num_rows * per_row, c))
  return out.reshape(t_count, d)


def reference(rows, pair_row, weights, dtype=np.float64):
  """The gather-sum in `dtype` on the host, a loop over tokens and slots."""
  rows = np.asarray(rows, dtype)
  ids = np.asarray(pair_row)
  w = np.asarray(weights, dtype)
  out = np.zeros((ids.shape[0], rows.shape[1]), dtype)
  for t in range(ids.shape[0]):
    for s in range(ids.shape[1]):
      if 0 <= ids[t, s] < rows.shape[0]:
        out[t] += w[t, s] * rows[ids[t, s]]
  return out
