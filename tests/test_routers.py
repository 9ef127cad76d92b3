"""The families' routers (`sonic_jax.Router`), capacity dropping and the bring-your-own-routing op
(`sonic_jax.routed_experts`) against the float64 oracle written from the math (tests/oracle.py).

Everything here runs in float64 on the xla backend: a routing rule that is wrong shows as an error
of 1e-2 or more, rounding as 1e-15. The Hopper kernels run the same routings (the routing is plain
JAX ahead of them); `test_mosaic_gpu.py` and `test_families.py` check them in bf16 on the GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sonic_jax
from cases import make_problem
from oracle import moe_reference_weights, rel_err, route_reference

Router = sonic_jax.Router
TOL = 1e-10

# (name, Router, the oracle's description of it, top_k, router bias, selection bias, activation)
CASES = [
    ("deepseek_v3", Router("sigmoid", renorm_epsilon=1e-20, n_group=4, topk_group=2,
                           group_score="top2_sum", routed_scaling_factor=2.5),
     dict(scoring="sigmoid", renorm_epsilon=1e-20, n_group=4, topk_group=2,
          group_score="top2_sum", scaling=2.5), 2, False, True, "swiglu"),
    ("deepseek_v2", Router("softmax", renormalize=False, n_group=4, topk_group=2,
                           routed_scaling_factor=16.0),
     dict(renormalize=False, n_group=4, topk_group=2, scaling=16.0), 3, False, False, "swiglu"),
    ("dots_llm1", Router("sigmoid", renormalize=False), dict(scoring="sigmoid", renormalize=False),
     2, False, True, "swiglu"),
    ("dbrx_p2", Router("softmax", renorm_p=2.0), dict(renorm_p=2.0), 2, False, False, "swiglu"),
    ("ernie", Router("softmax", renorm_epsilon=1e-12), dict(renorm_epsilon=1e-12), 2, False, True,
     "swiglu"),
    ("gpt_oss", Router("softmax"), dict(), 2, True, False, "clamped_swiglu"),
    ("llama4", Router("sigmoid", renormalize=False, scale_input=True),
     dict(scoring="sigmoid", renormalize=False), 1, False, False, "swiglu"),
    ("scale_input_k2", Router("softmax", scale_input=True), dict(), 2, True, False, "geglu_tanh"),
    ("logit_bias", Router("softmax", selection_bias_on="logits"), dict(bias_on="logits"), 2, False,
     True, "swiglu"),
    ("deepseek_v4", Router("sqrt_softplus", renorm_epsilon=1e-20, routed_scaling_factor=1.5),
     dict(scoring="sqrt_softplus", renorm_epsilon=1e-20, scaling=1.5), 2, False, True, "swiglu"),
]


def _f64(a):
  return None if a is None else jnp.asarray(np.asarray(a, np.float64))


@pytest.mark.parametrize("name,router,spec,top_k,router_bias,selection_bias,activation", CASES,
                         ids=[c[0] for c in CASES])
def test_family_routers_against_oracle(rng, name, router, spec, top_k, router_bias,
                                       selection_bias, activation):
  """Output and the gradients of x, the router weight and bias, w1, w2, b1, b2."""
  p, d_y = make_problem(rng, T=40, d=16, n=8, E=8, activation=activation, bias=True)
  if activation == "clamped_swiglu":
    p["w1"] = p["w1"] * 6.0  # pre-activations past gpt-oss's limit of 7: the clamps act
  p["router_bias"] = rng.standard_normal(8) * 0.5 if router_bias else None
  sel = rng.standard_normal(8) * 0.05 if selection_bias else None
  names = [k for k in ("x", "router_weight", "w1", "w2", "b1", "b2", "router_bias")
           if p[k] is not None]
  with jax.enable_x64(True):
    a = {k: _f64(v) for k, v in p.items()}
    s_bias = _f64(sel)

    def loss(*flat):
      v = dict(a, **dict(zip(names, flat)))
      y, aux = sonic_jax.moe(v["x"], v["router_weight"], v["w1"], v["w2"], b1=v["b1"],
                             b2=v["b2"], router_bias=v["router_bias"], selection_bias=s_bias,
                             top_k=top_k, routing=router, activation=activation, backend="xla")
      return jnp.vdot(y, _f64(d_y)), (y, aux)

    (_, (y, aux)), grads = jax.jit(jax.value_and_grad(
        loss, argnums=tuple(range(len(names))), has_aux=True))(*[a[k] for k in names])
    logits = np.asarray(p["x"]) @ p["router_weight"] + (
        0.0 if p["router_bias"] is None else p["router_bias"])
    ids, weights = route_reference(logits, top_k, selection_bias=sel, **spec)
    np.testing.assert_array_equal(np.sort(np.asarray(aux.expert_ids), -1), np.sort(ids, -1))

    def ref_loss(*flat):
      v = dict(a, **dict(zip(names, flat)))
      y = moe_reference_weights(v["x"], v["router_weight"], v["w1"], v["w2"], v["b1"], v["b2"],
                                v["router_bias"], ids, weights, activation=activation,
                                gate_up_layout="concat", scale_input=router.scale_input)
      return jnp.vdot(y, _f64(d_y)), y

    (_, y_ref), g_ref = jax.value_and_grad(ref_loss, argnums=tuple(range(len(names))),
                                           has_aux=True)(*[a[k] for k in names])
  errs = {"y": rel_err(y, y_ref), **{f"d{k}": rel_err(g, r) for k, g, r in
                                     zip(names, grads, g_ref)}}
  assert all(e < TOL for e in errs.values()), errs
  if router_bias:
    assert float(jnp.linalg.norm(grads[names.index("router_bias")])) > 0


def test_group_limited_selection_stays_in_the_kept_groups(rng):
  """With n_group = 4 and topk_group = 1 every token's K experts share one group, the group with
  the best score (DeepSeek-V3: the sum of its top two)."""
  x = jnp.asarray(rng.standard_normal((64, 16)))
  w = jnp.asarray(rng.standard_normal((16, 16)))
  router = Router("sigmoid", n_group=4, topk_group=1, group_score="top2_sum")
  out = sonic_jax.route(x @ w, 3, router)
  groups = np.asarray(out.expert_ids) // 4
  assert np.all(groups == groups[:, :1])
  s = np.asarray(jax.nn.sigmoid(x @ w)).reshape(64, 4, 4)
  best = np.argmax(np.sort(s, -1)[..., -2:].sum(-1), -1)
  np.testing.assert_array_equal(groups[:, 0], best)


def test_capacity_keeps_each_experts_first_pairs_in_token_order(rng):
  """capacity_factor c: expert e keeps its first ceil(c T K / E) pairs (token-major, slots in
  order), the rest get no output, are counted and marked -1; gradients match the oracle with the
  dropped pairs' weights zeroed."""
  p, d_y = make_problem(rng, T=48, d=16, n=8, E=4, K=2, skew=True)
  with jax.enable_x64(True):
    a = {k: _f64(v) for k, v in p.items()}
    f = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=2, routing="topk_softmax",
                                            capacity_factor=1.0, backend="xla")

    @jax.jit  # one program: eagerly, each op of the op and its VJP compiles its own
    def run(*args):
      (y, aux), vjp = jax.vjp(f, *args)
      return y, aux, vjp((_f64(d_y), jax.tree.map(jnp.zeros_like, aux)))

    y, aux, grads = run(a["x"], a["router_weight"], a["w1"], a["w2"])
    ids, weights = route_reference(np.asarray(p["x"]) @ p["router_weight"], 2)
    cap = int(np.ceil(1.0 * 48 * 2 / 4))
    kept, seen = ids.copy(), np.zeros(4, int)
    for t in range(48):
      for k in range(2):
        seen[ids[t, k]] += 1
        if seen[ids[t, k]] > cap:
          kept[t, k] = -1
    np.testing.assert_array_equal(np.asarray(aux.expert_ids), kept)
    assert int(aux.dropped_pairs) == int(np.sum(kept < 0)) > 0
    # expert_counts: the routed load (what a selection-bias update balances), before the drop
    np.testing.assert_array_equal(np.asarray(aux.expert_counts),
                                  np.bincount(ids.reshape(-1), minlength=4))
    np.testing.assert_array_equal(np.asarray(aux.choice_ids), ids)
    assert np.all(np.asarray(aux.scores)[kept < 0] == 0)
    masked = lambda l: jnp.where(jnp.asarray(kept) >= 0, weights(l), 0.0)
    ref = lambda x, rw, w1, w2: moe_reference_weights(x, rw, w1, w2, None, None, None, ids,
                                                      masked, activation="swiglu",
                                                      gate_up_layout="concat")
    y_ref, g_ref = jax.jit(lambda *args: value_and_vjp(ref, args, _f64(d_y)))(
        a["x"], a["router_weight"], a["w1"], a["w2"])
  assert rel_err(y, y_ref) < TOL
  for g, r in zip(grads, g_ref):
    assert rel_err(g, r) < TOL


def value_and_vjp(f, args, ct):
  y, vjp = jax.vjp(f, *args)
  return y, vjp(ct)


def _dense_reference(x, w1, w2, weights):
  """y = sum_e weights[:, e] * expert_e(x) for a dense (T, E) weight matrix."""
  y = jnp.zeros_like(x)
  for e in range(w1.shape[0]):
    h = x @ w1[e]
    n = h.shape[-1] // 2
    y = y + weights[:, e][:, None] * ((jax.nn.silu(h[:, :n]) * h[:, n:]) @ w2[e])
  return y


def test_routed_experts_takes_expert_choice_pairs_and_differentiates_scores(rng):
  """Expert choice written by the user (each expert picks its C best tokens), given as pair lists
  with no slots: output and gradients of x, the router weight (through the scores), w1, w2."""
  T, d, n, E, C = 32, 16, 8, 4, 10
  p, d_y = make_problem(rng, T=T, d=d, n=n, E=E)
  with jax.enable_x64(True):
    a = {k: _f64(v) for k, v in p.items()}

    def expert_choice(x, rw, w1, w2):
      probs = jax.nn.softmax(x @ rw, axis=-1)
      scores, tokens = jax.lax.top_k(probs.T, C)  # (E, C)
      y, aux = sonic_jax.routed_experts(
          x, jnp.zeros((T, 0), jnp.int32), jnp.zeros((T, 0)), w1, w2,
          extra_tokens=tokens.reshape(-1), extra_experts=jnp.repeat(jnp.arange(E), C),
          extra_scores=scores.reshape(-1), backend="xla")
      return y, aux

    @jax.jit  # one program: eagerly, each op of the op and its VJP compiles its own
    def run(*args):
      (y, aux), vjp = jax.vjp(expert_choice, *args)
      probs = jax.nn.softmax(args[0] @ args[1], axis=-1)
      return y, aux, vjp((_f64(d_y), jax.tree.map(jnp.zeros_like, aux))), probs

    y, aux, grads, probs = run(a["x"], a["router_weight"], a["w1"], a["w2"])
    probs = np.asarray(probs)
    chosen = np.zeros((T, E), bool)
    for e in range(E):
      chosen[np.argsort(-probs[:, e], kind="stable")[:C], e] = True

    def ref(x, rw, w1, w2):
      return _dense_reference(x, w1, w2, jnp.where(chosen, jax.nn.softmax(x @ rw, -1), 0.0))

    y_ref, g_ref = jax.jit(lambda *args: value_and_vjp(ref, args, _f64(d_y)))(
        a["x"], a["router_weight"], a["w1"], a["w2"])
  np.testing.assert_array_equal(np.asarray(aux.expert_counts), [C] * E)
  np.testing.assert_array_equal(np.asarray(aux.extra_experts), np.repeat(np.arange(E), C))
  assert rel_err(y, y_ref) < TOL
  for g, r in zip(grads, g_ref):
    assert rel_err(g, r) < TOL


def test_routed_experts_slots_with_empty_and_repeated_experts(rng):
  """Slots may be empty (-1) or name one expert twice (both count); the same op under jit and
  vmap; `moe` equals a router followed by `routed_experts`."""
  T, d, n, E = 24, 16, 8, 4
  p, d_y = make_problem(rng, T=T, d=d, n=n, E=E)
  with jax.enable_x64(True):
    a = {k: _f64(v) for k, v in p.items()}
    ids = rng.integers(-1, E, (T, 3)).astype(np.int32)
    ids[:, 2] = rng.integers(0, E, T)
    ids[:4, 1] = ids[:4, 2]  # repeated experts
    ids = jnp.asarray(ids)
    scores = jnp.asarray(rng.uniform(0.1, 1.0, (T, 3)))
    op = lambda x, s: sonic_jax.routed_experts(x, ids, s, a["w1"], a["w2"], backend="xla")
    ref = lambda s: _dense_reference(a["x"], a["w1"], a["w2"], jnp.zeros((T, E)).at[
        jnp.arange(T)[:, None], jnp.maximum(ids, 0)].add(jnp.where(ids >= 0, s, 0.0)))

    @jax.jit  # one program: eagerly, each op would compile its own
    def run(scores):
      y, aux = op(a["x"], scores)
      g, g_ref = (jax.grad(lambda s: jnp.vdot(f(s), _f64(d_y)))(scores)
                  for f in (lambda s: op(a["x"], s)[0], ref))
      batched = jax.vmap(lambda x: op(x, scores)[0])(jnp.stack([a["x"], 2 * a["x"]]))
      # token choice = a router + routed_experts
      y_moe, aux_moe = sonic_jax.moe(a["x"], a["router_weight"], a["w1"], a["w2"], top_k=2,
                                     backend="xla")
      y_own, _ = sonic_jax.routed_experts(a["x"], aux_moe.expert_ids, aux_moe.scores, a["w1"],
                                          a["w2"], backend="xla")
      return y, aux.expert_counts, ref(scores), g, g_ref, batched, op(2 * a["x"], scores)[0], \
          y_moe, y_own

    y, counts, y_ref, g, g_ref, batched, y_twice, y_moe, y_own = run(scores)
    assert rel_err(y, y_ref) < TOL
    assert int(counts.sum()) == int(np.sum(np.asarray(ids) >= 0))
    assert rel_err(g, g_ref) < TOL
    assert rel_err(batched[0], y) < TOL and rel_err(batched[1], y_twice) < TOL
    assert rel_err(y_own, y_moe) < TOL


def test_balance_losses_follow_their_formulas(rng):
  """sequence_balance_loss: DeepSeek's per-sequence E/(K S) count * mean probability, averaged;
  hf_load_balancing_loss: transformers' all-layers form (counts and probabilities summed over
  layers before they multiply; test_families.py checks it against transformers itself)."""
  B, S, E, K = 3, 10, 6, 2
  logits = rng.standard_normal((B, S, E)).astype(np.float32)
  layers = [jnp.asarray(rng.standard_normal((12, E))) for _ in range(3)]
  mask = jnp.ones((3, 4)).at[:, -1].set(0)  # B * S = 12 tokens per layer

  @jax.jit  # one program: eagerly, each op compiles its own
  def run(logits, layers, mask):
    probs = jax.nn.softmax(logits, -1)
    ids = jax.lax.top_k(probs, K)[1]
    return (probs, ids, sonic_jax.sequence_balance_loss(probs, ids),
            sonic_jax.hf_load_balancing_loss(layers, K),
            sonic_jax.hf_load_balancing_loss(layers, K, mask))

  probs, ids, seq_loss, hf_loss, hf_masked_loss = run(logits, layers, mask)
  want = np.mean([np.sum(np.bincount(np.asarray(ids[b]).reshape(-1), minlength=E) * E / (K * S)
                         * np.asarray(probs[b]).mean(0)) for b in range(B)])
  np.testing.assert_allclose(seq_loss, want, rtol=1e-6)
  cat = np.concatenate([np.asarray(l) for l in layers])
  pr = np.exp(cat) / np.exp(cat).sum(-1, keepdims=True)
  top = np.argsort(-pr, -1)[:, :K]
  per_slot = np.stack([np.bincount(top[:, k], minlength=E) / len(cat) for k in range(K)])
  want = E * np.sum(per_slot * pr.mean(0)[None])
  np.testing.assert_allclose(hf_loss, want, rtol=1e-6)
  m = np.tile(np.asarray(mask).reshape(-1), 3)
  per_slot = np.stack([(np.eye(E)[top[:, k]] * m[:, None]).sum(0) / m.sum() for k in range(K)])
  want = E * np.sum(per_slot * ((pr * m[:, None]).sum(0) / m.sum())[None])
  np.testing.assert_allclose(hf_masked_loss, want, rtol=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(scoring="tanh"), "scoring"),
    (dict(n_group=0), "n_group"),
    (dict(n_group=2, topk_group=3), "topk_group"),
    (dict(group_score="mean"), "group_score"),
    (dict(selection_bias_on="probs"), "selection_bias_on"),
    (dict(renorm_p=0.0), "renorm_p"),
    (dict(renorm_epsilon=float("inf")), "Router.renorm_epsilon must be finite"),
    (dict(routed_scaling_factor=-1.0), "Router.routed_scaling_factor must be > 0"),
])
def test_bad_router_fields_are_refused_by_name(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Router(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(renormalize="no"), "Router.renormalize must be a bool"),
    (dict(scale_input=1), "Router.scale_input must be a bool"),
    (dict(n_group=2.0), "Router.n_group must be an int"),
    (dict(routed_scaling_factor="2"), "Router.routed_scaling_factor must be a real number"),
])
def test_router_field_types_are_refused_by_name(kwargs, match):
  with pytest.raises(TypeError, match=match):
    Router(**kwargs)


def test_wide_out_of_range_ids_are_empty_slots_and_capacity_caps_at_the_pairs(rng):
  """An int64 id outside [0, E) is an empty slot, not wrapped onto an expert by the narrowing to
  int32 (host and JAX arrays alike); a capacity factor far above E keeps every pair rather than
  overflowing the capacity."""
  p, _ = make_problem(rng, T=8, d=16, n=8, E=4)
  x, rw, w1, w2 = (jnp.asarray(p[k], jnp.float32) for k in ("x", "router_weight", "w1", "w2"))
  wide = np.full((8, 2), 2**32 + 1, np.int64)

  # One program (eagerly each op compiles its own); the host arrays are constants of the trace,
  # so the op still sees NumPy int64 arrays.
  @jax.jit
  def run(x, rw, w1, w2):
    y, aux = sonic_jax.routed_experts(x, wide, np.ones((8, 2), np.float32), w1, w2, backend="xla")
    extra = sonic_jax.routed_experts(
        x, np.zeros((8, 0), np.int64), np.zeros((8, 0), np.float32), w1, w2,
        extra_tokens=np.array([1, 2**32 + 1]), extra_experts=np.array([2**32 + 2, 3]),
        extra_scores=np.ones(2, np.float32), backend="xla")[1].expert_counts
    fixed = sonic_jax.moe(x, rw, w1, w2, top_k=2, expert_ids=wide, backend="xla")[1].expert_ids
    want = sonic_jax.moe(x, rw, w1, w2, top_k=2, backend="xla")[0]
    capped = [sonic_jax.moe(x, rw, w1, w2, top_k=2, capacity_factor=factor, backend="xla")
              for factor in (1e9, 1e300)]
    return y, aux.expert_counts, extra, fixed, want, capped

  y, counts, extra_counts, fixed_ids, want, capped = run(x, rw, w1, w2)
  assert not np.any(np.asarray(y)) and not np.any(np.asarray(counts))
  assert not np.any(np.asarray(extra_counts))
  assert np.all(np.asarray(fixed_ids) == -1)
  for y, aux in capped:
    assert int(aux.dropped_pairs) == 0
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-7)


def test_routed_experts_without_pairs_and_route_checks_its_router(rng):
  """No pair at all (S = 0, no extra pairs) gives zeros and zero gradients; `route` refuses a
  Router that cannot pick K experts from the kept groups."""
  x, w1, w2 = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((6, 16), (4, 16, 16), (4, 8, 16)))
  f = lambda x: sonic_jax.routed_experts(x, jnp.zeros((6, 0), jnp.int32), jnp.zeros((6, 0)), w1,
                                         w2, backend="xla")[0]
  assert not np.any(np.asarray(jax.jit(f)(x)))
  assert not np.any(np.asarray(jax.jit(jax.grad(lambda x: jnp.sum(f(x))))(x)))
  # an extra pair whose token is out of range is unused: no output, not counted
  y, aux = jax.jit(lambda x: sonic_jax.routed_experts(
      x, jnp.zeros((6, 0), jnp.int32), jnp.zeros((6, 0)), w1, w2, extra_tokens=jnp.array([1, 6]),
      extra_experts=jnp.array([2, 3]), extra_scores=jnp.ones(2), capacity_factor=1.0,
      backend="xla"))(x)
  np.testing.assert_array_equal(np.asarray(aux.expert_counts), [0, 0, 1, 0])
  np.testing.assert_array_equal(np.asarray(aux.extra_experts), [2, 4])
  with pytest.raises(ValueError, match="exceeds the experts"):
    sonic_jax.route(jnp.zeros((3, 8)), 3, Router(n_group=4, topk_group=1))
  with pytest.raises(TypeError, match="scale_input must be a bool, got int"):
    sonic_jax.routed_experts(x, jnp.zeros((6, 1), jnp.int32), jnp.ones((6, 1)), w1, w2,
                             scale_input=0)
  with pytest.raises(ValueError, match="w1 must hold at least one expert"):
    sonic_jax.routed_experts(x, jnp.zeros((6, 1), jnp.int32), jnp.ones((6, 1)), w1[:0], w2[:0])


def test_the_xla_backend_masks_padding_rows(rng):
  """The xla backend masks padding rows in its gradients, whatever token they read: on a layout
  whose padding rows all read token 0 (`build_grouped_layout` gives them a token of their own
  expert), a NaN in token 0's row of x, or of the output's cotangent, reaches only the weight
  gradients of the experts token 0 is routed to (the Mosaic GPU kernels' padding:
  `test_weight_grad_padding_reads_its_experts_token`)."""
  x, w1, w2 = (jnp.asarray(rng.standard_normal(s), jnp.float32)
               for s in ((16, 16), (4, 16, 16), (4, 8, 16)))
  ids = jnp.array([[0, 1]] + [[2, 3]] * 15)  # token 0 alone on experts 0 and 1
  layout = sonic_jax.build_grouped_layout(ids, 4, 32)
  layout = layout._replace(row_token=jnp.where(layout.row_valid(), layout.row_token, 0))
  f = lambda x, w1, w2: sonic_jax.expert_mixture(x, jnp.ones((16, 2)), layout, w1, w2,
                                                 b2=jnp.zeros((4, 16)), backend="xla")

  @jax.jit
  def grads(x, w1, w2):
    nan_x = jax.grad(lambda w1, w2: jnp.sum(f(x.at[0, 0].set(jnp.nan), w1, w2)[1:]), (0, 1))
    y, vjp = jax.vjp(f, x, w1, w2)
    return nan_x(w1, w2) + vjp(jnp.zeros_like(y).at[0].set(jnp.nan))[1:]

  for g in grads(x, w1, w2):
    assert [bool(np.isnan(np.asarray(g[e])).any()) for e in range(4)] == [True, True, False,
                                                                          False], g


def test_bad_routing_arguments_are_refused_by_name(rng):
  p, _ = make_problem(rng, T=8, d=16, n=8, E=8)
  a = [jnp.asarray(p[k], jnp.float32) for k in ("x", "router_weight", "w1", "w2")]
  with pytest.raises(ValueError, match="n_group = 3 must divide"):
    sonic_jax.moe(*a, top_k=2, routing=Router(n_group=3), backend="xla")
  with pytest.raises(ValueError, match="exceeds the experts"):
    sonic_jax.moe(*a, top_k=3, routing=Router(n_group=4, topk_group=1), backend="xla")
  with pytest.raises(ValueError, match="router_bias must have shape"):
    sonic_jax.moe(*a, top_k=2, router_bias=jnp.zeros(7), backend="xla")
  logits = a[0] @ a[1]
  with pytest.raises(ValueError, match=r"expert_scale must have shape \(E,\)"):
    sonic_jax.routing.route_tokens(logits, 2, "topk_softmax", None, None, 32,
                                   expert_scale=jnp.ones(7))
  with pytest.raises(ValueError, match=r"selection_bias must have shape \(E,\)"):
    sonic_jax.routing.route_tokens(logits, 2, "topk_softmax", jnp.zeros(7), None, 32)
  with pytest.raises(TypeError, match="tile must be an int"):
    sonic_jax.routing.round_tokens(sonic_jax.route(logits, 2, "softmax_topk"), 2.5, "up")
  with pytest.raises(TypeError, match="routed must be the RouterOutput"):
    sonic_jax.routing.round_tokens(tuple(sonic_jax.route(logits, 2, "softmax_topk")), 32, "up")
  with pytest.raises(TypeError, match="logits must be an array"):
    sonic_jax.route(np.asarray(logits).tolist(), 2, "softmax_topk")
  with pytest.raises(TypeError, match="expert_ids must have an integer dtype"):
    sonic_jax.route(logits, 2, "softmax_topk", expert_ids=jnp.zeros((8, 2)))
  with pytest.raises(ValueError, match="capacity_factor must be finite and > 0"):
    sonic_jax.moe(*a, top_k=2, capacity_factor=0.0, backend="xla")
  with pytest.raises(ValueError, match="capacity_factor must be finite and > 0"):
    sonic_jax.moe(*a, top_k=2, capacity_factor=float("inf"), backend="xla")
  with pytest.raises(ValueError, match=r"top_k must be in \[1, E=8\]"):
    sonic_jax.route(a[0] @ a[1], 0, "softmax_topk")
  with pytest.raises(ValueError, match="exclude each other"):
    sonic_jax.moe(*a, top_k=2, capacity_factor=1.0, token_rounding="up", backend="xla")
  with pytest.raises(ValueError, match="softmax router"):
    sonic_jax.moe(*a, top_k=2, routing="sigmoid_topk", token_rounding="up", backend="xla")
  ids, s = jnp.zeros((8, 2), jnp.int32), jnp.ones((8, 2))
  with pytest.raises(TypeError, match="expert_ids must have an integer dtype"):
    sonic_jax.routed_experts(a[0], s, s, a[2], a[3], backend="xla")
  with pytest.raises(ValueError, match="expert_ids and scores"):
    sonic_jax.routed_experts(a[0], ids, s[:, :1], a[2], a[3], backend="xla")
  with pytest.raises(ValueError, match="given together"):
    sonic_jax.routed_experts(a[0], ids, s, a[2], a[3], extra_tokens=jnp.zeros(3, jnp.int32),
                             backend="xla")
  with pytest.raises(ValueError, match="w2 must have shape"):
    sonic_jax.routed_experts(a[0], ids, s, a[2], a[3][:, :4], backend="xla")


def test_fixed_selection_weighted_by_the_router(rng):
  """expert_ids (DeepSeek-V4's hash layers: a frozen table of each token id's experts): those
  experts, weighted as the router weights them, whatever it would select; an id outside [0, E)
  an empty slot (the token's other weights renormalised without it), in `moe` and in `route`;
  output and x's and the router's gradients against the oracle (float64). sqrt(softplus) scores keep
  a finite gradient where softplus underflows."""
  p, d_y = make_problem(rng, T=40, d=16, n=8, E=8)
  ids = np.stack([rng.permutation(8)[:2] for _ in range(40)]).astype(np.int32)
  ids[3, 1], ids[5, 0], ids[7] = -1, 8, [-1, 9]  # empty slots; token 7 has no expert
  valid = (ids >= 0) & (ids < 8)
  router = Router("sqrt_softplus", renorm_epsilon=1e-20, routed_scaling_factor=1.5)

  def weights(logits):  # the oracle's: DeepSeek-V4's router over the slots that name an expert
    s = jnp.where(valid, jnp.take_along_axis(jnp.sqrt(jnp.logaddexp(logits, 0.0)),
                                             jnp.asarray(np.maximum(ids, 0)), -1), 0.0)
    return 1.5 * s / (jnp.sum(s, -1, keepdims=True) + 1e-20)

  with jax.enable_x64(True):
    a = {k: _f64(p[k]) for k in ("x", "router_weight", "w1", "w2")}

    def loss(x, rw):
      y, aux = sonic_jax.moe(x, rw, a["w1"], a["w2"], top_k=2, routing=router,
                             expert_ids=jnp.asarray(ids), backend="xla")
      return jnp.vdot(y, _f64(d_y)), (y, aux)

    def ref_loss(x, rw):
      return jnp.vdot(moe_reference_weights(x, rw, a["w1"], a["w2"], None, None, None,
                                            np.maximum(ids, 0), weights, activation="swiglu",
                                            gate_up_layout="concat"), _f64(d_y))

    (value, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        a["x"], a["router_weight"])
    ref_value, want = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1)))(
        a["x"], a["router_weight"])
    np.testing.assert_array_equal(aux.expert_ids, np.where(valid, ids, -1))
    assert not np.any(np.asarray(y)[7]) and np.all(np.isfinite(np.asarray(y)))
    assert rel_err(value, ref_value) < TOL
    for g, w in zip(grads, want):
      assert rel_err(g, w) < TOL
    # `route` itself, given the ids: the same empty slots, weight 0, every weight finite
    routed = jax.jit(lambda l: sonic_jax.route(l, 2, router, expert_ids=jnp.asarray(ids)))(
        a["x"] @ a["router_weight"])
    np.testing.assert_array_equal(routed.expert_ids, np.where(valid, ids, -1))
    scores = np.asarray(routed.scores)
    assert not np.any(scores[~valid]) and np.all(np.isfinite(scores))
    far = np.full((3, 8), -200.0, np.float32)  # softplus(-200) is 0 in float32
    far[:, 0] = 0.0
    g = jax.jit(jax.grad(lambda l: jnp.sum(sonic_jax.route(l, 2, router).probs[:, 0])))(far)
    assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize("router, spec", [
    (sonic_jax.Router("sigmoid", renorm_epsilon=1e-20), dict(scoring="sigmoid",
                                                             renorm_epsilon=1e-20)),
    (sonic_jax.Router("sqrt_softplus"), dict(scoring="sqrt_softplus")),
    (sonic_jax.Router("sqrt_softplus", renorm_p=2.0), dict(scoring="sqrt_softplus", renorm_p=2.0)),
])
def test_gates_that_underflow_keep_finite_weights_and_gradients(rng, router, spec):
  """float32 logits far below zero (sigmoid gates near 1e-20, sqrt-softplus ones underflowing to
  0): the renormalised weights and their gradients match the float64 oracle, and the balance
  loss's gradient is finite (a plain division by the gates' sum gives NaN). A token's NaN logits
  give it NaN weights, as a softmax's would, not zeros; the other tokens' stay as they were."""
  logits = (rng.standard_normal((6, 8)) + np.array([[-30], [-45], [-60], [-90], [-110], [0]]))
  cotangent = rng.standard_normal((6, 2))
  ids, weights = route_reference(logits, 2, **spec)

  def ours(lg):
    out = sonic_jax.routing.route(lg, 2, router)
    return jnp.vdot(out.scores, cotangent), (out.scores, out.expert_ids)

  (_, (w, got_ids)), g = jax.jit(jax.value_and_grad(ours, has_aux=True))(
      jnp.asarray(logits, jnp.float32))
  with jax.enable_x64(True):
    lg64 = jnp.asarray(logits, jnp.float64)
    w_ref = weights(lg64)
    g_ref = jax.grad(lambda lg: jnp.vdot(weights(lg), cotangent))(lg64)
  np.testing.assert_array_equal(got_ids, ids)
  for t in range(6):  # per token: the rows' weights differ by orders of magnitude
    assert rel_err(w[t], w_ref[t]) < 1e-5, (t, w[t], w_ref[t])
    assert rel_err(g[t], g_ref[t]) < 1e-4, (t, g[t], g_ref[t])
  balance = jax.grad(lambda lg: sonic_jax.routing.load_balance_loss(
      sonic_jax.routing.route(lg, 2, router).probs, jnp.full((8,), 2)))(
          jnp.asarray(logits, jnp.float32))
  assert np.isfinite(np.asarray(balance)).all()
  nan_row = jax.jit(lambda lg: sonic_jax.routing.route(lg, 2, router).scores)(
      jnp.asarray(logits, jnp.float32).at[2].set(jnp.nan))
  assert np.isnan(np.asarray(nan_row[2])).all()
  others = lambda a: np.delete(np.asarray(a), 2, axis=0)
  np.testing.assert_array_equal(others(nan_row), others(w))


def test_expert_mixture_checks_its_layout_and_equals_routed_experts(rng):
  """`expert_mixture` on a layout you built equals `routed_experts` (output and gradients), and a
  layout for other weights, scores of another shape, a missing extra_scores or another row tile
  are refused by name rather than computed silently."""
  T, d, n, E, K = 16, 16, 8, 4, 2
  p, _ = make_problem(rng, T=T, d=d, n=n, E=E)
  x, w1, w2 = (jnp.asarray(p[k], jnp.float32) for k in ("x", "w1", "w2"))
  ids = jnp.asarray(rng.integers(0, E, (T, K)), jnp.int32)
  s = jnp.asarray(rng.random((T, K)), jnp.float32)
  tile = sonic_jax.backends.resolve_backend("xla", sonic_jax.Config()).row_tile
  layout = sonic_jax.build_grouped_layout(ids, E, tile)

  @jax.jit
  def both(x, s, w1, w2):
    mine = lambda *a: jnp.sum(sonic_jax.expert_mixture(a[0], a[1], layout, a[2], a[3],
                                                       backend="xla") ** 2)
    ref = lambda *a: jnp.sum(sonic_jax.routed_experts(a[0], ids, a[1], a[2], a[3],
                                                      backend="xla")[0] ** 2)
    return (jax.value_and_grad(mine, (0, 1, 2, 3))(x, s, w1, w2),
            jax.value_and_grad(ref, (0, 1, 2, 3))(x, s, w1, w2))

  (v, g), (v_ref, g_ref) = both(x, s, w1, w2)
  assert rel_err(v, v_ref) < 1e-6
  for a, b in zip(g, g_ref):
    assert rel_err(a, b) < 1e-6
  mix = sonic_jax.expert_mixture
  with pytest.raises(ValueError, match="layout is built for 5 experts, but w1 holds 4"):
    mix(x, s, sonic_jax.build_grouped_layout(ids, 5, tile), w1, w2, backend="xla")
  with pytest.raises(ValueError, match="scores must have the layout's shape"):
    mix(x, s[:, :1], layout, w1, w2, backend="xla")
  with pytest.raises(ValueError, match="row_tile"):
    mix(x, s, sonic_jax.build_grouped_layout(ids, E, 2 * tile), w1, w2, backend="xla")
  extra = sonic_jax.build_grouped_layout(ids, E, tile, jnp.array([0, 1], jnp.int32),
                                         jnp.array([2, 3], jnp.int32))
  with pytest.raises(ValueError, match="extra_scores must be given"):
    mix(x, s, extra, w1, w2, backend="xla")
  with pytest.raises(ValueError, match="unknown activation|activation must be"):
    mix(x, s, layout, w1, w2, activation="swishglu", backend="xla")
  with pytest.raises(ValueError, match="backend must be one of"):
    mix(x, s, layout, w1, w2, backend="tpu_kernels")
  with pytest.raises(TypeError, match="layout must be a sonic_jax.GroupedLayout"):
    mix(x, s, tuple(layout), w1, w2, backend="xla")


def test_extra_pairs_outside_the_tokens_are_unused_everywhere(rng):
  """An extra pair whose token is outside [0, T) adds no row: the layout does not count it (its
  weight gradient would otherwise count a row that the output drops), and `routed_experts`
  reports it, as one whose expert is outside [0, E), with expert E."""
  T, d, n, E = 8, 16, 8, 4
  p, _ = make_problem(rng, T=T, d=d, n=n, E=E)
  x, w1, w2 = (jnp.asarray(p[k], jnp.float32) for k in ("x", "w1", "w2"))
  tokens = jnp.array([-1, T, 2, 3], jnp.int32)
  experts = jnp.array([1, 1, -1, 2], jnp.int32)
  layout = sonic_jax.build_grouped_layout(jnp.zeros((T, 0), jnp.int32), E, 32, tokens, experts)
  np.testing.assert_array_equal(np.asarray(layout.expert_counts), [0, 0, 1, 0])
  np.testing.assert_array_equal(np.asarray(layout.extra_token), [T, T, T, 3])

  @jax.jit
  def run(x, w1, w2):
    f = lambda x, w1, w2: sonic_jax.routed_experts(
        x, jnp.zeros((T, 0), jnp.int32), jnp.zeros((T, 0)), w1, w2, extra_tokens=tokens,
        extra_experts=experts, extra_scores=jnp.ones(4), backend="xla")
    (y, aux), vjp = jax.vjp(f, x, w1, w2)
    return y, aux, vjp((jnp.ones_like(y), jax.tree.map(jnp.zeros_like, aux)))

  y, aux, (_, dw1, _) = run(x, w1, w2)
  np.testing.assert_array_equal(np.asarray(aux.extra_experts), [E, E, E, 2])
  assert float(jnp.abs(dw1[1]).sum()) == 0.0 and float(jnp.abs(dw1[2]).sum()) > 0
  assert float(jnp.abs(y[:3]).sum()) == 0.0 and float(jnp.abs(y[3]).sum()) > 0


def test_a_given_selection_refuses_group_limited_routing(rng):
  logits = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
  with pytest.raises(ValueError, match="takes no group-limited routing"):
    sonic_jax.route(logits, 2, Router(n_group=2, topk_group=1),
                    expert_ids=jnp.zeros((8, 2), jnp.int32))


def test_hf_load_balancing_loss_takes_one_array_or_a_sequence(rng):
  logits = jnp.asarray(rng.standard_normal((3, 64, 8)), jnp.float32)
  per_layer = sonic_jax.hf_load_balancing_loss(list(logits), 2)
  assert rel_err(sonic_jax.hf_load_balancing_loss(logits, 2), per_layer) < 1e-6
  one = sonic_jax.hf_load_balancing_loss(logits[0], 2)
  assert rel_err(one, sonic_jax.hf_load_balancing_loss([logits[0]], 2)) < 1e-6
  with pytest.raises(ValueError, match=r"top_k must be in \[1, E = 8\], got 9"):
    sonic_jax.hf_load_balancing_loss(logits, 9)
  with pytest.raises(TypeError, match="top_k must be an int, got 2.0"):
    sonic_jax.hf_load_balancing_loss(logits, 2.0)


def test_routing_helpers_name_bad_arguments():
  """route, router_logits, sequence_balance_loss and round_tokens refuse what they would misread
  (bool or integer logits, mismatched shapes, float ids), each naming its argument; route's
  routing defaults to moe's."""
  logits = jnp.array([[1.0, 0.0, 2.0, -1.0]])
  default, raw = sonic_jax.route(logits, 2), sonic_jax.route(logits, 2, "topk_softmax_raw")
  np.testing.assert_allclose(default.scores, sonic_jax.route(logits, 2, "softmax_topk").scores)
  assert np.abs(np.asarray(default.scores) - np.asarray(raw.scores)).max() > 0.05
  with pytest.raises(TypeError, match="logits must have a floating dtype"):
    sonic_jax.route(jnp.array([[True, False, True, False]]), 2)
  with pytest.raises(TypeError, match="selection_bias must have a floating dtype"):
    sonic_jax.route(logits, 2, selection_bias=jnp.arange(4))
  with pytest.raises(TypeError, match="x must have a floating dtype"):
    sonic_jax.router_logits(jnp.ones((3, 4), jnp.int32), jnp.ones((4, 2)))
  with pytest.raises(ValueError, match=r"must share d, got shapes \(3, 4\) and \(5, 2\)"):
    sonic_jax.router_logits(jnp.ones((3, 4)), jnp.ones((5, 2)))
  with pytest.raises(TypeError, match="expert_ids must have an integer dtype"):
    sonic_jax.sequence_balance_loss(jnp.ones((1, 3, 4)) / 4, jnp.zeros((1, 3, 2)))
  routed = sonic_jax.route(logits, 2)
  with pytest.raises(ValueError, match=r"mode must be one of \('down', 'up', 'nearest'\)"):
    sonic_jax.round_tokens(routed, 2, "sideways")
  with pytest.raises(ValueError, match="logits must have shape"):
    sonic_jax.route(logits[0, 0], 1)
  # round_tokens' arrays: one T, (T, K) and (T, E) fields, float logits of probs' shape (a wrong
  # shape would gather other tokens' weights silently); traced only
  def rounded(routed=None, logits=None):
    many = sonic_jax.route(jnp.tile(jnp.asarray(logits_host), (3, 1)), 2)
    return sonic_jax.round_tokens(routed(many) if routed else many, 2, "up",
                                  logits=None if logits is None else jnp.asarray(logits))

  logits_host = np.asarray(logits)
  for bad in (dict(logits=np.tile(logits_host, (2, 1))),
              dict(logits=np.tile(logits_host, (3, 1))[:, :2]),
              dict(routed=lambda r: r._replace(expert_ids=r.expert_ids[:2])),
              dict(routed=lambda r: jax.tree.map(lambda a: a[None], r))):
    with pytest.raises(ValueError, match="round_tokens takes routed.scores and routed.expert_ids"):
      jax.eval_shape(lambda: rounded(**bad))
  with pytest.raises(TypeError, match="logits must have a floating dtype"):
    jax.eval_shape(lambda: rounded(logits=np.ones((3, 4), np.int32)))
  # hf_load_balancing_loss's list of layers: non-empty, arrays of one E; the mask an array
  for bad, exc, match in (([], TypeError, "non-empty list of arrays"),
                          (None, TypeError, "non-empty list of arrays"),
                          ([logits, logits[:, :3]], ValueError, "must have one E"),
                          (logits[0, 0], ValueError, r"must be \(..., T, E\) logits")):
    with pytest.raises(exc, match=match):
      sonic_jax.hf_load_balancing_loss(bad, 1)
  with pytest.raises(TypeError, match="attention_mask must be None or a"):
    sonic_jax.hf_load_balancing_loss(logits, 1, attention_mask=[[1]])
  with pytest.raises(TypeError, match=r"top_k must be an int \(static"):
    jax.jit(lambda k: sonic_jax.route(logits, k))(2)


def test_balance_losses_without_tokens_are_zero():
  """No tokens (or every token masked) is no imbalance, as `moe`'s loss is for T = 0: zero, not
  the 0 / 0 of a mean over nothing."""
  logits = jnp.array([[1.0, 0.0, 2.0, -1.0], [0.5, 0.1, -2.0, 1.0]])
  hf, seq = sonic_jax.hf_load_balancing_loss, sonic_jax.sequence_balance_loss
  losses, (masked, unmasked) = jax.jit(lambda logits: (
      (hf(jnp.zeros((0, 4)), 2), hf(logits, 2, attention_mask=jnp.zeros((1, 2))),
       seq(jnp.zeros((2, 0, 4)), jnp.zeros((2, 0, 2), jnp.int32)),
       seq(jnp.zeros((0, 3, 4)), jnp.zeros((0, 3, 2), jnp.int32))),
      (hf(logits, 2, attention_mask=jnp.ones((1, 2))), hf(logits, 2))))(logits)
  assert [float(v) for v in losses] == [0.0] * 4, losses
  np.testing.assert_allclose(masked, unmasked, rtol=1e-6)  # a mask keeping every token


def test_p_norm_renormalisation_stays_finite():
  """A softmax router's p-norm renormalisation (p != 1) in log space: the p-th powers of
  near-uniform probabilities underflow for large p (inf weights by the plain formula), and for
  small p it equals that formula."""
  logits = jnp.array([[0.0, -0.3, 0.1, 0.05], [0.0] * 4])
  routers = [Router("softmax", renorm_p=p) for p in (50.0, 100.0)]
  routers.append(Router("softmax", renorm_p=2.0, renorm_epsilon=1e-3))
  *large, out = jax.jit(lambda logits: [sonic_jax.route(logits, 2, r) for r in routers])(logits)
  for p, scores in zip((50.0, 100.0), (r.scores for r in large)):
    assert np.all(np.isfinite(scores)) and np.all(np.asarray(scores) <= 1.0 + 1e-6), (p, scores)
    np.testing.assert_allclose(scores[1], [2 ** (-1 / p)] * 2, rtol=1e-5)
  picked = np.take_along_axis(np.asarray(jax.nn.softmax(logits)), np.asarray(out.expert_ids), 1)
  want = picked / (np.linalg.norm(picked, axis=-1, keepdims=True) + 1e-3)
  np.testing.assert_allclose(out.scores, want, rtol=1e-5)


def test_moe_routing_rebuilt_from_public_functions(rng):
  """route's docstring: router_logits + router_bias, route, each weight times expert_scale of its
  expert, then routed_experts, give moe's output, ids and weights (a scaled DeepSeek-style router,
  a selection bias, Gemma 4's expert scale)."""
  p, _ = make_problem(rng, T=40, d=16, n=8, E=8, bias=True)
  router = Router("sigmoid", renorm_epsilon=1e-20, routed_scaling_factor=2.5)
  with jax.enable_x64(True):
    a = {k: _f64(v) for k, v in p.items()}
    r_bias, s_bias, scale = (_f64(v) for v in (rng.standard_normal(8) * 0.5,
                                               rng.standard_normal(8) * 0.05,
                                               rng.uniform(0.5, 2.0, 8)))

    @jax.jit
    def both(x, rw, w1, w2, b1):
      y, aux = sonic_jax.moe(x, rw, w1, w2, b1=b1, top_k=2, routing=router, router_bias=r_bias,
                             selection_bias=s_bias, expert_scale=scale, backend="xla")
      out = sonic_jax.route(sonic_jax.router_logits(x, rw) + r_bias, 2, router, s_bias)
      scores = out.scores * jnp.where(out.expert_ids >= 0, scale[out.expert_ids], 0.0)
      y_parts, _ = sonic_jax.routed_experts(x, out.expert_ids, scores, w1, w2, b1=b1,
                                            backend="xla")
      return (y, aux.expert_ids, aux.scores), (y_parts, out.expert_ids, scores)

    (y, ids, scores), (y_parts, ids_parts, scores_parts) = both(
        a["x"], a["router_weight"], a["w1"], a["w2"], a["b1"])
  np.testing.assert_array_equal(ids_parts, ids)
  assert rel_err(scores_parts, scores) < TOL and rel_err(y_parts, y) < TOL
