"""Mosaic GPU interpret mode: whether kernels are being traced for it, and its CPU-thread needs.

A leaf module: the kernels and the backend selection both ask here, and it imports no kernel.
"""

from __future__ import annotations

import os
import warnings

# Interpret mode runs each warpgroup of a kernel on a thread of its own and blocks in io_callbacks
# (barrier waits) that XLA's CPU runtime may run on its intra-op thread pool; a kernel of a 2-CTA
# cluster can hold 7 of its threads at once (6 warpgroups and the callback that waits for them).
# With fewer threads the last warpgroup can starve: an intermittent hang at 0% CPU. The pool's
# size is PJRT_NPROC (or NPROC) when set, else the CPUs this process may run on.
MIN_CPU_THREADS = 8


def interpreting() -> bool:
  """Whether Pallas kernels are being traced for Mosaic GPU interpret mode (on a CPU)."""
  from jax._src import config as jax_config  # set by plgpu.force_gpu_interpret_mode
  return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


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
  if threads < MIN_CPU_THREADS:
    warnings.warn(
        f"sonic_jax: Mosaic GPU interpret mode on a CPU client with {threads} threads can hang "
        f"(its warpgroups block XLA's CPU thread pool in barrier waits); set PJRT_NPROC="
        f"{2 * MIN_CPU_THREADS} in the environment before JAX starts "
        "(tests/conftest.py does).", RuntimeWarning, stacklevel=2)
