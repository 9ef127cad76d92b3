"""Backend selection: one switch, every backend running the same roles on the same layout."""

from __future__ import annotations

import dataclasses
from typing import Callable

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
    row_tile=32,  # rows per scan step of its grouped GEMMs
    up_projection=xla_backend.up_projection,
    down_projection=xla_backend.down_projection,
    gather_sum=xla_backend.gather_sum,
    dh_projection=xla_backend.dh_projection,
    weight_grads=xla_backend.weight_grads,
    dx_projection=xla_backend.dx_projection,
)


def resolve_backend(name: str) -> Backend:
  """Maps a backend name to its functions; "auto" picks the fastest one available here."""
  if name == "auto":
    return XLA  # the Hopper kernels are not part of this version yet
  if name == "xla":
    return XLA
  if name == "mosaic_gpu":
    raise NotImplementedError(
        "backend='mosaic_gpu' (Hopper wgmma kernels) is not available in this version of "
        "sonic_jax; use backend='xla' or 'auto'.")
  raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
