"""Backend selection: one switch, every backend running the same roles on the same layout."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Callable

import jax

from sonic_jax import xla_backend

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


def interpreting() -> bool:
  """Whether Pallas kernels are being traced for Mosaic GPU interpret mode (on a CPU)."""
  from jax._src import config as jax_config  # set by plgpu.force_gpu_interpret_mode
  return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


# Mosaic GPU interpret mode runs each warpgroup of a kernel on a thread of its own and blocks in
# io_callbacks (barrier waits) that XLA's CPU runtime may run on its intra-op thread pool; a kernel
# of a 2-CTA cluster can hold 7 of its threads at once (6 warpgroups and the callback that waits
# for them). With fewer threads the last warpgroup can starve: an intermittent hang at 0% CPU.
# The pool's size is PJRT_NPROC (or NPROC) when set, else the CPUs this process may run on.
INTERPRETER_MIN_CPU_THREADS = 8


def cpu_client_threads() -> int:
  """The thread count XLA's CPU client takes for its intra-op pool (read when it starts)."""
  for name in ("PJRT_NPROC", "NPROC"):
    value = os.environ.get(name, "")
    if value.strip().isdigit():
      return int(value)
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return os.cpu_count() or 1


def warn_if_interpreter_may_hang() -> None:
  """Called by the kernels when they are traced for interpret mode."""
  threads = cpu_client_threads()
  if threads < INTERPRETER_MIN_CPU_THREADS:
    warnings.warn(
        f"sonic_jax: Mosaic GPU interpret mode on a CPU client with {threads} threads can hang "
        f"(its warpgroups block XLA's CPU thread pool in barrier waits); set PJRT_NPROC="
        f"{2 * INTERPRETER_MIN_CPU_THREADS} in the environment before JAX starts "
        "(tests/conftest.py does).", RuntimeWarning, stacklevel=2)


def _mosaic_gpu() -> Backend:
  from sonic_jax.mosaic_gpu.backend import make_backend  # imports Pallas only when asked for
  return make_backend(XLA)


def resolve_backend(name: str) -> Backend:
  """Maps a backend name to its functions; "auto" picks the fastest one available here.

  "mosaic_gpu" needs an sm90 GPU (H100/H200), or Mosaic GPU interpret mode
  (`plgpu.force_gpu_interpret_mode`) on a CPU; "auto" chooses it on sm90 and "xla" elsewhere.
  """
  if name == "auto":
    return _mosaic_gpu() if _device_is_hopper() else _xla_for_platform()
  if name == "xla":
    return _xla_for_platform()
  if name == "mosaic_gpu":
    if _device_is_hopper() or (interpreting() and jax.default_backend() == "cpu"):
      return _mosaic_gpu()
    dev = jax.devices()[0]
    raise ValueError(
        "backend='mosaic_gpu' needs an sm90 (Hopper) GPU or Mosaic GPU interpret mode on CPU; "
        f"this device is {dev.device_kind} ({dev.platform}, compute capability "
        f"{getattr(dev, 'compute_capability', 'n/a')}). Use backend='auto' or 'xla'.")
  raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
