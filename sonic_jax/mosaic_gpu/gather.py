"""The gather prologue: rows of a GMEM matrix, picked by an index vector, into a swizzled stage.

Hopper has no TMA gather (tile::gather4 is sm100), so the memory warpgroup gathers with cp.async,
as SonicMoE does: its 128 threads copy the rows as 16-byte pieces straight into the
128-byte-swizzled (8, 64)-tiled SMEM layout that wgmma reads, eight threads per 128-byte row span.
Each thread then arms `cp.async.mbarrier.arrive.noinc` on the stage's own barrier (one of
`stage_barriers`, initialised for 128 arrivals), so the producer never waits for its copies; the
consumers wait on that barrier next to the TMA barrier of the other operand, and fence the async
proxy before wgmma reads the stage.

The gather costs a few percent of the up-projection's time, far less than an XLA gather of the
same rows (docs/decisions.md). Completion by `cp.async.wait_group` + fence + barrier in the
producer would serialise the producer on its own copies; the noinc arrival does not. The memory
warpgroup needs more registers for the addressing than a TMA-only producer: see
`grouped_gemm.register_split`. The interpreter cannot run inline Mosaic GPU code: interpreted
kernels gather a stage's rows with one indexed read instead (`interpreted_rows`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, gpu, llvm, memref, nvvm, vector
import numpy as np

ROW_BYTES = 128  # one swizzle span: 64 elements of a 16-bit operand, one tiled SMEM row
TILE_BYTES = 8 * ROW_BYTES  # one (8, 64) tile
CHUNK = 16  # bytes per cp.async
_THREADS = 128


def _passes(rows: int, width: int, dtype) -> tuple[int, int]:
  """(pieces per row, rows per pass) of the gather's thread assignment: consecutive threads copy
  consecutive 16-byte pieces of a row, `_THREADS // pieces_per_row` rows per pass."""
  pieces_per_row = width * jnp.dtype(dtype).itemsize // CHUNK
  if _THREADS % pieces_per_row or rows % (_THREADS // pieces_per_row):
    raise ValueError(f"cannot split {rows} rows of {width} elements over {_THREADS} threads")
  return pieces_per_row, _THREADS // pieces_per_row


def _loaded_index_layout(rows: int, width: int, dtype):
  """Layout of `load_row_indices`' result: one int32 register per pass in each thread."""
  _, rows_per_pass = _passes(rows, width, dtype)
  return plgpu.Layout.WG_STRIDED(((rows // rows_per_pass) * _THREADS,), vec_size=1)


def load_row_indices(row_index, *, width: int, dtype):
  """The source rows that a `cp_async_rows` call of `width` columns will copy, loaded ahead of
  it: register p of a thread holds the index of the row it copies in pass p. Loaded before the
  producer waits for the stage to be free and passed as `cp_async_rows(..., loaded_indices=...)`
  after that wait, the index loads' latency is off the path from the wait to the copies. Must run
  on a whole warpgroup."""
  rows = row_index.shape[0]
  pieces_per_row, rows_per_pass = _passes(rows, width, dtype)
  passes = rows // rows_per_pass
  layout = _loaded_index_layout(rows, width, dtype)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),),
                     return_type=plgpu.ShapeDtypeStruct((passes * _THREADS,), jnp.int32,
                                                        layout=layout))
  def load(ctx, idx_ref):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    c = mgpu_utils.c
    lane = arith.remui(mgpu_utils.thread_idx(), c(_THREADS, i32))
    first_row = arith.divui(lane, c(pieces_per_row, i32))
    registers = []
    for p in range(passes):
      row = arith.addi(first_row, c(p * rows_per_pass, i32))
      token = memref.load(idx_ref, [arith.index_castui(ir.IndexType.get(), row)])
      registers.append(vector.broadcast(ir.VectorType.get((1,), i32), token))
    return mgpu.FragmentedArray(_registers=np.array(registers, dtype=object),
                                _layout=mgpu.WGStridedFragLayout((passes * _THREADS,), 1),
                                _is_signed=True)

  return load(row_index)


def cp_async_rows(src, row_index, dst, ready, *, source_row_stride: int,
                  block_stride: int = TILE_BYTES, group_stride: int | None = None,
                  next_row_index=None, loaded_indices=None):
  """Issues the gather of `rows` rows into a swizzled stage; `ready` (a `stage_barriers` slot)
  receives one arrival per thread once that thread's copies have landed.

  src: GMEM ref (source rows, width) view of the columns to copy (its row stride is the full
    source width `source_row_stride`, in elements); row_index: GMEM ref (rows,) of source rows;
  dst: SMEM ref whose bytes hold the (8, 64)-tiled, 128-byte-swizzled buffer that wgmma reads (the
    untransformed member of a RefUnion): 128-byte piece j of row r goes to byte
    (r // 8) * group_stride + j * block_stride + (r % 8) * 128. The defaults describe one tiled
    (rows, width) buffer; a buffer split into per-warpgroup column halves passes its own strides.
  Must run on a whole warpgroup; rows * width / 8 a multiple of 128 threads.
  next_row_index: optional GMEM ref of the indices the next call will read; they are prefetched
  into L1, so that the next call's index loads (the only synchronous step) do not wait for L2.
  loaded_indices: `load_row_indices(row_index, ...)` of an earlier point: no index loads here.

  Consecutive threads copy consecutive 16-byte pieces of a row, so a warp instruction reads whole
  128-byte rows (with one thread per row every instruction would touch 32 rows, half a sector each).
  """
  rows = row_index.shape[0]
  width = src.shape[1]
  elem_bytes = jnp.dtype(src.dtype).itemsize
  pieces_per_row, rows_per_pass = _passes(rows, width, src.dtype)
  chunks_per_span = ROW_BYTES // CHUNK
  if group_stride is None:
    group_stride = (width * elem_bytes // ROW_BYTES) * TILE_BYTES

  index_arg, index_type = row_index, plgpu.RefType()
  if loaded_indices is not None:
    index_arg, index_type = loaded_indices, _loaded_index_layout(rows, width, src.dtype)
  args = (src, dst, ready, index_arg) + ((next_row_index,) if next_row_index is not None else ())
  arg_types = (plgpu.RefType(),) * 3 + (index_type,) + (plgpu.RefType(),) * (len(args) - 4)

  @plgpu.inline_mgpu(arg_types=arg_types)
  def issue(ctx, src_ref, dst_ref, ready_ref, index, next_idx_ref=None):
    del ctx
    i8 = ir.IntegerType.get_signless(8)
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    c = mgpu_utils.c
    lane = arith.remui(mgpu_utils.thread_idx(), c(_THREADS, i32))
    piece = arith.remui(lane, c(pieces_per_row, i32))  # the same every pass
    first_row = arith.divui(lane, c(pieces_per_row, i32))
    span = arith.divui(piece, c(chunks_per_span, i32))  # which 128-byte span of the row
    chunk = arith.remui(piece, c(chunks_per_span, i32))
    src_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                                  mgpu_utils.memref_ptr(src_ref))
    src_piece = arith.extui(i64, arith.muli(piece, c(CHUNK, i32)))
    dst_base = mgpu_utils.memref_ptr(dst_ref)
    dst_span = arith.muli(span, c(block_stride, i32))
    tokens = []
    for p in range(rows // rows_per_pass):  # all index loads first: their latencies overlap
      row = arith.addi(first_row, c(p * rows_per_pass, i32))
      if loaded_indices is None:
        token = memref.load(index, [arith.index_castui(ir.IndexType.get(), row)])
      else:
        token = vector.extract(index.registers.flat[p], [], [0])
      tokens.append((row, token))
    for row, token in tokens:
      row_bytes = arith.muli(arith.extui(i64, token), c(source_row_stride * elem_bytes, i64))
      src_ptr = mgpu_utils.getelementptr(src_base, [arith.addi(row_bytes, src_piece)], i8)
      in_tile = arith.andi(row, c(7, i32))  # 128-byte swizzle: chunk q of row r is at q ^ (r % 8)
      dst_off = arith.addi(
          arith.addi(arith.muli(arith.divui(row, c(8, i32)), c(group_stride, i32)), dst_span),
          arith.addi(arith.muli(in_tile, c(ROW_BYTES, i32)),
                     arith.muli(arith.xori(chunk, in_tile), c(CHUNK, i32))))
      dst_ptr = mgpu_utils.getelementptr(dst_base, [dst_off], i8)
      nvvm.cp_async_shared_global(dst_ptr, src_ptr, CHUNK, nvvm.LoadCacheModifierKind.CG)
    # The barrier counts this arrival among its 128 (noinc): the producer never waits for its own
    # copies, the consumers wait on the barrier.
    nvvm.cp_async_mbarrier_arrive(_barrier_ptr(ready_ref), noinc=True)
    if next_idx_ref is not None:  # one thread per 128-byte line of the next indices
      lines = -(-rows * 4 // ROW_BYTES)
      line = arith.remui(lane, c(lines, i32))
      next_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                                     mgpu_utils.memref_ptr(next_idx_ref))
      # Inline PTX: the nvvm.prefetch op's cache-level attribute does not survive the module's
      # serialisation on jax 0.11.2 ("requires specification of either cache level").
      mgpu_utils.inline_ptx(
          "prefetch.global.L1 [$0];",
          mgpu_utils.getelementptr(next_base, [arith.muli(line, c(ROW_BYTES, i32))], i8),
          has_side_effects=True)

  issue(*args)


def interpreted_rows(src, row_index):
  """The interpreter's gather: rows `row_index` of the GMEM view `src`, as a value.

  The interpreter cannot run the inline Mosaic GPU code of `cp_async_rows`, and one TMA copy per
  row costs it two callbacks a row (most of an interpreted test's time: each callback moves a
  buffer between the host and the CPU device). Here a stage costs three: the indices, the source
  columns, and the caller's store of the result into the stage (then a plain arrive on the
  stage's barrier). The tile's rows still come from the kernel's own index arithmetic. Never
  lowered: interpret mode only."""
  return jnp.take(src[...], row_index[...], axis=0)


# One mbarrier per ring stage, in plain SMEM (8 bytes each, as two int32): Pallas barriers cannot be
# handed to inline Mosaic GPU code, and cp.async can only arrive on an mbarrier it is given.
def stage_barriers(stages: int):
  return plgpu.SMEM((stages, 2), jnp.int32)


def _barrier_ptr(ref):
  ptr = mgpu_utils.memref_ptr(ref)
  shared = llvm.PointerType.get(address_space=3)
  return ptr if ptr.type == shared else llvm.addrspacecast(shared, ptr)


def init_stage_barriers(barriers):
  """Initialises every stage barrier for 128 arrivals (the gathering warpgroup's threads). Must
  run on every thread of the CTA (it ends with a CTA-wide barrier), before any use."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def init(ctx, ref):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    first = mgpu_utils.single_thread_predicate(scope=mgpu_utils.ThreadSubset.BLOCK)
    base = _barrier_ptr(ref)
    for i in range(ir.MemRefType(ref.type).shape[0]):
      nvvm.mbarrier_init(mgpu_utils.getelementptr(base, [i], i64), mgpu_utils.c(_THREADS, i32),
                         predicate=first)
    gpu.barrier()

  init(barriers)


def wait_stage(ready, parity):
  """Consumer side: waits for phase `parity` of one stage barrier, then fences so that wgmma (the
  async proxy) sees what the cp.async copies (the generic proxy) wrote."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.Layout.WG_SPLAT))
  def wait(ctx, ref, phase):
    del ctx
    phase = phase.registers.flat[0]  # a splat FragmentedArray of one scalar
    i32 = ir.IntegerType.get_signless(32)
    nvvm.mbarrier_try_wait_parity(_barrier_ptr(ref), phase, mgpu_utils.c(10_000_000, i32))
    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

  wait(ready, parity)
