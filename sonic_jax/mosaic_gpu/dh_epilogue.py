"""The dH role's epilogues: from the tile's accumulators dA' and the stored H, the outputs dH,
A_s and the dS partials, by one of three strategies for getting H into registers.

A column block covers `block_n` hidden units, cut into 64-column pieces. Per piece the epilogue
reads the matching H columns (gate and up for a GLU), recomputes A in float32 and writes
dH = s * act'(H, dA'), A_s = s * A and the row sums of dA' * A (`DhTile.piece_outputs`). The
strategies differ only in how H arrives and how the outputs leave:
- `Prefetched` (128-column blocks): the tile's H columns and row scores are TMA-copied into SMEM
  while the mainloop runs; dH overwrites H in SMEM and all stores go out at the end.
- `Staged` (256-column blocks): H pieces are TMA-loaded into two SMEM buffers in turn, the next
  while the current one is computed.
- `Registers` (256-column blocks, or the pingpong schedule's 128 x 128 tiles): H is read from
  GMEM straight into registers, 64 rows at a time; the outputs go through staging buffers.
The interleaved gate/up layout reads its (gate, up) pairs from SMEM as uint32 words, so it runs
`Prefetched` or `Staged` only.
"""

from __future__ import annotations

import dataclasses

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from sonic_jax import activations as acts
from sonic_jax.interpret import interpreting
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import tiled

ROW_BLOCK = 64  # rows of one wgmma accumulator block: the register epilogue's unit


@dataclasses.dataclass(frozen=True)
class DhTile:
  """The geometry and per-piece math shared by the strategies."""

  n: int  # hidden units of the expert
  block_n: int  # hidden units per column block
  rows: int  # rows per compute warpgroup
  dtype: jnp.dtype
  glu: bool
  interleaved: bool
  activation: acts.Activation  # evaluated in its kernel form

  @property
  def pieces(self) -> int:  # 64-column pieces of the column block
    return self.block_n // epi.STORE_COLS

  @property
  def h_pieces(self) -> int:
    """H pieces per column block: concat GLU the gate pieces, then the up pieces (64 columns
    each); interleaved GLU one 128-column piece of (gate, up) pairs per 64 hidden units."""
    return 2 * self.pieces if self.glu and not self.interleaved else self.pieces

  @property
  def h_cols(self) -> int:
    return 2 * epi.STORE_COLS if self.interleaved else epi.STORE_COLS

  def h_column(self, column_block, i):
    """First H column of H piece i."""
    if self.interleaved:
      return column_block * 2 * self.block_n + i * self.h_cols
    half, piece = divmod(i, self.pieces)
    return half * self.n + column_block * self.block_n + piece * epi.STORE_COLS

  def h_halves(self, p) -> list[int]:
    """The H pieces that hidden units [p * 64, (p + 1) * 64) of the block use."""
    return [p] if self.h_pieces == self.pieces else [p, self.pieces + p]

  def as_columns(self, column_block, p):
    return pl.ds(column_block * self.block_n + p * epi.STORE_COLS, epi.STORE_COLS)

  def piece_outputs(self, d_a, s, pre):
    """For one 64-column piece: ([dH values, float32], A_s piece, dS part); pre: [gate, up] or
    [pre-activation] in float32."""
    s_d_a = lax.broadcast_in_dim(s, d_a.shape, [0]) * d_a
    if self.glu:
      a, d_gate, d_up = self.activation.glu_backward(*pre, s_d_a, kernel=True)
      d_h = [d_gate, d_up]
    else:
      a = self.activation.fn(pre[0], kernel=True)
      d_h = [s_d_a * self.activation.grad(pre[0], kernel=True)]
    return d_h, lax.broadcast_in_dim(s, a.shape, [0]) * a, jnp.sum(d_a * a, axis=1)

  def piece(self, acc, p, r0=0, rows=None):
    """Columns of piece p of the accumulators (rows [r0, r0 + rows), default all)."""
    columns = slice(p * epi.STORE_COLS, (p + 1) * epi.STORE_COLS)
    return acc[:, columns] if rows is None else acc[r0:r0 + rows, columns]

  def read_h(self, h_refs, words):
    """A piece's pre-activations in float32 from SMEM: h_refs, one ref per H piece it spans (gate
    and up for concat GLU); the interleaved layout's one piece of (gate, up) pairs is read through
    `words`, its uint32 view."""
    if not self.interleaved:
      return [plgpu.load(r, layout=plgpu.Layout.WGMMA).astype(jnp.float32) for r in h_refs]
    if interpreting():  # the interpreter does not alias the union's views: same values
      return list(epi.split_pairs(h_refs[0][...]))
    return list(epi.unpack_pairs(plgpu.load(words, layout=plgpu.Layout.WGMMA), self.dtype))

  def write_dh(self, h_refs, words, d_h):
    """A piece's dH in place of the H it came from (each thread rewrites what it read)."""
    if not self.interleaved:
      for r, v in zip(h_refs, d_h):
        r[...] = v.astype(self.dtype)
    elif interpreting():
      h_refs[0][...] = epi.merge_pairs(*d_h, self.dtype)
    else:
      words[...] = epi.pack_pairs(*d_h, self.dtype)

  def with_words(self, buffers, pieces):
    """The interleaved layout's scratch: `buffers` in a union with a uint32 view of the H pieces,
    (pieces, rows, 64), one word a (gate, up) pair."""
    if not self.interleaved:
      return buffers
    return plgpu.RefUnion(buffers, plgpu.SMEM((pieces, self.rows, epi.STORE_COLS), jnp.uint32,
                                              transforms=tiled(jnp.uint32)))


@dataclasses.dataclass(frozen=True)
class Prefetched:
  """The tile's H columns and row scores in SMEM before the mainloop ends; dH overwrites the H
  piece it came from, A_s goes through SMEM pieces of its own; all stores issued at the end."""

  tile: DhTile

  def scratch(self):
    t, dt = self.tile, self.tile.dtype
    return t.with_words((plgpu.SMEM((t.h_pieces, t.rows, t.h_cols), dt, transforms=tiled(dt)),
                         plgpu.SMEM((t.pieces, t.rows, epi.STORE_COLS), dt, transforms=tiled(dt)),
                         plgpu.SMEM((t.rows,), jnp.float32)), t.h_pieces)

  @property
  def prefetch_copies(self) -> int:
    return self.tile.h_pieces + 1

  def prefetch(self, ctx, barrier):
    t = self.tile
    h_ref, s_ref = ctx.inputs
    h_smem, _, s_smem = ctx.scratch[:3]
    rows = pl.ds(ctx.row0, ctx.rows)
    for i in range(t.h_pieces):
      plgpu.copy_gmem_to_smem(h_ref.at[rows, pl.ds(t.h_column(ctx.column_block, i), t.h_cols)],
                              h_smem.at[i], barrier)
    plgpu.copy_gmem_to_smem(s_ref.at[rows], s_smem, barrier)

  def __call__(self, acc, ctx, rows):
    t = self.tile
    dh_ref, as_ref, ds_ref = ctx.outputs
    h_smem, as_smem, s_smem = ctx.scratch[:3]
    plgpu.barrier_wait(ctx.prefetched)
    s = plgpu.load(s_smem, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    ds = None
    for p in range(t.pieces):
      h_refs = [h_smem.at[i] for i in t.h_halves(p)]
      words = ctx.scratch[3].at[p] if t.interleaved else None
      d_h, a_s, part = t.piece_outputs(t.piece(acc, p), s, t.read_h(h_refs, words))
      t.write_dh(h_refs, words, d_h)
      as_smem[p] = a_s.astype(t.dtype)
      ds = part if ds is None else ds + part
    plgpu.commit_smem()
    for i in range(t.h_pieces):
      plgpu.copy_smem_to_gmem(h_smem.at[i],
                              dh_ref.at[rows, pl.ds(t.h_column(ctx.column_block, i), t.h_cols)])
    for p in range(t.pieces):
      plgpu.copy_smem_to_gmem(as_smem.at[p], as_ref.at[rows, t.as_columns(ctx.column_block, p)])
    ds_ref.at[ctx.column_block, rows][...] = ds  # 256 bytes: straight from registers


@dataclasses.dataclass(frozen=True)
class Staged:
  """H pieces TMA-loaded into two SMEM buffers in turn (the next piece's load runs while this one
  is computed; one barrier phase outstanding at a time), dH written back into the piece's buffer
  (interleaved: read and written as pair words), A_s through a buffer of its own."""

  tile: DhTile

  MAX_STAGES = 3  # the operand ring's depth next to these buffers

  def scratch(self):
    t, dt = self.tile, self.tile.dtype
    halves = len(t.h_halves(0))
    return t.with_words((plgpu.SMEM((2, halves, t.rows, t.h_cols), dt, transforms=tiled(dt)),
                         plgpu.SMEM((1, t.rows, epi.STORE_COLS), dt, transforms=tiled(dt))), 2)

  @property
  def prefetch_copies(self) -> int:
    return len(self.tile.h_halves(0))

  def copy_h_piece(self, ctx, p, dst, barrier):
    """TMA-copies the H columns of hidden units [p * 64, (p + 1) * 64) of the column block into
    dst ((h_halves, rows, h_cols)): one box per H piece they span (gate and up for concat GLU)."""
    t = self.tile
    h_ref = ctx.inputs[0]
    for j, i in enumerate(t.h_halves(p)):
      plgpu.copy_gmem_to_smem(
          h_ref.at[pl.ds(ctx.row0, ctx.rows), pl.ds(t.h_column(ctx.column_block, i), t.h_cols)],
          dst.at[j], barrier)

  def prefetch(self, ctx, barrier):
    """The first H piece, during the mainloop."""
    self.copy_h_piece(ctx, 0, ctx.scratch[0].at[0], barrier)

  def __call__(self, acc, ctx, rows):
    t = self.tile
    dh_ref, as_ref, ds_ref = ctx.outputs
    s_ref = ctx.inputs[1]
    h_smem, as_smem = ctx.scratch[:2]
    s = plgpu.load(s_ref.at[rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    ds = None
    for p in range(t.pieces):
      slot = p % 2
      plgpu.barrier_wait(ctx.prefetched)  # piece p landed
      if p:  # the previous piece's stores have read its buffers (and the other H buffer)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      if p + 1 < t.pieces:
        self.copy_h_piece(ctx, p + 1, h_smem.at[1 - slot], ctx.prefetched)
      h_refs = [h_smem.at[slot, j] for j in range(len(t.h_halves(p)))]
      words = ctx.scratch[2].at[slot] if t.interleaved else None
      d_h, a_s, part = t.piece_outputs(t.piece(acc, p), s, t.read_h(h_refs, words))
      t.write_dh(h_refs, words, d_h)
      as_smem[0] = a_s.astype(t.dtype)
      plgpu.commit_smem()
      for j, i in enumerate(t.h_halves(p)):
        plgpu.copy_smem_to_gmem(h_smem.at[slot, j],
                                dh_ref.at[rows, pl.ds(t.h_column(ctx.column_block, i), t.h_cols)])
      plgpu.copy_smem_to_gmem(as_smem.at[0], as_ref.at[rows, t.as_columns(ctx.column_block, p)])
      ds = part if ds is None else ds + part
    ds_ref.at[ctx.column_block, rows][...] = ds


@dataclasses.dataclass(frozen=True)
class Registers:
  """H straight from GMEM and the outputs through the staging buffers, a (64 rows, 64 columns)
  piece at a time (a pingpong warpgroup's 128 rows in two blocks: one piece's H, 64 rows, in
  registers at a time). The loads stall the warpgroup; under the pingpong schedule the other
  warpgroup's mainloop hides them."""

  tile: DhTile

  prefetch = None
  prefetch_copies = 0

  def scratch(self):
    return epi.staging_buffers(ROW_BLOCK, self.tile.dtype)

  def __call__(self, acc, ctx, rows):
    t = self.tile
    dh_ref, as_ref, ds_ref = ctx.outputs
    h_ref, s_ref = ctx.inputs
    for r0 in range(0, ctx.rows, ROW_BLOCK):
      block = pl.ds(rows.start + r0, ROW_BLOCK)
      s = plgpu.load(s_ref.at[block], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
      ds = None
      for p in range(t.pieces):
        columns = [pl.ds(t.h_column(ctx.column_block, i), epi.STORE_COLS) for i in t.h_halves(p)]
        d_h, a_s, part = t.piece_outputs(
            t.piece(acc, p, r0, ROW_BLOCK), s,
            [plgpu.load(h_ref.at[block, c], layout=plgpu.Layout.WGMMA,
                        optimized=False).astype(jnp.float32) for c in columns])
        stores = [(v.astype(t.dtype), dh_ref.at[block, c]) for v, c in zip(d_h, columns)]
        stores.append((a_s.astype(t.dtype), as_ref.at[block, t.as_columns(ctx.column_block, p)]))
        epi.store_tiles(stores, ctx.scratch)
        ds = part if ds is None else ds + part
      ds_ref.at[ctx.column_block, block][...] = ds
