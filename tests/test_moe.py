"""sonic_jax.moe (xla backend) against the float64 oracle, under JAX transformations, bad input."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sonic_jax
from cases import GLU, gemm_operand_dtypes, make_problem
from oracle import reference_values_and_grads, rel_err, select_experts

ACTS = ["swiglu", "geglu", "reglu", "geglu_tanh", "clamped_swiglu", "gelu", "gelu_tanh", "relu",
        "relu_sq", "silu"]
ROUTINGS = list(sonic_jax.ROUTINGS)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
ARG_NAMES = ("x", "router_weight", "w1", "w2", "b1", "b2")


def run_moe(p, d_y, dtype, **kw):
  """Output and gradients of sonic_jax.moe for the float64 problem p, computed at `dtype`."""
  cast = {k: None if v is None else jnp.asarray(v, dtype) for k, v in p.items()}
  names = [k for k in ARG_NAMES if cast[k] is not None]

  def f(*flat):
    a = dict(cast)
    a.update(zip(names, flat))
    y, aux = sonic_jax.moe(a["x"], a["router_weight"], a["w1"], a["w2"], b1=a["b1"], b2=a["b2"],
                           **kw)
    return jnp.vdot(y.astype(jnp.float32), jnp.asarray(d_y, jnp.float32)), (y, aux)

  # One program for the value and the gradients (a jitted f under an eager grad compiles several).
  (_, (y, aux)), grads = jax.jit(jax.value_and_grad(f, argnums=tuple(range(len(names))),
                                                    has_aux=True))(*[cast[k] for k in names])
  return y, aux, dict(zip(names, grads)), cast


def check_against_oracle(p, d_y, dtype, *, top_k, activation, routing, gate_up_layout):
  y, aux, grads, cast = run_moe(p, d_y, dtype, top_k=top_k, activation=activation,
                                routing=routing, gate_up_layout=gate_up_layout, backend="xla")
  # The oracle sees exactly the values the op saw (rounded to `dtype`).
  seen = {k: None if v is None else np.asarray(v.astype(jnp.float32), np.float64)
          for k, v in cast.items()}
  ids = select_experts(seen["x"], seen["router_weight"], top_k)
  np.testing.assert_array_equal(np.sort(np.asarray(aux.expert_ids), -1), np.sort(ids, -1))
  y_ref, g_ref = reference_values_and_grads(seen, d_y, ids, routing=routing, activation=activation,
                                            gate_up_layout=gate_up_layout)
  assert y.dtype == dtype and y.shape == p["x"].shape
  errs = {"y": rel_err(y, y_ref)}
  errs.update({f"d{k}": rel_err(grads[k], g_ref[k]) for k in grads})
  for k in grads:
    assert grads[k].dtype == cast[k].dtype, k
  tol = TOL[dtype]
  bad = {k: v for k, v in errs.items() if not v <= tol}
  assert not bad, f"errors over {tol}: {bad} (all: {errs})"
  counts = np.bincount(ids.reshape(-1), minlength=p["w1"].shape[0])
  np.testing.assert_array_equal(np.asarray(aux.expert_counts), counts)
  return errs


def _activation_cases():
  """Each activation once, swiglu with both gate/up layouts and the other GLU activations with
  one each, alternating (the layouts only place the gate and up columns); the dtype, the routing
  and the biases rotate."""
  cases = []
  i = 0
  glu_turn = 0
  for act in ACTS:
    layouts = ["concat"]
    if act == "swiglu":
      layouts = ["concat", "interleaved"]
    elif act in GLU:
      layouts, glu_turn = [("interleaved", "concat")[glu_turn % 2]], glu_turn + 1
    for layout in layouts:
      dtype, routing = (jnp.float32, jnp.bfloat16)[i % 2], ROUTINGS[i % len(ROUTINGS)]
      bias = i // 2 % 2
      cases.append(pytest.param(act, layout, routing, bool(bias), dtype,
                                id=f"{act}-{layout}-{routing}-bias{bias}-{dtype.__name__}"))
      i += 1
  return cases


@pytest.mark.parametrize("activation,gate_up_layout,routing,bias,dtype", _activation_cases())
def test_activations_layouts_against_oracle(rng, activation, gate_up_layout, routing, bias, dtype):
  p, d_y = make_problem(rng, activation=activation, bias=bias)
  check_against_oracle(p, d_y, dtype, top_k=2, activation=activation, routing=routing,
                       gate_up_layout=gate_up_layout)


@pytest.mark.parametrize("routing", ROUTINGS)
def test_routings_against_oracle(rng, routing):
  """K = 3 of 6 experts, with biases (test_activations_layouts_against_oracle also rotates the
  routings, with and without)."""
  p, d_y = make_problem(rng, E=6, K=3, bias=True)
  check_against_oracle(p, d_y, jnp.float32, top_k=3, activation="swiglu", routing=routing,
                       gate_up_layout="interleaved")


@pytest.mark.parametrize("activation", ["swiglu", "relu_sq"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_skewed_routing_and_empty_experts(rng, activation, dtype):
  p, d_y = make_problem(rng, T=40, activation=activation, skew=True, bias=True)
  ids = select_experts(p["x"], p["router_weight"], 2)
  counts = np.bincount(ids.reshape(-1), minlength=8)
  assert counts[0] == 40 and np.all(counts[5:] == 0), counts  # the case we meant to build
  check_against_oracle(p, d_y, dtype, top_k=2, activation=activation, routing="topk_softmax",
                       gate_up_layout="concat")
  # Experts that received no token get exactly zero weight gradients.
  _, _, grads, _ = run_moe(p, d_y, dtype, top_k=2, activation=activation, routing="topk_softmax")
  for k in ("w1", "w2", "b1", "b2"):
    assert np.all(np.asarray(grads[k][5:], np.float32) == 0.0), k


@pytest.mark.parametrize("top_k", [1, 8])
def test_top_k_extremes(rng, top_k):
  # K=1 with renormalised scores has a zero router gradient; the raw form (Switch) has one.
  p, d_y = make_problem(rng, K=top_k)
  check_against_oracle(p, d_y, jnp.float32, top_k=top_k, activation="geglu",
                       routing="topk_softmax_raw", gate_up_layout="concat")


def test_one_expert(rng):
  """E = 1: every token goes to the one expert, against the oracle."""
  p, d_y = make_problem(rng, E=1, K=1)
  check_against_oracle(p, d_y, jnp.float32, top_k=1, activation="swiglu",
                       routing="topk_softmax_raw", gate_up_layout="concat")


def _small_f64_problem(rng, bias):
  p, _ = make_problem(rng, T=12, d=8, n=4, E=4, activation="swiglu", bias=bias)
  return {k: None if v is None else jnp.asarray(v, jnp.float64) for k, v in p.items()}


@pytest.mark.slow
@pytest.mark.parametrize("bias", [False, True])
def test_check_grads_float64(rng, bias):
  """Reverse mode against finite differences; with the biases and a per-expert scale (the
  superset of arguments) second order too, and forward over reverse (jax.hessian) equal to
  reverse over reverse: the custom_vjp's backward is itself differentiable JAX."""
  from jax.test_util import check_grads
  with jax.enable_x64(True):
    a = _small_f64_problem(rng, bias)
    if bias:
      a["expert_scale"] = jnp.asarray(rng.uniform(0.5, 2.0, 4))
    names = [k for k in ARG_NAMES + ("expert_scale",) if a.get(k) is not None]

    def f(*flat):
      kw = dict(zip(names, flat))
      y, aux = sonic_jax.moe(kw["x"], kw["router_weight"], kw["w1"], kw["w2"], b1=kw.get("b1"),
                             b2=kw.get("b2"), expert_scale=kw.get("expert_scale"), top_k=2,
                             routing="topk_softmax", gate_up_layout="interleaved", backend="xla")
      return jnp.sum(jnp.sin(y)) + aux.load_balance_loss + 0.1 * aux.z_loss

    args = [a[k] for k in names]
    check_grads(jax.jit(f), args, order=2 if bias else 1, modes=["rev"], atol=1e-5, rtol=1e-5)
    if bias:
      for i in (names.index("b1"), names.index("expert_scale")):
        forward_over_reverse = jax.jit(jax.hessian(f, argnums=i))(*args)
        reverse_over_reverse = jax.jit(jax.jacrev(jax.jacrev(f, argnums=i), argnums=i))(*args)
        np.testing.assert_allclose(forward_over_reverse, reverse_over_reverse, rtol=1e-9,
                                   atol=1e-12)


def _layer_params(rng, L, T=32, d=16, n=8, E=4):
  p = [make_problem(rng, T=T, d=d, n=n, E=E)[0] for _ in range(L)]
  stack = lambda k: jnp.asarray(np.stack([q[k] for q in p]), jnp.float32)
  return jnp.asarray(p[0]["x"], jnp.float32), stack("router_weight"), stack("w1"), stack("w2")


@pytest.mark.parametrize("token_rounding", [None, "nearest"])
def test_scan_checkpoint_and_jit_agree_with_a_python_loop(rng, token_rounding):
  x, rw, w1, w2 = _layer_params(rng, L=3)
  layer = lambda h, w: h + sonic_jax.moe(h, *w, top_k=2, token_rounding=token_rounding,
                                         backend="xla")[0]

  def loop(x, rw, w1, w2):
    h = x
    for i in range(3):
      h = layer(h, (rw[i], w1[i], w2[i]))
    return jnp.sum(h * h)

  def scanned(x, rw, w1, w2):
    body = jax.checkpoint(lambda h, w: (layer(h, w), None))
    h, _ = jax.lax.scan(body, x, (rw, w1, w2))
    return jnp.sum(h * h)

  want = jax.jit(jax.value_and_grad(loop, argnums=(0, 1, 2, 3)))(x, rw, w1, w2)  # unrolled
  got = jax.jit(jax.value_and_grad(scanned, argnums=(0, 1, 2, 3)))(x, rw, w1, w2)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(got[1], want[1]):
    assert rel_err(g, w) < 1e-5


def test_vmap_over_a_leading_batch(rng):
  p, d_y = make_problem(rng, T=16)
  xs = jnp.asarray(np.stack([p["x"], -p["x"], 2 * p["x"]]), jnp.float32)
  w = [jnp.asarray(p[k], jnp.float32) for k in ("router_weight", "w1", "w2")]
  f = jax.jit(lambda x: sonic_jax.moe(x, *w, top_k=2, backend="xla")[0])  # one compile, not op by op
  batched = jax.vmap(f)(xs)
  for i in range(3):
    assert rel_err(batched[i], f(xs[i])) < 1e-6
  gb = jax.grad(lambda xs: jnp.sum(jax.vmap(f)(xs) ** 2))(xs)
  for i in range(3):
    assert rel_err(gb[i], jax.grad(lambda x: jnp.sum(f(x) ** 2))(xs[i])) < 1e-5


def test_forward_mode_differentiation_raises_clearly(rng):
  """Reverse mode only (README): jvp meets the experts' custom_vjp and jax says so."""
  p, _ = make_problem(rng, T=8)
  w = [jnp.asarray(p[k], jnp.float32) for k in ("router_weight", "w1", "w2")]
  x = jnp.asarray(p["x"], jnp.float32)
  f = lambda x: sonic_jax.moe(x, *w, top_k=2, backend="xla")[0]
  with pytest.raises(TypeError, match="forward-mode autodiff"):
    jax.jvp(f, (x,), (x,))


def _residuals(f, *args):
  from jax._src.ad_checkpoint import saved_residuals
  return [(aval, why) for aval, why in saved_residuals(f, *args) if "from the argument" not in why]


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_backward_saves_only_x_h_scores_and_metadata(rng, activation):
  T, d, n, E, K = 64, 48, 24, 8, 4  # all distinct products, so shapes identify tensors
  p, d_y = make_problem(rng, T=T, d=d, n=n, E=E, K=K, activation=activation)
  a = [jnp.asarray(p[k], jnp.float32) for k in ("x", "router_weight", "w1", "w2")]
  dy = jnp.asarray(d_y, jnp.float32)
  f = lambda *a: jnp.vdot(sonic_jax.moe(*a, top_k=K, activation=activation, backend="xla")[0], dy)
  res = _residuals(f, *a)
  width = 2 * n if activation in GLU else n
  floats = [(tuple(v.shape), why) for v, why in res if jnp.issubdtype(v.dtype, jnp.floating)]
  big = [s for s, _ in floats if np.prod(s) >= T * K * n]
  # Exactly one large float residual: H (rows, width). Not A, not Y, no gathered x.
  assert len(big) == 1 and big[0][1] == width and big[0][0] >= T * K, floats
  assert all(np.prod(s) < T * K * d or s[-1] == width for s, _ in floats), floats
  # Everything else is O(T*K) or O(T*E), or the loss's own copy of dy (T*d).
  for s, why in floats:
    if s != big[0]:
      assert np.prod(s) <= T * max(K, E) or ("test_moe.py" in why and np.prod(s) == T * d), (s, why)


def test_router_backward_runs_on_16bit_operands(rng):
  """bfloat16 x and router weight: the router GEMM's backward takes the logits' gradient in
  bfloat16 (float32 accumulation), not float32 copies of x and the weight; gradients still match
  float64 (float32 inputs keep the float32 backward)."""
  T, d, E = 96, 64, 16
  x = rng.standard_normal((T, d))
  w = rng.standard_normal((d, E)) / np.sqrt(d)
  g = rng.standard_normal((T, E))
  for dtype in (jnp.bfloat16, jnp.float32):
    xs, ws = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    f = lambda x, w: jnp.sum(sonic_jax.router_logits(x, w) * jnp.asarray(g, jnp.float32))
    grad = jax.grad(f, argnums=(0, 1))
    operand_dtypes = gemm_operand_dtypes(jax.make_jaxpr(grad)(xs, ws).jaxpr)
    assert operand_dtypes == {jnp.dtype(dtype)}, operand_dtypes
    dx, dw = grad(xs, ws)
    assert rel_err(dx, g @ w.T) < (2e-2 if dtype == jnp.bfloat16 else 1e-5)
    assert rel_err(dw, x.T @ g) < (2e-2 if dtype == jnp.bfloat16 else 1e-5)


def test_dot_f32_shapes(rng):
  """dot_f32 takes leading dimensions on a (as jnp.dot) and names bad shapes."""
  from sonic_jax.precision import dot_f32
  a = jnp.asarray(rng.standard_normal((2, 5, 3)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((3, 4)), jnp.bfloat16)
  got = dot_f32(a, b)
  assert got.shape == (2, 5, 4) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, np.asarray(a, np.float32) @ np.asarray(b, np.float32),
                             rtol=1e-6, atol=1e-6)
  g = jax.grad(lambda a: jnp.sum(dot_f32(a, b) ** 2))(a)
  assert g.shape == a.shape and g.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"\(\.\.\., k\) and b \(k, n\).*\(4, 3\) and \(4, 2\)"):
    dot_f32(jnp.ones((4, 3), jnp.bfloat16), jnp.ones((4, 2), jnp.bfloat16))


def test_nan_in_x_propagates_to_its_token_only(rng):
  p, _ = make_problem(rng, T=16)
  x = np.array(p["x"])
  x[3, 5] = np.nan
  y, _ = sonic_jax.moe(jnp.asarray(x, jnp.float32), *[jnp.asarray(p[k], jnp.float32)
                       for k in ("router_weight", "w1", "w2")], top_k=2, backend="xla")
  y = np.asarray(y)
  assert np.all(np.isnan(y[3]))
  assert np.all(np.isfinite(np.delete(y, 3, axis=0)))


def test_aux_losses(rng):
  p, _ = make_problem(rng, T=64, E=8)
  a = [jnp.asarray(p[k], jnp.float32) for k in ("x", "router_weight", "w1", "w2")]
  _, aux = sonic_jax.moe(*a, top_k=2, routing="topk_softmax", backend="xla")
  logits = np.asarray(p["x"] @ p["router_weight"])
  np.testing.assert_allclose(aux.router_logits, logits, rtol=1e-4, atol=1e-4)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  counts = np.asarray(aux.expert_counts)
  assert counts.sum() == 64 * 2
  want_lb = 8 * np.sum(counts / counts.sum() * probs.mean(0))
  np.testing.assert_allclose(aux.load_balance_loss, want_lb, rtol=1e-5)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(aux.z_loss, np.mean(lse**2), rtol=1e-5)
  # Uniform probabilities and counts give a balance loss of exactly one.
  from sonic_jax.routing import load_balance_loss
  assert float(load_balance_loss(jnp.full((10, 4), 0.25), jnp.array([5, 5, 5, 5]))) == 1.0


def _valid_args(rng):
  p, _ = make_problem(rng, T=8, d=16, n=8, E=4)
  return {k: jnp.asarray(p[k], jnp.float32) for k in ("x", "router_weight", "w1", "w2")}


BAD = [
    ("x rank", dict(x=jnp.zeros((2, 8, 16))), ValueError, "x must have shape"),
    ("router d", dict(router_weight=jnp.zeros((15, 4))), ValueError, "router_weight"),
    ("x d", dict(x=jnp.zeros((8, 12))), ValueError,
     r"x must have shape \(T, d\) with d = 16 \(router_weight.s and w1.s\)"),
    ("w1 E", dict(w1=jnp.zeros((3, 16, 16))), ValueError, "w1"),
    ("w1 d", dict(w1=jnp.zeros((4, 12, 16))), ValueError, "w1"),
    ("w1 odd for glu", dict(w1=jnp.zeros((4, 16, 15))), ValueError, "w1"),
    ("w2 n", dict(w2=jnp.zeros((4, 16, 16))), ValueError, "w2"),
    ("w2 rank", dict(w2=jnp.zeros((4, 8))), ValueError, "w2"),
    ("w2 d", dict(w2=jnp.zeros((4, 8, 12))), ValueError, "w2"),
    ("int x", dict(x=jnp.zeros((8, 16), jnp.int32)), TypeError, "x must have a floating dtype"),
    ("float8 x", dict(x=jnp.zeros((8, 16), jnp.float8_e4m3fn)), TypeError,
     "float16, bfloat16, float32 or float64"),
    ("router E", dict(router_weight=jnp.zeros((16, 3))), ValueError, "router_weight has E = 3"),
    ("int w1", dict(w1=jnp.zeros((4, 16, 16), jnp.int32)), TypeError, "w1"),
    ("mixed dtypes", dict(w2=jnp.zeros((4, 8, 16), jnp.bfloat16)), TypeError, "w2"),
    ("b1 shape", dict(b1=jnp.zeros((4, 8))), ValueError, "b1"),
    ("b2 shape", dict(b2=jnp.zeros((4, 8))), ValueError, "b2"),
    ("b2 dtype", dict(b2=jnp.zeros((4, 16), jnp.int32)), TypeError, "b2"),
    ("top_k 0", dict(top_k=0), ValueError, "top_k"),
    ("top_k > E", dict(top_k=5), ValueError, "top_k"),
    ("top_k float", dict(top_k=2.0), TypeError, "top_k"),
    ("activation", dict(activation="tanh"), ValueError, "activation"),
    ("routing", dict(routing="expert_choice"), ValueError, "routing"),
    ("layout", dict(gate_up_layout="split"), ValueError, "gate_up_layout"),
    ("backend", dict(backend="cuda"), ValueError, "backend"),
    ("non-glu width", dict(activation="gelu"), ValueError, "GLU"),
    ("selection_bias list", dict(selection_bias=[0.0] * 4), TypeError,
     "selection_bias must be an array"),
    ("selection_bias shape", dict(selection_bias=jnp.zeros((5,))), ValueError, "selection_bias"),
    ("router_input shape", dict(router_input=jnp.zeros((8, 15))), ValueError,
     "router_input must have x's shape"),
    ("expert_scale shape", dict(expert_scale=jnp.ones((5,))), ValueError, "expert_scale"),
    ("expert_scale dtype", dict(expert_scale=jnp.ones((4,), jnp.int32)), TypeError,
     "expert_scale"),
    ("expert_ids shape", dict(expert_ids=jnp.zeros((8, 3), jnp.int32)), ValueError,
     r"expert_ids must have shape \(T, top_k\)"),
    ("expert_ids dtype", dict(expert_ids=jnp.zeros((8, 2))), TypeError, "expert_ids"),
    ("expert_ids rounded", dict(expert_ids=jnp.zeros((8, 2), jnp.int32), token_rounding="up"),
     ValueError, "exclude each other"),
    ("expert_ids biased", dict(expert_ids=jnp.zeros((8, 2), jnp.int32),
                               selection_bias=jnp.zeros((4,))), ValueError, "no selection_bias"),
    ("expert_ids grouped", dict(expert_ids=jnp.zeros((8, 2), jnp.int32),
                                routing=sonic_jax.Router(n_group=2)), ValueError,
     "no group-limited"),
]


@pytest.mark.parametrize("name,change,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_naming_the_argument(rng, name, change, exc, match):
  kw = dict(_valid_args(rng), top_k=2)
  kw.update(change)
  with pytest.raises(exc, match=match):
    sonic_jax.moe(kw.pop("x"), kw.pop("router_weight"), kw.pop("w1"), kw.pop("w2"), **kw)


def test_symbolic_shapes_are_refused_by_name():
  """jax.export with a symbolic token count: a clear error, not a failure deep in the layout."""
  t, = jax.export.symbolic_shape("t")
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  fn = jax.jit(lambda x, r, w1, w2: sonic_jax.moe(x, r, w1, w2, top_k=2, backend="xla")[0])
  with pytest.raises(ValueError, match=r"x has shape \(t, 16\): sonic_jax needs static shapes"):
    jax.export.export(fn)(f32(t, 16), f32(16, 4), f32(4, 16, 16), f32(4, 8, 16))


def test_numpy_float64_inputs_compute_as_jax_does(rng):
  """NumPy float64 arrays are float32 to JAX without jax_enable_x64: the eager call accepts them
  beside float32 weights, as a jitted one does, and the layer too."""
  kw = _valid_args(rng)
  x = np.asarray(kw.pop("x"), np.float64)
  rw = np.asarray(kw.pop("router_weight"), np.float64)
  call = lambda x, rw: sonic_jax.moe(x, rw, kw["w1"], kw["w2"], top_k=2, backend="xla")[0]
  y = call(x, rw)
  assert y.dtype == jnp.float32
  np.testing.assert_allclose(y, jax.jit(call)(x, rw), rtol=1e-6, atol=1e-6, equal_nan=False)
  layer = sonic_jax.layers.MoE(16, 4, 8, 2, backend="xla", rngs=nnx.Rngs(0))
  assert layer(x)[0].dtype == jnp.float32


@pytest.mark.parametrize("T,d", [(0, 16), (16, 0), (0, 0)])
def test_no_tokens_or_no_features(rng, T, d):
  """T = 0 or d = 0: an empty output of x's shape, zero gradients of the right shapes, finite
  losses, under jit."""
  E, n = 4, 8
  x, rw = jnp.ones((T, d)), jnp.ones((d, E))
  w1, w2 = jnp.ones((E, d, 2 * n)), jnp.ones((E, n, d))

  def loss(x, rw, w1, w2):
    y, aux = sonic_jax.moe(x, rw, w1, w2, top_k=2, backend="xla")
    return jnp.sum(y) + aux.load_balance_loss + aux.z_loss, (y, aux)

  (total, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3),
                                                        has_aux=True))(x, rw, w1, w2)
  assert y.shape == (T, d) and np.isfinite(float(total))
  assert int(jnp.sum(aux.expert_counts)) == 2 * T
  for g, a in zip(grads, (x, rw, w1, w2)):  # no token or no feature reaches a weight
    assert g.shape == a.shape and not np.any(np.asarray(g))


def test_sigmoid_routing_selects_by_logit_where_gates_saturate(rng):
  """Logits of thousands: float32 sigmoid gates are all exactly 1.0, so a selection on the gates
  would fall to the lowest expert ids; the routing picks the largest logits."""
  p, _ = make_problem(rng, T=32, d=16, n=8, E=8)
  x = jnp.asarray(p["x"] * 1e3, jnp.float32)
  rw = jnp.asarray(p["router_weight"], jnp.float32)
  _, aux = sonic_jax.moe(x, rw, jnp.asarray(p["w1"], jnp.float32),
                         jnp.asarray(p["w2"], jnp.float32), top_k=2, routing="sigmoid_topk",
                         backend="xla")
  gates = np.asarray(jax.nn.sigmoid(aux.router_logits))
  assert np.sum(gates == 1.0, axis=1).max() > 2  # saturated ties among more than K experts
  want = select_experts(np.asarray(x, np.float64), np.asarray(rw, np.float64), 2)
  np.testing.assert_array_equal(np.sort(np.asarray(aux.expert_ids), 1), np.sort(want, 1))


@pytest.mark.parametrize("routing", ROUTINGS)
def test_selection_bias_moves_selection_not_scores(rng, routing):
  p, _ = make_problem(rng, T=32, E=6, K=2)
  a = [jnp.asarray(p[k], jnp.float32) for k in ("x", "router_weight", "w1", "w2")]
  bias = jnp.zeros((6,)).at[3].set(100.0)  # expert 3 is always selected
  _, aux = sonic_jax.moe(*a, top_k=2, routing=routing, selection_bias=bias, backend="xla")
  ids = np.asarray(aux.expert_ids)
  assert np.all((ids == 3).any(-1))
  # The scores are the unbiased router's weights of the experts it selected.
  unbiased = sonic_jax.route(aux.router_logits, 2, routing, expert_ids=aux.expert_ids)
  np.testing.assert_allclose(aux.scores, unbiased.scores, rtol=1e-5)
  # No gradient reaches the bias.
  g = jax.grad(lambda b: jnp.sum(sonic_jax.moe(*a, top_k=2, routing=routing, selection_bias=b,
                                               backend="xla")[0]))(bias)
  assert np.all(np.asarray(g) == 0)
  with pytest.raises(ValueError, match="selection_bias"):
    sonic_jax.moe(*a, top_k=2, selection_bias=jnp.zeros((5,)))


@pytest.mark.parametrize("token_rounding", [None, "up"])
def test_router_input_and_expert_scale(rng, token_rounding):
  """Gemma 4's router options: routing from router_input in x's place, each pair's weight (and
  each rounding-added pair's) times its expert's scale; the same as `routed_experts` on that
  routing, in value and in the scale's and router input's gradients (float64)."""
  with jax.enable_x64(True):
    _check_router_input_and_expert_scale(rng, token_rounding)


def _check_router_input_and_expert_scale(rng, token_rounding):
  p, _ = make_problem(rng, T=32, d=16, n=8, E=8)
  x, rw, w1, w2 = (jnp.asarray(p[k], jnp.float64) for k in ("x", "router_weight", "w1", "w2"))
  r = jnp.asarray(rng.standard_normal(x.shape))
  scale = jnp.asarray(rng.uniform(0.5, 2.0, 8))
  kw = dict(top_k=2, routing="topk_softmax", backend="xla", token_rounding=token_rounding)

  def layer(r, scale):
    return sonic_jax.moe(x, rw, w1, w2, router_input=r, expert_scale=scale, **kw)

  def on_its_routing(r, scale):
    tile = sonic_jax.backends.resolve_backend("xla").row_tile
    routed, _ = sonic_jax.routing.route_tokens(r @ rw, 2, "topk_softmax", None, token_rounding,
                                               tile)
    extra = routed.extra_scores * scale[jnp.clip(routed.extra_experts, 0, 7)]
    return sonic_jax.routed_experts(
        x, routed.expert_ids, routed.scores * scale[routed.expert_ids], w1, w2, backend="xla",
        extra_tokens=routed.extra_tokens, extra_experts=routed.extra_experts,
        extra_scores=extra)[0]

  y, aux = jax.jit(layer)(r, scale)
  np.testing.assert_array_equal(np.asarray(aux.expert_ids)[:, 0],
                                np.argmax(np.asarray(r @ rw), -1))
  if token_rounding:
    assert int(jnp.sum(aux.extra_experts < 8)) > 0
  assert rel_err(y, jax.jit(on_its_routing)(r, scale)) < 1e-12
  d_y = jnp.asarray(rng.standard_normal(y.shape))
  grads = jax.jit(jax.grad(lambda *a: jnp.vdot(layer(*a)[0], d_y), argnums=(0, 1)))(r, scale)
  want = jax.jit(jax.grad(lambda *a: jnp.vdot(on_its_routing(*a), d_y), argnums=(0, 1)))(
      r, scale)
  for g, w in zip(grads, want):
    assert float(jnp.linalg.norm(w)) > 0 and rel_err(g, w) < 1e-12
