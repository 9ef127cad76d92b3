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


@pytest.mark.parametrize("compiled", MODES)
def test_near_ties_select_as_lax_top_k(rng, compiled):
  """Values one ulp apart share a bucket of the packed selection's keys, which would order them
  by id instead of by value: inside the k largest (even rows), at the edge between the k-th and
  the (k+1)-th (odd rows), and far below (every row, no effect). The blocks with such rows take
  the exact selection and give lax.top_k's ids; those without take the packed fast path."""
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  t, e, k = (64 * 97 if compiled else 64), 256, 16
  v = rng.standard_normal((t, e)).astype(np.float32)
  order = np.argsort(-v, axis=1, kind="stable")
  rows = np.arange(t)
  near = rng.random(t) < 0.3  # about one row in three: most blocks have one, a few none
  for r in rows[near]:
    hi, lo = (order[r, 1], order[r, 2]) if r % 2 == 0 else (order[r, k - 1], order[r, k])
    v[r, lo] = np.nextafter(v[r, hi], -np.inf)
    v[r, order[r, 100]] = np.nextafter(v[r, order[r, 99]], -np.inf)
  v = jnp.asarray(v)
  top, ids = router_topk.top_k(v, k, interpret=not compiled)
  want_top, want_ids = jax.lax.top_k(v, k)
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


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("t,d,e,k,bias", [
    (300, 128, 128, 8, False), (77, 192, 64, 4, True), (40, 64, 256, 16, False),
    (130, 128, 32, 2, True), (1, 64, 2, 1, False)])
def test_logits_top_k_matches_reference(rng, compiled, t, d, e, k, bias):
  """The router GEMM with the top-K in its epilogue: logits against float64, ids equal to
  lax.top_k of those logits (+ the selection bias), on a token count that no block size divides
  and with tied logits (two equal weight columns: the lower id first)."""
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  if compiled:
    t, d = t * 97, d * 12
  x = rng.standard_normal((t, d))
  w = rng.standard_normal((d, e)) / np.sqrt(d)
  if e > 4:
    w[:, e - 1] = w[:, 2]  # tied logits on every row
  x16, w16 = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal(e) * 0.1, jnp.float32) if bias else None
  logits, ids = router_topk.logits_top_k(x16, w16, k, b, interpret=not compiled)
  assert logits.shape == (t, e) and logits.dtype == jnp.float32
  assert ids.shape == (t, k) and ids.dtype == jnp.int32
  want = np.asarray(x16, np.float64) @ np.asarray(w16, np.float64)
  assert np.linalg.norm(np.asarray(logits) - want) / np.linalg.norm(want) < 1e-5
  values = logits + b if bias else logits
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(jax.lax.top_k(values, k)[1]))


def test_logits_top_k_unsupported_problems_are_named():
  x, w = jnp.zeros((8, 64), jnp.bfloat16), jnp.zeros((64, 16), jnp.bfloat16)
  assert router_topk.logits_supports(x, w, 4) is None
  assert "power of two" in router_topk.logits_supports(x, jnp.zeros((64, 24), jnp.bfloat16), 4)
  assert "d=96" in router_topk.logits_supports(jnp.zeros((8, 96), jnp.bfloat16),
                                               jnp.zeros((96, 16), jnp.bfloat16), 4)
  assert "bfloat16 or float16" in router_topk.logits_supports(x.astype(jnp.float32), w, 4)
  assert "k=17" in router_topk.logits_supports(x, w, 17)
  with pytest.raises(ValueError, match="power of two"):
    router_topk.logits_top_k(x, jnp.zeros((64, 24), jnp.bfloat16), 4, interpret=True)


def test_logits_top_k_lowers_for_cuda():
  """The fused router kernel lowers for a GPU from this machine, at the grid's sizes."""
  if ON_GPU:
    pytest.skip("CPU-side check")
  for d, e, k in ((768, 128, 8), (4096, 256, 16)):
    module = export_for_h100(lambda x, w: router_topk.logits_top_k(x, w, k),
                             jax.ShapeDtypeStruct((40961, d), jnp.bfloat16),
                             jax.ShapeDtypeStruct((d, e), jnp.bfloat16))
    assert "xla.gpu.triton" in module


@pytest.mark.parametrize("compiled", MODES)
def test_fused_router_routes_and_differentiates_as_the_unfused_one(rng, compiled):
  """`router_logits_and_ids` with the fused kernel against the GEMM + `route`'s own top-K: the same
  expert ids, scores and logits' gradients (x and the router weight, through the scores and a
  z-loss) under jit and grad, with a selection bias (no gradient into it)."""
  from sonic_jax import routing
  if compiled != ON_GPU:
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  t, d, e, k = (200, 128, 64, 6) if not compiled else (4000, 768, 128, 8)
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((d, e)) / np.sqrt(d), jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal(e) * 0.3, jnp.float32)
  g = jnp.asarray(rng.standard_normal((t, k)), jnp.float32)

  def loss(x, w, bias, fused):
    logits, ids = routing.router_logits_and_ids(x, w, k, "softmax_topk", bias, fused=fused)
    assert (ids is not None) == fused
    r = routing.route(logits, k, "softmax_topk", bias, ids)
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return jnp.sum(r.scores * g) + z, (r.expert_ids, r.scores)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
  (_, (ids, scores)), grads = step(x, w, bias, True)
  (_, (want_ids, want_scores)), want_grads = step(x, w, bias, False)
  np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
  np.testing.assert_allclose(np.asarray(scores), np.asarray(want_scores), rtol=1e-5, atol=1e-6)
  for got, want in zip(grads[:2], want_grads[:2]):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
  assert not np.any(np.asarray(grads[2]))
  with pytest.raises(ValueError, match="ranks scores"):  # a bias on the probabilities
    routing.router_logits_and_ids(x, w, k, "topk_softmax", jnp.zeros((w.shape[1],)), fused=True)
