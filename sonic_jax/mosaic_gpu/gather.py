"""The gather prologue: rows of a GMEM matrix, picked by an index vector, into a swizzled A stage.

Hopper has no TMA gather (tile::gather4 is sm100), so the memory warpgroup gathers with cp.async,
as SonicMoE does: its 128 threads take one row each and copy it as 16-byte pieces straight into the
128-byte-swizzled SMEM layout that wgmma reads. Completion is tracked with cp.async groups; once a
stage's group is complete the writers fence their writes into the async proxy (wgmma's) and the
stage's barrier receives one arrival.

Status (H200, jax 0.11.2): the cp.async path compiles but the kernel does not complete (a hang,
not yet diagnosed: `benchmarks/gather_check.py` reproduces it with a time limit), so it is not the
default. `row_tma` (one TMA copy of a (1, 64) box per row) is exact on the GPU but issue-bound:
about 7x slower than the same kernel on a pre-gathered input. The interpreter cannot run inline
Mosaic GPU code and always uses `row_tma`.
"""

from __future__ import annotations

from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm

ROW_BYTES = 128  # one tile_k = 64 row of a 16-bit operand: one 128-byte swizzle span
CHUNK = 16  # bytes per cp.async


def cp_async_rows(src_cols, row_index, dst_stage, *, row_elems: int, source_row_stride: int):
  """Issues (and commits as one cp.async group) the gather of one A stage.

  src_cols: GMEM ref (rows, row_elems) view of the source's k-slice (its row stride is the full
    source width `source_row_stride`); row_index: GMEM ref (tile_m,) of source rows;
  dst_stage: untransformed SMEM ref (tile_m, row_elems) of the stage (the (1, 64)/(8, 64)-tiled
    views alias its bytes). Must run on a whole warpgroup of tile_m = 128 threads.
  """

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType()))
  def issue(ctx, src, idx, dst):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    i64 = ir.IntegerType.get_signless(64)
    index = ir.IndexType.get()
    elem = ir.MemRefType(src.type).element_type
    elem_bytes = mgpu_utils.bitwidth(elem) // 8
    lane = arith.remui(mgpu_utils.thread_idx(), mgpu_utils.c(128, i32))
    token = memref.load(idx, [arith.index_castui(index, lane)])
    src_base = llvm.addrspacecast(llvm.PointerType.get(address_space=1),
                                  mgpu_utils.memref_ptr(src))
    row_off = arith.muli(arith.extui(i64, token), mgpu_utils.c(source_row_stride, i64))
    src_row = mgpu_utils.getelementptr(src_base, [row_off], elem)
    dst_row = mgpu_utils.getelementptr(mgpu_utils.memref_ptr(dst),
                                       [arith.muli(lane, mgpu_utils.c(row_elems, i32))], elem)
    swizzle_row = arith.andi(lane, mgpu_utils.c(7, i32))  # 128B swizzle: chunk ^= row % 8
    chunk_elems = CHUNK // elem_bytes
    for chunk in range(ROW_BYTES // CHUNK):
      src_ptr = mgpu_utils.getelementptr(src_row, [chunk * chunk_elems], elem)
      dst_chunk = arith.xori(mgpu_utils.c(chunk, i32), swizzle_row)
      dst_ptr = mgpu_utils.getelementptr(
          dst_row, [arith.muli(dst_chunk, mgpu_utils.c(chunk_elems, i32))], elem)
      nvvm.cp_async_shared_global(dst_ptr, src_ptr, CHUNK, nvvm.LoadCacheModifierKind.CG)
    nvvm.cp_async_commit_group()

  issue(src_cols, row_index, dst_stage)


def cp_async_wait(groups_in_flight: int):
  """Waits until at most `groups_in_flight` of this thread's cp.async groups are pending."""

  @plgpu.inline_mgpu()
  def wait(ctx):
    del ctx
    nvvm.cp_async_wait_group(groups_in_flight)

  wait()
