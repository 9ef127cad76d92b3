"""The one-pass layout placement kernel against the XLA placement: interpreted on CPU, compiled on
a GPU (-m gpu); both must give the same layout, array by array."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sonic_jax.layout import build_grouped_layout
from sonic_jax.pallas import layout_rows

ON_GPU = jax.default_backend() == "gpu"
MODES = [pytest.param(False, id="interpret"), pytest.param(True, id="compiled", marks=pytest.mark.gpu)]


def _ids(rng, t, s, e, kind):
  ids = rng.integers(0, e, (t, s))
  if kind == "skewed":  # most pairs on expert 0, the last expert empty
    ids[: 3 * t // 4, 0] = 0
    ids[ids == e - 1] = 1
  elif kind == "dropped":  # ids outside [0, E): routed nowhere, pair_row = R
    ids[::5, -1] = -1
    ids[1::7, 0] = e + 3
  elif kind == "one_expert":
    ids[:] = e // 2
  return jnp.asarray(ids, jnp.int32)


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("t,s,e,tile,kind", [
    (100, 2, 4, 16, "uniform"), (70, 3, 6, 16, "skewed"), (50, 2, 16, 32, "dropped"),
    (33, 1, 5, 16, "one_expert"), (200, 4, 64, 128, "skewed"), (9, 2, 3, 16, "dropped")])
def test_kernel_layout_equals_xla_layout(rng, compiled, t, s, e, tile, kind):
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  if compiled:
    t = t * 211
  ids = _ids(rng, t, s, e, kind)
  want = build_grouped_layout(ids, e, tile, placement="xla")
  got = jax.jit(lambda i: build_grouped_layout(i, e, tile, placement="kernel"))(ids)
  for name in want._fields:
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                  err_msg=name)


def test_auto_placement_is_xla_off_a_gpu_and_where_the_kernel_does_not_apply(rng):
  ids = _ids(rng, 40, 2, 4, "uniform")
  if not ON_GPU:
    jaxpr = str(jax.make_jaxpr(lambda i: build_grouped_layout(i, 4, 16))(ids))
    assert "pallas_call" not in jaxpr
  extra = jnp.zeros((3,), jnp.int32)
  with pytest.raises(ValueError, match="extra pairs"):
    build_grouped_layout(ids, 4, 16, extra, extra, placement="kernel")
  with pytest.raises(ValueError, match="placement must be one of"):
    build_grouped_layout(ids, 4, 16, placement="triton")
  assert "row_tile" in layout_rows.supports(80, 4, 128, 24, 7)
  assert "E=2000" in layout_rows.supports(80, 2000, 4096, 128, 7)


def test_kernel_lowers_for_cuda():
  """The Triton kernel lowers for a GPU from this machine (`jax.export` for 'cuda')."""
  if ON_GPU:
    pytest.skip("CPU-side check")
  from jax._src.mesh import AbstractDevice
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=132))
  with jax.sharding.use_abstract_mesh(mesh):
    exported = jax.export.export(
        jax.jit(lambda i: build_grouped_layout(i, 128, 128, placement="kernel")),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            jax.ShapeDtypeStruct((4096, 8), jnp.int32))
  assert "xla.gpu.triton" in exported.mlir_module()
