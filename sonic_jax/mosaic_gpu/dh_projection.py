"""dH role: dA' = dO_rows @ w2_e^T, then from the stored H: A, dH = s * act'(H, dA'), A_s = s * A and
the per-row partial sums of dA' * A that add up to the router-score gradient dS.

dO's rows are gathered by token as the A operand loads (or arrive in grouped order); w2 is stored
(E, n, d), so B = w2_e^T is read as (block_n, tile_k) boxes of w2_e and transposed by wgmma. A
column block covers
block_n hidden units; the epilogue reads the matching H columns (gate and up for GLU activations),
recomputes A from them in float32 and writes dH, A_s and one float32 partial of dS per row and
column block, so neither Y nor A was stored by the forward. With 128-column blocks the H columns
and row scores are TMA-copied into SMEM while the tile's mainloop runs (`DhProjectionConfig`).
Under the core's pingpong schedule (`GroupedGemmConfig.schedule`) a warpgroup takes a whole
128 x 128 tile and reads its H straight into registers, 64 rows at a time: the other warpgroup's
mainloop hides the loads, and the whole tile's H would not fit in SMEM next to the ring. Measured
on an H100 it pays where the epilogue and the mainloop are of a size (d = 1536: 2-9% on dH) and
loses at d = 768 and d = 4096 (`benchmarks/dh_variants.py`); the tuning table picks it.
Reference: `sonic_jax.xla_backend.dh_projection` (without the b2 term of dS, which the backend
adds).
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax import activations as acts
from sonic_jax.backends import interpreting
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import (GemmRole, GroupedGemmConfig, check_layout_tile,
                                                grouped_gemm, tiled, unsupported_operands)

PREFETCH_BLOCK_N = 128  # the column block whose H columns fit in SMEM next to a 4-stage ring
WIDE_BLOCK_N = 256  # twice the columns per tile: half the A-operand traffic per FLOP
STAGED_MAX_STAGES = 3  # ring depth next to the staged wide epilogue's buffers
ROW_BLOCK = 64  # rows of one wgmma accumulator block: the register epilogue's unit


@dataclasses.dataclass(frozen=True)
class DhProjectionConfig:
  """block_n: hidden units per column block. 128: the tile's H columns are TMA-prefetched into
  SMEM during the mainloop. 256: a wider tile that reads each dO tile half as often; its epilogue
  reads H 64 hidden units at a time (`default_block_n` picks).
  wide_h_loads: how the 256-column tile's epilogue reads H: "staged" (each piece TMA-loaded into
  one of two SMEM buffers, the next while the current one is computed; the ring is then at most
  `STAGED_MAX_STAGES` deep) or "registers" (plgpu.load from GMEM, stalling on each piece; the
  outputs go through the staging buffers). The interleaved layout needs "staged" (its pairs are
  read as words from SMEM).
  With `gemm.schedule="pingpong"`: block_n must be 128 and H is read into registers (the concat
  layout only; wide_h_loads does not apply)."""

  gemm: GroupedGemmConfig = GroupedGemmConfig(num_stages=4)
  block_n: int = PREFETCH_BLOCK_N
  wide_h_loads: str = "staged"

  def __post_init__(self):
    if self.gemm.schedule == "pingpong" and self.block_n != PREFETCH_BLOCK_N:
      raise ValueError(f"a pingpong dH takes block_n={PREFETCH_BLOCK_N} (a warpgroup holds a whole "
                       f"tile's rows), got {self.block_n}")
    if self.block_n not in (PREFETCH_BLOCK_N, WIDE_BLOCK_N):
      raise ValueError(f"block_n must be {PREFETCH_BLOCK_N} or {WIDE_BLOCK_N}, got {self.block_n}")
    if self.wide_h_loads not in ("staged", "registers"):
      raise ValueError(f"wide_h_loads must be 'staged' or 'registers', got {self.wide_h_loads!r}")


def default_block_n(n: int) -> int:
  """The wide tile wherever n allows it. Measured on an H100 (`benchmarks/dh_variants.py`,
  gathered dO, interleaved rounds): at d = 4096 the 128-column tile ran 18-25% slower
  (4.9 against 4.1 ms at 32768,4096,2048,64,4); at d <= 1536 the wide tile is as fast at
  40960,768,{256,512} (0.600 / 0.604 ms, 0.583 / 0.587) and 7-12% faster elsewhere (0.463 against
  0.527 ms at 24576,1536,1024,32,2), though its H loads stall the epilogue and the prefetch
  overlaps them with the mainloop: half the dO traffic per FLOP weighs more."""
  return WIDE_BLOCK_N if n % WIDE_BLOCK_N == 0 else PREFETCH_BLOCK_N


def supports(h, w2, activation: acts.Activation, gate_up_layout: str,
             block_n: int = PREFETCH_BLOCK_N) -> str | None:
  if gate_up_layout not in acts.GATE_UP_LAYOUTS:
    return f"gate_up_layout {gate_up_layout!r} (one of {acts.GATE_UP_LAYOUTS})"
  return unsupported_operands(h, w2, [("d", w2.shape[2], 64), ("n", w2.shape[1], block_n)])


def dh_projection(d_out, h, row_scores, w2, layout, activation: acts.Activation,
                  config: DhProjectionConfig = DhProjectionConfig(), gather: bool = False,
                  gate_up_layout: str = "concat", write_d_out_rows: bool = False):
  """Returns dH (R, 2n or n), A_s (R, n) in H's dtype and dS partials (n // bn, R) float32 (bn: the
  tile's column block); with write_d_out_rows also the gathered dO rows (R, d).

  d_out: the (R, d) grouped rows dO[layout.row_token], or with gather=True the (T, d) dO itself,
  whose rows the kernel gathers as it loads them (no gathered copy in HBM unless
  write_d_out_rows: then the kernel also stores the rows it gathered, for dw2 to read
  contiguously; it needs gather=True). row_scores: (R,) float32, 0 on padding rows. Rows of
  tiles past `layout.num_tiles` are left unwritten.
  gate_up_layout: where a GLU's gate and up columns sit in H and dH. The interleaved layout reads
  its H pieces from SMEM as uint32 words, one (gate, up) pair each, and writes dH back the same
  way (a strided register slice does not exist in Mosaic GPU, and a uint32 view of H in HBM would
  cost XLA a copy each way): the 128-column tile prefetches them during the mainloop, the
  256-column tile stages them (`DhProjectionConfig.wide_h_loads`).
  """
  _, n, _ = w2.shape
  tm = config.gemm.tile_m
  check_layout_tile(layout, tm)
  dtype = h.dtype
  glu = activation.is_glu
  interleaved = glu and gate_up_layout == "interleaved"
  act_fn, act_grad = acts.kernel_fn(activation), acts.kernel_grad(activation)
  cols = epi.STORE_COLS
  bn = config.block_n
  pingpong = config.gemm.schedule == "pingpong"
  if pingpong and interleaved:
    raise ValueError("a pingpong dH takes the concat gate/up layout (the interleaved layout reads "
                     "its pairs from SMEM)")
  # Pingpong: H read into registers (the other warpgroup's mainloop hides the loads' latency; a
  # whole tile's H does not fit in SMEM next to the ring).
  prefetched = bn == PREFETCH_BLOCK_N and not pingpong
  staged = not prefetched and not pingpong and (interleaved or config.wide_h_loads == "staged")
  gemm_config = config.gemm
  if staged:  # its H and A_s buffers take a stage's SMEM
    gemm_config = dataclasses.replace(gemm_config, num_stages=min(gemm_config.num_stages,
                                                                  STAGED_MAX_STAGES))
  pieces = bn // cols  # 64-column pieces of the column block
  # H pieces per column block: concat GLU the gate pieces, then the up pieces (64 columns each);
  # interleaved GLU one 128-column piece of (gate, up) pairs per 64 hidden units.
  h_pieces = 2 * pieces if glu and not interleaved else pieces
  h_cols = 2 * cols if interleaved else cols
  rows_per_wg = config.gemm.rows_per_warpgroup

  def rhs_copy(w2_ref, expert, k_slice, nb, j):
    del j
    return w2_ref.at[expert, pl.ds(nb * bn, bn), k_slice]

  def h_column(column_block, i):  # first H column of H piece i
    if interleaved:
      return column_block * 2 * bn + i * h_cols
    half, piece = divmod(i, pieces)
    return half * n + column_block * bn + piece * cols

  def h_halves(p):  # the H pieces that hidden units [p * 64, (p + 1) * 64) of the block use
    return [p] if h_pieces == pieces else [p, pieces + p]

  def piece_outputs(d_a, s, pre):
    """For one 64-column piece: ([dH values, float32], A_s piece, dS part); pre: [gate, up] or
    [pre-activation] in float32."""
    s_d_a = lax.broadcast_in_dim(s, d_a.shape, [0]) * d_a
    if glu:
      gate, up = pre
      act_gate = act_fn(gate)
      a = act_gate * up
      d_h = [s_d_a * up * act_grad(gate), s_d_a * act_gate]
    else:
      a = act_fn(pre[0])
      d_h = [s_d_a * act_grad(pre[0])]
    return d_h, lax.broadcast_in_dim(s, a.shape, [0]) * a, jnp.sum(d_a * a, axis=1)

  def prefetch(ctx, barrier):
    """The tile's H columns and row scores, TMA-copied into SMEM while the mainloop runs."""
    h_ref, s_ref = ctx.inputs
    h_smem, _, s_smem = ctx.scratch[:3]
    rows = pl.ds(ctx.row0, ctx.rows)
    for i in range(h_pieces):
      plgpu.copy_gmem_to_smem(h_ref.at[rows, pl.ds(h_column(ctx.column_block, i), h_cols)],
                              h_smem.at[i], barrier)
    plgpu.copy_gmem_to_smem(s_ref.at[rows], s_smem, barrier)

  def copy_h_piece(ctx, p, dst, barrier):
    """TMA-copies the H columns of hidden units [p * 64, (p + 1) * 64) of the column block into
    dst ((h_halves, rows, h_cols)): one box per H piece they span (gate and up for concat GLU)."""
    h_ref = ctx.inputs[0]
    for j, i in enumerate(h_halves(p)):
      plgpu.copy_gmem_to_smem(
          h_ref.at[pl.ds(ctx.row0, ctx.rows), pl.ds(h_column(ctx.column_block, i), h_cols)],
          dst.at[j], barrier)

  def prefetch_first_piece(ctx, barrier):
    """The staged wide tile: its first H piece, TMA-copied into SMEM during the mainloop."""
    copy_h_piece(ctx, 0, ctx.scratch[0].at[0], barrier)

  def staged_epilogue(acc, ctx, rows):
    """The wide tile: H pieces TMA-loaded into two SMEM buffers in turn (the next piece's load
    runs while this one is computed; one barrier phase outstanding at a time), dH written back
    into the piece's buffer (interleaved: read and written as pair words), A_s through its own
    buffer."""
    dh_ref, as_ref, _ = ctx.outputs
    s_ref = ctx.inputs[1]
    h_smem, as_smem = ctx.scratch[:2]
    s = plgpu.load(s_ref.at[rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    ds = None
    for p in range(pieces):
      slot = p % 2
      plgpu.barrier_wait(ctx.prefetched)  # piece p landed
      if p:  # the previous piece's stores have read its buffers (and the other H buffer)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      if p + 1 < pieces:
        copy_h_piece(ctx, p + 1, h_smem.at[1 - slot], ctx.prefetched)
      h_refs = [h_smem.at[slot, j] for j in range(len(h_halves(p)))]
      words = ctx.scratch[2].at[slot] if interleaved else None
      d_h, a_s, part = piece_outputs(acc[:, p * cols:(p + 1) * cols], s, read_h(h_refs, words))
      write_dh(h_refs, words, d_h)
      as_smem[0] = a_s.astype(dtype)
      plgpu.commit_smem()
      for j, i in enumerate(h_halves(p)):
        plgpu.copy_smem_to_gmem(h_smem.at[slot, j],
                                dh_ref.at[rows, pl.ds(h_column(ctx.column_block, i), h_cols)])
      plgpu.copy_smem_to_gmem(as_smem.at[0],
                              as_ref.at[rows, pl.ds(ctx.column_block * bn + p * cols, cols)])
      ds = part if ds is None else ds + part
    return ds

  def read_h(h_refs, words):
    """A piece's pre-activations in float32 from SMEM: h_refs, one ref per H piece it spans (gate
    and up for concat GLU); the interleaved layout's one piece of (gate, up) pairs is read through
    `words`, its uint32 view."""
    if not interleaved:
      return [plgpu.load(r, layout=plgpu.Layout.WGMMA).astype(jnp.float32) for r in h_refs]
    if interpreting():  # the interpreter does not alias the union's views: same values
      return list(epi.split_pairs(h_refs[0][...]))
    return list(epi.unpack_pairs(plgpu.load(words, layout=plgpu.Layout.WGMMA), dtype))

  def write_dh(h_refs, words, d_h):
    """A piece's dH in place of the H it came from (each thread rewrites what it read)."""
    if not interleaved:
      for r, v in zip(h_refs, d_h):
        r[...] = v.astype(dtype)
    elif interpreting():
      h_refs[0][...] = epi.merge_pairs(*d_h, dtype)
    else:
      words[...] = epi.pack_pairs(*d_h, dtype)

  def prefetched_epilogue(acc, ctx, rows):
    """H from SMEM; dH overwrites the H piece it came from, A_s goes through its own SMEM
    pieces; all stores issued at the end."""
    dh_ref, as_ref, _ = ctx.outputs
    h_smem, as_smem, s_smem = ctx.scratch[:3]
    plgpu.barrier_wait(ctx.prefetched)
    s = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    ds = None
    for p in range(pieces):
      h_refs = [h_smem.at[i] for i in h_halves(p)]
      words = ctx.scratch[3].at[p] if interleaved else None
      d_h, a_s, part = piece_outputs(acc[:, p * cols:(p + 1) * cols], s, read_h(h_refs, words))
      write_dh(h_refs, words, d_h)
      as_smem[p] = a_s.astype(dtype)
      ds = part if ds is None else ds + part
    plgpu.commit_smem()
    for i in range(h_pieces):
      plgpu.copy_smem_to_gmem(h_smem.at[i],
                              dh_ref.at[rows, pl.ds(h_column(ctx.column_block, i), h_cols)])
    for p in range(pieces):
      plgpu.copy_smem_to_gmem(as_smem.at[p],
                              as_ref.at[rows, pl.ds(ctx.column_block * bn + p * cols, cols)])
    return ds

  def registers_epilogue(acc, ctx, rows):
    """H straight from GMEM and the outputs through the staging buffers, a (64 rows, 64 columns)
    piece at a time (a pingpong warpgroup's 128 rows in two blocks: one piece's H, 64 rows, in
    registers at a time). Writes the dS partials itself; returns None."""
    dh_ref, as_ref, ds_ref = ctx.outputs
    h_ref, s_ref = ctx.inputs
    for r0 in range(0, ctx.rows, ROW_BLOCK):
      block = pl.ds(rows.start + r0, ROW_BLOCK)
      s = plgpu.load(s_ref.at[block], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
      ds = None
      for p in range(pieces):
        columns = [pl.ds(h_column(ctx.column_block, i), cols) for i in h_halves(p)]
        d_h, a_s, part = piece_outputs(
            acc[r0:r0 + ROW_BLOCK, p * cols:(p + 1) * cols], s,
            [plgpu.load(h_ref.at[block, c], layout=plgpu.Layout.WGMMA,
                        optimized=False).astype(jnp.float32) for c in columns])
        stores = [(v.astype(dtype), dh_ref.at[block, c]) for v, c in zip(d_h, columns)]
        stores.append((a_s.astype(dtype), as_ref.at[block, pl.ds(ctx.column_block * bn + p * cols,
                                                                 cols)]))
        epi.store_tiles(stores, ctx.scratch)
        ds = part if ds is None else ds + part
      ds_ref.at[ctx.column_block, block][...] = ds

  def epilogue(accs, ctx):
    (acc,) = accs
    rows = pl.ds(ctx.row0, ctx.rows)
    if prefetched:
      ds = prefetched_epilogue(acc, ctx, rows)
    elif staged:
      ds = staged_epilogue(acc, ctx, rows)
    else:
      registers_epilogue(acc, ctx, rows)
      return
    ds_ref = ctx.outputs[2]
    ds_ref.at[ctx.column_block, rows][...] = ds  # 256 bytes: straight from registers

  if prefetched:
    scratch = (plgpu.SMEM((h_pieces, rows_per_wg, h_cols), dtype, transforms=tiled(dtype)),
               plgpu.SMEM((pieces, rows_per_wg, cols), dtype, transforms=tiled(dtype)),
               plgpu.SMEM((rows_per_wg,), jnp.float32))
    if interleaved:  # + a uint32 view of the H pieces, (pieces, rows, 64): one word a pair
      scratch = plgpu.RefUnion(scratch, plgpu.SMEM((h_pieces, rows_per_wg, cols), jnp.uint32,
                                                   transforms=tiled(jnp.uint32)))
  elif staged:  # two H pieces (with the interleaved layout a pair-word view too), one A_s piece
    halves = len(h_halves(0))
    scratch = (plgpu.SMEM((2, halves, rows_per_wg, h_cols), dtype, transforms=tiled(dtype)),
               plgpu.SMEM((1, rows_per_wg, cols), dtype, transforms=tiled(dtype)))
    if interleaved:
      scratch = plgpu.RefUnion(scratch, plgpu.SMEM((2, rows_per_wg, cols), jnp.uint32,
                                                   transforms=tiled(jnp.uint32)))
  else:
    scratch = epi.staging_buffers(ROW_BLOCK, dtype, config.gemm.epilogue_buffers)
  if prefetched:
    prefetch, prefetch_copies = prefetch, h_pieces + 1
  elif staged:
    prefetch, prefetch_copies = prefetch_first_piece, len(h_halves(0))
  else:
    prefetch, prefetch_copies = None, 0
  role = GemmRole(
      name="dh_projection",
      block_n=bn, num_rhs_blocks=1, num_column_blocks=n // bn, rhs_copy=rhs_copy,
      epilogue=epilogue, epilogue_scratch=scratch,
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, h.shape[1]), dtype),
                 jax.ShapeDtypeStruct((layout.num_rows, n), dtype),
                 jax.ShapeDtypeStruct((n // bn, layout.num_rows), jnp.float32)),
      rhs_transposed=True, epilogue_prefetch=prefetch, prefetch_copies=prefetch_copies)
  if write_d_out_rows and not gather:
    raise ValueError("write_d_out_rows needs gather=True (contiguous dO rows are already in HBM)")
  return grouped_gemm(d_out, w2, layout.tile_expert, layout.num_tiles,
                      layout.row_token if gather else None, role,
                      (h, row_scores.astype(jnp.float32)), gemm_config,
                      write_lhs_rows=write_d_out_rows)
