"""The `mosaic_gpu` backend: Hopper kernels for the GEMM roles, the xla path elsewhere.

Forward: up-projection with the activation epilogue, down-projection, and the weighted gather-sum
where it is faster than XLA's (`Config.gather_sum_kernel*`). Backward: the dH role
(dA' = dO w2^T with the activation-gradient, A_s and dS epilogue), the varlen-K weight gradients
(dw1 = x_rows^T dH, dw2 = A_s^T dO_rows) and the dX role (dH w1^T). The up-projection and dw1 gather
the rows of x as they load their operands, dH and dw2 those of dO: no gathered copy is written, but
for dO's rows with a b2 bias (its dS term and db2 gather them in XLA). The backward's dX sum, the
bias gradients and the dS bias term run on the xla path, on the same layout and with the same
residuals. A role whose shape or dtype its kernel does not take (each kernel module's `supports`)
falls back to the xla role, with a `FallbackWarning` that names the role and the reason.

Each role's kernel configuration comes from the tuning table (`Config.tuning`, default the
packaged one); `role_configs` says which one a problem gets.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple
import warnings

import jax
import jax.numpy as jnp

from sonic_jax import xla_backend
from sonic_jax.config import Config
from sonic_jax.interpret import interpreting
from sonic_jax.mosaic_gpu import dh_projection as dh
from sonic_jax.mosaic_gpu import down_projection as down
from sonic_jax.mosaic_gpu import dx_projection as dx
from sonic_jax.mosaic_gpu import gather_sum as gs
from sonic_jax.mosaic_gpu import tuning
from sonic_jax.mosaic_gpu import up_projection as up
from sonic_jax.mosaic_gpu import weight_grad as wgrad
from sonic_jax.mosaic_gpu.grouped_gemm import TILE_M, GroupedGemmConfig
from sonic_jax.pallas import extras_sum

ROW_TILE = TILE_M


class FallbackWarning(UserWarning):
  """A role of the mosaic_gpu backend runs its (slow) xla implementation for this problem."""


def _int32(kernel):
  """A Mosaic GPU kernel, traced with jax_enable_x64 off: its index arithmetic mixes int32 values
  with Python ints, which x64 makes int64 (and lax.rem and the like refuse mixed dtypes). It takes
  16-bit operands only (a float64 one would be cast inside); 64-bit integer ones (indices) are
  cast to int32 first. The XLA fallbacks, and the Triton kernels, run outside it."""
  narrow = lambda a: a.astype(jnp.int32) if getattr(a, "dtype", None) == jnp.int64 else a

  @functools.wraps(kernel)
  def traced(*args, **kwargs):
    args, kwargs = jax.tree.map(narrow, (args, kwargs))
    with jax.enable_x64(False):
      return kernel(*args, **kwargs)
  return traced


def _falls_back(role: str, reason: str | None) -> bool:
  """True (after a warning, shown once per role and reason) when the role's kernel cannot run."""
  if reason is None:
    return False
  warnings.warn(f"sonic_jax mosaic_gpu: the {role} runs on the xla path (much slower on a GPU): "
                f"{reason}", FallbackWarning, stacklevel=3)
  return True


class RoleConfigs(NamedTuple):
  """The kernel configuration of every role for one problem."""

  up: up.UpProjectionConfig
  down: down.DownProjectionConfig
  dh: dh.DhProjectionConfig
  dx: dx.DxProjectionConfig
  weight_grad: wgrad.WeightGradConfig


def role_configs(d: int, n: int, num_experts: int, glu: bool, gate_up_layout: str = "concat",
                 config: Config = Config()) -> RoleConfigs:
  """Each role's kernel configuration for a problem: the defaults with what the tuning table
  gives (n: the expert's hidden units; w1 is 2n wide for a GLU)."""
  table = config.tuning if config.tuning is not None else tuning.packaged()
  width = 2 * n if glu else n

  def fields(role, role_n):
    return table.fields(role, d=d, n=role_n, num_experts=num_experts)

  def gemm(role_fields):
    return dataclasses.replace(GroupedGemmConfig(), **{
        k: v for k, v in role_fields.items() if k in tuning.GEMM_FIELDS})

  dh_fields = fields("dh", n)
  dh_gemm = gemm(dh_fields)
  if dh_gemm.schedule == "pingpong" and gate_up_layout == "interleaved":
    # A pingpong entry is for the concat layout: the interleaved layout reads H's pairs from SMEM,
    # which only the cooperative schedule has room for.
    dh_config = dh.DhProjectionConfig(block_n=dh.default_block_n(n))
  else:
    # pingpong's warpgroups each hold a whole tile: its column block is the narrow one
    block_n = dh.PREFETCH_BLOCK_N if dh_gemm.schedule == "pingpong" else dh.default_block_n(n)
    dh_config = dh.DhProjectionConfig(dh_gemm, block_n=block_n, **{
        k: v for k, v in dh_fields.items() if k in tuning.DH_FIELDS})
  return RoleConfigs(
      up=up.UpProjectionConfig(gemm(fields("up", width))),
      down=down.DownProjectionConfig(gemm(fields("down", n))),
      dh=dh_config,
      dx=dx.DxProjectionConfig(gemm(fields("dx", width))),
      weight_grad=dataclasses.replace(wgrad.WeightGradConfig(), **fields("weight_grad", n)))


def dw2_config(n: int, config: wgrad.WeightGradConfig) -> wgrad.WeightGradConfig:
  """dw2's blocks: 128 x 256 (d, n) where n allows, else 128 x 128."""
  return dataclasses.replace(config, block_n=256 if n % 256 == 0 else 128)


def dw2_gathering_d_out(d_out, a_s, layout, config: wgrad.WeightGradConfig):
  """dw2 = A_s^T dO (E, n, d) with the rows of dO gathered inside the kernel, run as dO_rows^T A_s
  with the accumulators stored transposed, so that the gathered dO is on the wgmma's M side:
  one 64 x 256 wgmma a warpgroup per 16-deep slice where n allows, as SonicMoE's dw2 does
  (docs/decisions.md)."""
  return _int32(wgrad.weight_grad)(d_out, a_s, layout, dw2_config(a_s.shape[1], config),
                                   transpose_out=True)


def up_projection(x, w1, b1, layout, activation, gate_up_layout, *, config: Config):
  if _falls_back("up-projection", up.supports(x, w1, activation, gate_up_layout)):
    return xla_backend.up_projection(x, w1, b1, layout, activation, gate_up_layout)
  e, d, width = w1.shape
  n = width // activation.width_multiplier()
  configs = role_configs(d, n, e, activation.is_glu, gate_up_layout, config)
  return _int32(up.up_projection)(x, w1, b1, layout, activation, gate_up_layout,
                                  config=configs.up)


def down_projection(a, w2, b2, layout, *, config: Config):
  if _falls_back("down-projection", down.supports(a, w2)):
    return xla_backend.down_projection(a, w2, b2, layout)
  e, n, d = w2.shape
  configs = role_configs(d, n, e, True, config=config)
  return _int32(down.down_projection)(a, w2, b2, layout, config=configs.down)


def dh_projection(d_out, h, row_scores, w2, b2, layout, activation, gate_up_layout, *,
                  config: Config):
  e, n, d = w2.shape
  dh_config = role_configs(d, n, e, activation.is_glu, gate_up_layout, config).dh
  if _falls_back("dH role", dh.supports(h, w2, gate_up_layout, dh_config.block_n)):
    return xla_backend.dh_projection(d_out, h, row_scores, w2, b2, layout, activation,
                                     gate_up_layout)
  d_h, a_s, d_s_parts = _int32(dh.dh_projection)(d_out, h, row_scores, w2, layout, activation,
                                                 config=dh_config, gate_up_layout=gate_up_layout)
  d_s = jnp.sum(d_s_parts, axis=0)
  rows = None  # the kernels gather the dO rows themselves: only the bias terms need them in HBM
  if b2 is not None:  # dS also has <dO_t, b2_e>: Y = A w2 + b2 (rows not in use: masked below)
    rows = d_out[layout.row_token]
    d_s = d_s + xla_backend.bias_score_term(rows, b2, layout, jnp.float32)
  return d_h, a_s, jnp.where(layout.row_valid(), d_s, 0.0), rows


def weight_grads(x, d_out, d_out_rows, d_h, a_s, row_scores, layout, with_b1, with_b2, *,
                 config: Config):
  n, d = a_s.shape[1], x.shape[1]
  wg_config = role_configs(d, n, layout.num_experts, True, config=config).weight_grad
  reason = (wgrad.supports(x, d_h, wg_config)
            or wgrad.supports(d_out, a_s, dw2_config(n, wg_config)))
  if _falls_back("weight gradient", reason):
    return xla_backend.weight_grads(x, d_out, d_out_rows, d_h, a_s, row_scores, layout, with_b1,
                                    with_b2)
  # Padding rows of dH and A_s are zero (score 0), so the gathered x and dO need no masking: their
  # rows there are a token of the same expert (layout.py), which reaches that gradient anyway.
  dw1 = _int32(wgrad.weight_grad)(x, d_h, layout, wg_config)
  dw2 = dw2_gathering_d_out(d_out, a_s, layout, wg_config)
  db2_rows = None  # db2 alone needs the dO rows: dH gathered them for its own bias term
  if with_b2:
    db2_rows = d_out[layout.row_token] if d_out_rows is None else d_out_rows
  db1, db2 = xla_backend.bias_grads(db2_rows, d_h, row_scores, layout, with_b1, with_b2)
  return dw1, dw2, db1, db2


def dx_projection(d_h, w1, layout, *, config: Config):
  if _falls_back("dX role", dx.supports(d_h, w1)):
    return xla_backend.dx_projection(d_h, w1, layout)
  e, d, width = w1.shape
  configs = role_configs(d, width // 2, e, True, config=config)  # dX reads w1 whole
  return _int32(dx.dx_projection)(d_h, w1, layout, config=configs.dx)


def gather_sum(rows, layout, pair_weights, out_dtype, extra_weights=None, *, config: Config):
  """The forward's weighted sum by the Mosaic GPU kernel where `config` says so, all else by XLA's
  gather fusion (the backward's unweighted dX sum fuses with the router's input gradient there).
  Token rounding's extra pairs, if any, are first folded into each token's slot 0
  (`sonic_jax.pallas.extras_sum`, reading only the pairs in use; compiled only: under interpret
  mode, without slots, and where it does not apply, XLA's segment sum adds them), so the sum reads
  top-K's slots alone. Unweighted (None), every slot counts 1."""
  if layout.num_extra and layout.pair_row.shape[1] and extras_sum.AVAILABLE and (
      not interpreting() and extras_sum.supports(rows) is None):
    rows, slot_row, slot_weight = extras_sum.fold_extras(
        rows, layout.pair_row[:, 0], None if pair_weights is None else pair_weights[:, 0],
        layout.extra_token, layout.extra_row, extra_weights)
    layout = layout._replace(pair_row=layout.pair_row.at[:, 0].set(slot_row),
                             extra_row=layout.extra_row[:0], extra_token=layout.extra_token[:0])
    if pair_weights is not None:
      pair_weights = pair_weights.at[:, 0].set(slot_weight)
    extra_weights = None
  use_kernel = (config.gather_sum_kernel and pair_weights is not None and not layout.num_extra
                and layout.pair_row.shape[1] >= config.gather_sum_kernel_min_slots
                and rows.shape[1] >= config.gather_sum_kernel_min_d
                and gs.supports(rows, layout.pair_row, pair_weights) is None)
  if not use_kernel:
    return xla_backend.gather_sum(rows, layout, pair_weights, out_dtype, extra_weights)
  return _int32(gs.gather_sum)(rows, layout.pair_row, pair_weights, out_dtype)


@functools.cache
def make_backend(base, config: Config):
  """The backend for `config` (cached: equal configs give the same object, so traces that see it
  as a static argument match)."""
  bind = lambda fn: functools.partial(fn, config=config)
  return dataclasses.replace(
      base, name="mosaic_gpu", row_tile=ROW_TILE, up_projection=bind(up_projection),
      down_projection=bind(down_projection), gather_sum=bind(gather_sum),
      dh_projection=bind(dh_projection), weight_grads=bind(weight_grads),
      dx_projection=bind(dx_projection))
