"""The counting-sort pair placement against the argsort layout: interpreted on CPU, compiled on a GPU
(-m gpu). The two must give the same layout, entry for entry."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sonic_jax import layout as layout_mod
from sonic_jax.layout import build_grouped_layout
from sonic_jax.pallas import pair_placement

ON_GPU = jax.default_backend() == "gpu"
MODES = [pytest.param(False, id="interpret"), pytest.param(True, id="compiled", marks=pytest.mark.gpu)]


def _ids(rng, t, s, e, kind):
  if kind == "skewed":  # most pairs on two experts, several experts empty
    p = np.full(e, 0.2 / e)
    p[: min(2, e)] += 0.8 / min(2, e)
    ids = rng.choice(e, size=(t, s), p=p / p.sum())
  else:
    ids = rng.integers(0, e, (t, s))
  if kind == "dropped":  # some pairs routed nowhere (ids outside [0, E))
    ids[rng.random((t, s)) < 0.2] = -1
    ids[rng.random((t, s)) < 0.1] = e + 3
  return jnp.asarray(ids, jnp.int32)


def _layout(ids, e, row_tile, placement, extra=None):
  old = layout_mod.PLACEMENT
  layout_mod.PLACEMENT = placement
  try:  # traced eagerly: the flag is read while tracing
    return jax.jit(lambda i, x: build_grouped_layout(i, e, row_tile, *x),
                   static_argnums=())(ids, extra if extra is not None else (None, None))
  finally:
    layout_mod.PLACEMENT = old


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("t,s,e,row_tile,kind", [
    (300, 4, 16, 128, "uniform"), (1000, 8, 128, 128, "skewed"), (257, 2, 6, 8, "dropped"),
    (64, 16, 256, 128, "uniform"), (50, 3, 1, 4, "uniform"), (700, 2, 512, 16, "skewed")])
def test_counting_sort_equals_argsort_layout(rng, compiled, t, s, e, row_tile, kind):
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  if compiled:
    t *= 29
  ids = _ids(rng, t, s, e, kind)
  got = _layout(ids, e, row_tile, "kernel")
  want = _layout(ids, e, row_tile, "sort")
  for name, g, w in zip(got._fields, got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
  assert int(got.num_tiles) > 0 or kind == "dropped"


@pytest.mark.parametrize("compiled", MODES)
def test_counting_sort_with_extra_pairs(rng, compiled):
  """Token rounding's extra (token, expert) pairs follow the slot pairs inside their expert."""
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  t, s, e, x = 200, 2, 8, 150
  ids = _ids(rng, t, s, e, "uniform")
  extra = (jnp.asarray(rng.integers(0, t, x), jnp.int32),
           jnp.asarray(np.where(rng.random(x) < 0.3, -1, rng.integers(0, e, x)), jnp.int32))
  got = _layout(ids, e, 16, "kernel", extra)
  want = _layout(ids, e, 16, "sort", extra)
  for name, g, w in zip(got._fields, got, want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_unsupported_problems_are_named():
  assert "E=2000" in pair_placement.supports(100, 2000)
  assert "no pairs" in pair_placement.supports(0, 8)
  with pytest.raises(ValueError, match="E=0"):
    pair_placement.place_pairs(jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32), 0, 8, 64,
                               interpret=True)


def test_kernels_lower_for_cuda():
  """Both Triton passes lower for a GPU from this machine (`jax.export` for 'cuda')."""
  if ON_GPU:
    pytest.skip("CPU-side check")
  from jax._src.mesh import AbstractDevice
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(
        jax.jit(lambda i, tok: pair_placement.place_pairs(i, tok, 128, 128, 40960)),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((20000,), jnp.int32), jax.ShapeDtypeStruct((20000,), jnp.int32))
  assert exported.mlir_module().count("xla.gpu.triton") >= 2
