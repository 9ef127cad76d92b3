"""`Config`: how sonic_jax computes a layer, passed per call.

Every field chooses between implementations of the same math (results differ by float rounding at
most). The defaults are the measured choices (docs/decisions.md); a caller changes one to compare,
to work around a problem, or to use a tuning table measured on their own GPU. A `Config` is frozen
and hashable: under `jax.jit` it is a static Python value, so two configs give two traces.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
  """Implementation choices of `sonic_jax.moe`, `sonic_jax.parallel` and `sonic_jax.layers.MoE`.

  router_kernel_max_experts: on a GPU, a routing whose selection ranks the logits ("softmax_topk",
    "topk_softmax", ...; no selection bias on the scores, no group limit, no router_bias), with x
    and the router weight in one 16-bit dtype (a float32 router weight never takes it), runs the
    router GEMM and the top-K selection as one Pallas kernel up to this many experts E (it reads
    the whole weight per program, so it loses to two kernels at large E) where the kernel takes
    the problem: E a power of two in [2, 256], d a multiple of 64, K <= 32 (a larger value does
    not lift these); 0: never.
  layout_kernel_max_experts: on a GPU, the grouped layout of a routing (top-K, or token
    rounding's with its extra pairs) comes from a block-rank counting kernel up to this many
    experts (E rounded up to a power of two; its work per pair grows with E) where the kernel
    takes the routing (E <= 1024, at most 32 slots per token), else from a sort of the expert
    ids; 0: never.
  gather_sum_kernel: the mosaic_gpu backend's forward aggregation y_t = sum_k s_tk Y[row(t, k)]
    runs the Mosaic GPU gather-sum kernel where the token has at least
    `gather_sum_kernel_min_slots` slots and d >= `gather_sum_kernel_min_d` (it wins on large row
    pieces only), XLA's gather fusion elsewhere. False: always XLA. The backward's dX sum is
    XLA's, fused with the router's input gradient.
  tuning: the mosaic_gpu kernels' per-problem configurations, a
    `sonic_jax.mosaic_gpu.tuning.TuningTable`; None: the table shipped with the package.
  """

  router_kernel_max_experts: int = 128
  layout_kernel_max_experts: int = 128
  gather_sum_kernel: bool = True
  gather_sum_kernel_min_slots: int = 16
  gather_sum_kernel_min_d: int = 4096
  tuning: Any = None

  def __post_init__(self):
    for name in ("router_kernel_max_experts", "layout_kernel_max_experts",
                 "gather_sum_kernel_min_slots", "gather_sum_kernel_min_d"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Config.{name} must be an int >= 0, got {value!r}")
      if value < 0:
        raise ValueError(f"Config.{name} must be an int >= 0, got {value!r}")
      object.__setattr__(self, name, int(value))  # a NumPy integer too: one hash, one repr
    if not isinstance(self.gather_sum_kernel, (bool, np.bool_)):
      raise TypeError(f"Config.gather_sum_kernel must be a bool, got {self.gather_sum_kernel!r}")
    object.__setattr__(self, "gather_sum_kernel", bool(self.gather_sum_kernel))
    if self.tuning is not None:
      from sonic_jax.mosaic_gpu.tuning import TuningTable  # pylint: disable=import-outside-toplevel
      if not isinstance(self.tuning, TuningTable):
        raise TypeError("Config.tuning must be None or a sonic_jax.mosaic_gpu.tuning.TuningTable, "
                        f"got {type(self.tuning).__name__}")


DEFAULT = Config()


def check_config(config: Any) -> Config:
  """`config`, or the defaults for None; a TypeError for anything else."""
  if config is None:
    return DEFAULT
  if not isinstance(config, Config):
    raise TypeError(f"config must be a sonic_jax.Config or None, got {type(config).__name__}")
  return config
