"""The `mosaic_gpu` backend: Hopper kernels for the GEMM roles, the xla path elsewhere.

Forward: up-projection with the activation epilogue, down-projection. Backward: the dH role
(dA' = dO w2^T with the activation-gradient, A_s and dS epilogue), the varlen-K weight gradients
(dw1 = x_rows^T dH, dw2 = A_s^T dO_rows) and the dX role (dH w1^T). The up-projection and dw1
gather the rows of x inside the kernel, dH and dw2 those of dO inside theirs (`gather_source`).
The aggregations (gather-sums) run on the `xla` path, but for the forward's weighted sum where the
gather-sum kernel is faster (`AGGREGATION`); so do the bias gradients and the dS bias term, on the
same layout and with the same residuals. A role whose shape or dtype its kernel does not take
(each kernel module's `supports`) falls back to the xla role, with a `FallbackWarning` that names
the role and the reason.
"""

from __future__ import annotations

import dataclasses

import warnings

import jax.numpy as jnp

from sonic_jax import xla_backend
from sonic_jax.mosaic_gpu import dh_projection as dh
from sonic_jax.mosaic_gpu import down_projection as down
from sonic_jax.mosaic_gpu import dx_projection as dx
from sonic_jax.mosaic_gpu import gather_sum as gs
from sonic_jax.mosaic_gpu import tuning
from sonic_jax.mosaic_gpu import up_projection as up
from sonic_jax.mosaic_gpu import weight_grad as wgrad

ROW_TILE = 128


# Where the GEMMs' gathered rows (x in the up-projection and dw1, dO in dH and dw2) come from.
# "fused": gathered by the kernels as they load their operands (cp.async, gather.py): no
# (T*K, d) gathered copy is ever written. "xla": XLA gathers x[row_token] / dO[row_token] into
# contiguous buffers first. "dh" (dO only): dH gathers the dO rows as it loads them and also
# stores them (`dh_projection(write_d_out_rows=True)`); dw2 reads that copy contiguously.
# Measured on an H100 (benchmarks/NOTES.md, nineteenth session): with dw2's gathered dO on the
# wgmma's M side (`dw2_gathering_d_out`) and the weight-gradient kernel's row indices loaded
# before its stage waits, dw2 with its fused gather takes 0.8-1.15x the time of dw2 on
# contiguous rows, less than what dH's store of those rows costs dH (0.9 ms of 5.0 at
# 32768,4096,1024,128,8): the training step is 0.9-1.7% shorter than with "dh" (35.21 against
# 35.82 ms there, 3.007 against 3.033 at 24576,1536,1024,32,2); an XLA gather of the rows cost
# more than either (ninth session).
GATHER = "fused"


def gather_source(rows: str) -> str:
  """Where the kernels get the gathered rows of `rows` ("x" or "d_out"): "fused", "xla" or
  (d_out only) "dh"."""
  if rows not in ("x", "d_out"):
    raise ValueError(f"rows must be 'x' or 'd_out', got {rows!r}")
  if GATHER not in ("fused", "xla", "dh"):
    raise ValueError(f"GATHER must be 'fused', 'xla' or 'dh', got {GATHER!r}")
  return "fused" if rows == "x" and GATHER == "dh" else GATHER


class FallbackWarning(UserWarning):
  """A role of the mosaic_gpu backend runs its (slow) xla implementation for this problem."""


def _falls_back(role: str, reason: str | None) -> bool:
  """True (after a warning, shown once per role and reason) when the role's kernel cannot run."""
  if reason is None:
    return False
  warnings.warn(f"sonic_jax mosaic_gpu: the {role} runs on the xla path (much slower on a GPU): "
                f"{reason}", FallbackWarning, stacklevel=3)
  return True


# Each role's kernel configuration for a problem: the defaults with what the tuning table gives
# (the layer and benchmarks/kernel_bench.py both ask here).
def up_config(d: int, width: int, num_experts: int) -> up.UpProjectionConfig:
  return up.UpProjectionConfig(tuning.gemm_config("up", d=d, n=width, num_experts=num_experts))


def down_config(d: int, n: int, num_experts: int) -> down.DownProjectionConfig:
  return down.DownProjectionConfig(
      tuning.gemm_config("down", d=d, n=n, num_experts=num_experts),
      **tuning.role_fields("down", d=d, n=n, num_experts=num_experts))


def dh_config(d: int, n: int, num_experts: int,
              gate_up_layout: str = "concat") -> dh.DhProjectionConfig:
  """The tuning table's dH configuration for the problem. A pingpong entry is for the concat
  layout (the interleaved layout reads H's pairs from SMEM, which only the cooperative schedule
  has room for): with the interleaved layout such a problem runs the defaults."""
  gemm = tuning.gemm_config("dh", d=d, n=n, num_experts=num_experts)
  fields = tuning.role_fields("dh", d=d, n=n, num_experts=num_experts)
  if gemm.schedule == "pingpong" and gate_up_layout == "interleaved":
    return dh.DhProjectionConfig(block_n=dh.default_block_n(n))
  return dh.DhProjectionConfig(gemm, **{"block_n": dh.default_block_n(n), **fields})


def dx_config(d: int, width: int, num_experts: int) -> dx.DxProjectionConfig:
  return dx.DxProjectionConfig(tuning.gemm_config("dx", d=d, n=width, num_experts=num_experts))


def weight_grad_config(d: int, n: int, num_experts: int) -> wgrad.WeightGradConfig:
  return dataclasses.replace(wgrad.WeightGradConfig(), **tuning.tuned_fields(
      "weight_grad", d=d, n=n, num_experts=num_experts))


def dw2_gathering_d_out(d_out, a_s, layout, config: wgrad.WeightGradConfig):
  """dw2 = A_s^T dO (E, n, d) with the rows of dO gathered inside the kernel, run as dO_rows^T A_s
  with the accumulators stored transposed, so that the gathered dO is on the wgmma's M side:
  128 x 256 (d, n) blocks, one 64 x 256 wgmma a warpgroup per 16-deep slice, as SonicMoE's dw2
  does. On the N side (A_s^T dO with 256 x 128 (n, d) blocks, two 64 x 128 wgmmas) it measured
  22-24% slower on an H100 at d = 4096, and 1.3-1.6x with 128 x 256 blocks
  (`benchmarks/wgrad_variants.py`)."""
  block_n = 256 if a_s.shape[1] % 256 == 0 else 128
  config = dataclasses.replace(config, block_m=128, block_n=block_n)
  return wgrad.weight_grad(d_out, a_s, layout, config, gathered="lhs", transpose_out=True)


def up_projection(x, w1, b1, layout, activation, gate_up_layout):
  if _falls_back("up-projection", up.supports(x, w1, activation, gate_up_layout)):
    return xla_backend.up_projection(x, w1, b1, layout, activation, gate_up_layout)
  e, d, width = w1.shape
  config = up_config(d, width, e)
  if gather_source("x") == "xla":
    return up.up_projection(x[layout.row_token], w1, b1, layout, activation, gate_up_layout,
                            config=config, gather=False)
  return up.up_projection(x, w1, b1, layout, activation, gate_up_layout, config=config)


def down_projection(a, w2, b2, layout):
  if _falls_back("down-projection", down.supports(a, w2)):
    return xla_backend.down_projection(a, w2, b2, layout)
  e, n, d = w2.shape
  return down.down_projection(a, w2, b2, layout, config=down_config(d, n, e))


def dh_projection(d_out, h, row_scores, w2, b2, layout, activation, gate_up_layout):
  e, n, d = w2.shape
  config = dh_config(d, n, e, gate_up_layout)
  if _falls_back("dH role", dh.supports(h, w2, activation, gate_up_layout, config.block_n)):
    return xla_backend.dh_projection(d_out, h, row_scores, w2, b2, layout, activation,
                                     gate_up_layout)
  source = gather_source("d_out")
  d_out_rows = d_out[layout.row_token] if source == "xla" else None
  outs = dh.dh_projection(d_out if d_out_rows is None else d_out_rows, h, row_scores, w2, layout,
                          activation, config=config, gather=d_out_rows is None,
                          gate_up_layout=gate_up_layout, write_d_out_rows=source == "dh")
  d_h, a_s, d_s_parts = outs[:3]
  if source == "dh":
    d_out_rows = outs[3]  # rows of the tiles in use; the rest are never read
  d_s = jnp.sum(d_s_parts, axis=0)
  if b2 is not None:  # dS also has <dO_t, b2_e>: Y = A w2 + b2 (rows not in use: masked below)
    rows = d_out[layout.row_token] if d_out_rows is None else d_out_rows
    d_s = d_s + jnp.sum(rows.astype(jnp.float32) * xla_backend._row_bias(b2, layout), axis=-1)
  return d_h, a_s, jnp.where(layout.row_valid(), d_s, 0.0), d_out_rows


def weight_grads(x, d_out, d_out_rows, d_h, a_s, row_scores, layout, with_b1, with_b2):
  if _falls_back("weight gradient", wgrad.supports(x, d_h) or wgrad.supports(a_s, d_out)):
    return xla_backend.weight_grads(x, d_out, None, d_h, a_s, row_scores, layout, with_b1,
                                    with_b2)
  # Padding rows of dH and A_s are zero (score 0), so the gathered x and dO need no masking.
  n, d = a_s.shape[1], x.shape[1]
  config = weight_grad_config(d, n, layout.num_experts)
  if gather_source("x") == "fused":
    dw1 = wgrad.weight_grad(x, d_h, layout, config, gathered="lhs")
  else:
    dw1 = wgrad.weight_grad(x[layout.row_token], d_h, layout, config)
  if d_out_rows is not None:  # from dH: XLA's gather or the rows dH gathered and stored
    dw2 = wgrad.weight_grad(a_s, d_out_rows, layout, config)
  else:
    dw2 = dw2_gathering_d_out(d_out, a_s, layout, config)
  # The bias gradients need the dO rows only when b2 exists (db2): dH's, else an XLA gather.
  db2_rows = None
  if with_b2:
    db2_rows = d_out[layout.row_token] if d_out_rows is None else d_out_rows
  db1, db2 = xla_backend.bias_grads(db2_rows, d_h, row_scores, layout, with_b1, with_b2)
  return dw1, dw2, db1, db2


def dx_projection(d_h, w1, layout):
  if _falls_back("dX role", dx.supports(d_h, w1)):
    return xla_backend.dx_projection(d_h, w1, layout)
  e, d, width = w1.shape
  return dx.dx_projection(d_h, w1, layout, config=dx_config(d, width, e))


# How the aggregations run: the forward's y = sum_k s_k Y[row(t, k)] (weighted) and the backward's
# dX sum (unweighted). "kernel": the gather-sum kernel (`gather_sum.py`) for both; "forward": for
# the forward's only; "xla": XLA's gather fusion for both; "auto" (default): the kernel for the
# forward's sum where S >= KERNEL_MIN_SLOTS and d >= KERNEL_MIN_D, XLA elsewhere. Token rounding's
# extra pairs, and operands the kernel does not take, go to XLA either way. Measured on an H100
# (benchmarks/gather_sum_bench.py, benchmarks/NOTES.md, twenty-third session), device time, XLA /
# kernel: 1592 / 1556 us at 32768,4096,*,256,16 (the kernel at 2.93 TB/s), 798 / 806 at K = 8,
# 447 / 447 at K = 4, but 193 / 220 at 40960,768,256,128,8 (and 84 / 105 at 24576,1536,1024,32,2
# before the kernel prefetched its scalars): small pieces, where the per-item overhead shows. The
# backward's unweighted sum stays XLA's, which fuses it with the router's input gradient (the
# training step with the kernel there: -1.5 to +2.7% at three d = 4096 configurations).
AGGREGATION = "auto"
AGGREGATIONS = ("auto", "kernel", "forward", "xla")
KERNEL_MIN_SLOTS = 16
KERNEL_MIN_D = 4096


def _aggregation_kernel(rows, layout, pair_weights) -> bool:
  if AGGREGATION not in AGGREGATIONS:
    raise ValueError(f"AGGREGATION must be one of {AGGREGATIONS}, got {AGGREGATION!r}")
  if layout.num_extra or gs.supports(rows, layout.pair_row, pair_weights) is not None:
    return False
  if AGGREGATION == "auto":
    return (pair_weights is not None and layout.pair_row.shape[1] >= KERNEL_MIN_SLOTS
            and rows.shape[1] >= KERNEL_MIN_D)
  return AGGREGATION == "kernel" or (AGGREGATION == "forward" and pair_weights is not None)


def gather_sum(rows, layout, pair_weights, out_dtype, extra_weights=None):
  if not _aggregation_kernel(rows, layout, pair_weights):
    return xla_backend.gather_sum(rows, layout, pair_weights, out_dtype, extra_weights)
  return gs.gather_sum(rows, layout.pair_row, pair_weights, out_dtype)


def make_backend(base):
  return dataclasses.replace(base, name="mosaic_gpu", row_tile=ROW_TILE,
                             up_projection=up_projection, down_projection=down_projection,
                             gather_sum=gather_sum, dh_projection=dh_projection,
                             weight_grads=weight_grads, dx_projection=dx_projection)
