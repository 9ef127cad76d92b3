"""The router top-K kernel against jax.lax.top_k: interpreted on CPU, compiled on a GPU (-m gpu)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import export_for_h100
from sonic_jax.pallas import router_topk

ON_GPU = jax.default_backend() == "gpu"
MODES = [pytest.param(False, id="interpret"), pytest.param(True, id="compiled", marks=pytest.mark.gpu)]


def _values(rng, t, e, special):
  v = rng.standard_normal((t, e)).astype(np.float32)
  if special:
    v[0] = -np.inf  # every value equal: ids in order, all distinct
    v[1, [3, e - 1]] = np.nan  # NaN ranks first, lower id first
    v[2, :] = np.round(v[2, :])  # many ties
    v[3, : e // 2] = 7.0
  return jnp.asarray(v)


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("t,e,k,special", [
    (100, 128, 8, True), (37, 64, 4, True), (70, 256, 16, False), (9, 32, 6, True),
    (5, 2, 2, False), (300, 16, 1, False)])
def test_top_k_equals_lax_top_k(rng, compiled, t, e, k, special):
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  if compiled:
    t = t * 97
  v = _values(rng, t, e, special)
  top, ids = router_topk.top_k(v, k, interpret=not compiled)
  want_top, want_ids = jax.lax.top_k(v, k)
  assert top.shape == (t, k) and ids.shape == (t, k) and ids.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
  np.testing.assert_array_equal(np.asarray(top), np.asarray(want_top))


def test_unsupported_problems_are_named():
  v = jnp.zeros((8, 96), jnp.float32)
  assert "power of two" in router_topk.supports(v, 4)
  assert "k=0" in router_topk.supports(jnp.zeros((8, 64)), 0)
  assert "k=40" in router_topk.supports(jnp.zeros((8, 64)), 40)
  assert "float32" in router_topk.supports(jnp.zeros((8, 64), jnp.bfloat16), 4)
  with pytest.raises(ValueError, match="power of two"):
    router_topk.top_k(v, 4, interpret=True)


def test_kernel_lowers_for_cuda():
  """The Triton kernel lowers for a GPU from this machine (`jax.export` for 'cuda')."""
  if ON_GPU:
    pytest.skip("CPU-side check")
  module = export_for_h100(lambda v: router_topk.top_k(v, 8),
                           jax.ShapeDtypeStruct((1000, 128), jnp.float32))
  assert "xla.gpu.triton" in module
