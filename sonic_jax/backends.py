"""Backend selection: one switch, every backend running the same roles on the same layout."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from sonic_jax import xla_backend
from sonic_jax.config import Config, check_config
from sonic_jax.interpret import interpreting

BACKENDS = ("auto", "xla", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class Backend:
  """The per-role functions of one backend (see `sonic_jax.xla_backend` for their contracts).

  `row_tile` is the row granularity of the grouped layout that the backend's grouped GEMMs need:
  every `row_tile` rows of the grouped buffer belong to one expert.
  """

  name: str
  row_tile: int
  up_projection: Callable
  down_projection: Callable
  gather_sum: Callable
  dh_projection: Callable
  weight_grads: Callable
  dx_projection: Callable


XLA = Backend(
    name="xla",
    row_tile=32,  # rows per scan step of its grouped GEMMs (128 on GPUs and TPUs)
    up_projection=xla_backend.up_projection,
    down_projection=xla_backend.down_projection,
    gather_sum=xla_backend.gather_sum,
    dh_projection=xla_backend.dh_projection,
    weight_grads=xla_backend.weight_grads,
    dx_projection=xla_backend.dx_projection,
)


def _xla_for_platform() -> Backend:
  # On accelerators a 32-row scan step is mostly loop overhead; 128-row steps run 4x fewer.
  if jax.default_backend() == "cpu":
    return XLA
  return dataclasses.replace(XLA, row_tile=128)


def _device_is_hopper() -> bool:
  dev = jax.devices()[0]
  return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")) == "9.0"


def _mosaic_gpu(config: Config) -> Backend:
  from sonic_jax.mosaic_gpu.backend import make_backend  # imports Pallas only when asked for
  return make_backend(XLA, config)


def resolve_backend(name: str, config: Config | None = None) -> Backend:
  """Maps a backend name to its functions; "auto" picks the fastest one available here.

  "mosaic_gpu" needs an sm90 GPU (H100/H200), or Mosaic GPU interpret mode
  (`plgpu.force_gpu_interpret_mode`) on a CPU; "auto" chooses it on sm90 and "xla" elsewhere.
  `config` (a `sonic_jax.Config`) configures the mosaic_gpu kernels.
  """
  config = check_config(config)
  if name == "auto":
    return _mosaic_gpu(config) if _device_is_hopper() else _xla_for_platform()
  if name == "xla":
    return _xla_for_platform()
  if name == "mosaic_gpu":
    if _device_is_hopper() or (interpreting() and jax.default_backend() == "cpu"):
      return _mosaic_gpu(config)
    dev = jax.devices()[0]
    raise ValueError(
        "backend='mosaic_gpu' needs an sm90 (Hopper) GPU or, on a CPU, Mosaic GPU interpret mode "
        "(call inside `with jax.experimental.pallas.mosaic_gpu.force_gpu_interpret_mode():`); "
        f"this device is {dev.device_kind} ({dev.platform}, compute capability "
        f"{getattr(dev, 'compute_capability', 'n/a')}). Use backend='auto' or 'xla'.")
  raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
