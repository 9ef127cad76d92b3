"""sonic_jax.layers.MoE: parameters, equivalence with the functional op, training, bridge."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sonic_jax
from sonic_jax import activations as acts
from sonic_jax.layers import MoE, SelectionBias
from cases import gemm_operand_dtypes
from oracle import rel_err


def _layer(**kw):
  args = dict(d_model=32, num_experts=4, expert_dim=16, top_k=2, init_std=0.2, backend="xla",
              rngs=nnx.Rngs(0))
  args.update(kw)
  return MoE(**args)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_layer_equals_functional_op_with_biases_and_shared_experts(rng, activation):
  m = _layer(activation=activation, use_bias=True, num_shared_experts=2)
  m.b1[...] = jnp.asarray(rng.standard_normal(m.b1.shape), jnp.float32)
  m.b2[...] = jnp.asarray(rng.standard_normal(m.b2.shape), jnp.float32)
  x = jnp.asarray(rng.standard_normal((3, 10, 32)), jnp.float32)

  @nnx.jit  # one program: eagerly, each op compiles its own
  def run(m, x):
    y, aux = m(x)
    flat = x.reshape(-1, 32)
    want, stats = sonic_jax.moe(flat, m.router[...], m.w1[...], m.w2[...], top_k=2,
                                activation=activation, b1=m.b1[...], b2=m.b2[...], backend="xla")
    act = acts.get_activation(activation)
    shared = acts.apply_activation(flat @ m.shared_in[...], act, "concat") @ m.shared_out[...]
    return y, aux.loss, want + shared, 0.01 * stats.load_balance_loss + 1e-3 * stats.z_loss

  y, loss, want, want_loss = run(m, x)
  assert y.shape == x.shape
  assert rel_err(y.reshape(-1, 32), want) < 1e-5
  np.testing.assert_allclose(loss, want_loss, rtol=1e-6)


def test_layer_family_options_equal_the_functional_op(rng):
  """A family router with groups and a scaling factor, a trainable router bias, gpt-oss's clamped
  SwiGLU, a sigmoid-gated shared expert (Qwen2-MoE) and the sequence-wise balance loss."""
  router = sonic_jax.Router("sigmoid", renorm_epsilon=1e-20, n_group=2, topk_group=1,
                            group_score="top2_sum", routed_scaling_factor=2.5)
  m = _layer(routing=router, activation="clamped_swiglu", use_router_bias=True,
             num_shared_experts=1, shared_expert_gate=True, balance_loss="sequence")
  m.router_bias[...] = jnp.asarray(rng.standard_normal(4), jnp.float32)
  x = jnp.asarray(rng.standard_normal((3, 10, 32)), jnp.float32)
  flat = x.reshape(-1, 32)

  @nnx.jit  # one program: eagerly, each op compiles its own
  def run(m, x):
    y, aux = m(x)
    want, stats = sonic_jax.moe(flat, m.router[...], m.w1[...], m.w2[...], top_k=2,
                                routing=router, activation="clamped_swiglu",
                                router_bias=m.router_bias[...], backend="xla")
    act = acts.get_activation("clamped_swiglu")
    shared = acts.apply_activation(flat @ m.shared_in[...], act, "concat") @ m.shared_out[...]
    shared = shared * jax.nn.sigmoid(flat @ m.shared_gate[...])
    seq = sonic_jax.sequence_balance_loss(stats.probs.reshape(3, 10, 4),
                                          stats.choice_ids.reshape(3, 10, 2))
    grads = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2) + m(x)[1].loss)(m)
    norms = [jnp.linalg.norm(getattr(grads, name)[...])
             for name in ("router_bias", "shared_gate", "router")]
    return y, aux, want + shared, seq, 0.01 * seq + 1e-3 * stats.z_loss, norms

  y, aux, want, seq, want_loss, norms = run(m, x)
  assert rel_err(y.reshape(-1, 32), want) < 1e-5
  np.testing.assert_allclose(aux.stats.load_balance_loss, seq, rtol=1e-6)
  np.testing.assert_allclose(aux.loss, want_loss, rtol=1e-6)
  for name, norm in zip(("router_bias", "shared_gate", "router"), norms):
    assert float(norm) > 0, name
  assert "router_bias" in nnx.state(m, nnx.Param)
  with pytest.raises(ValueError, match="balance_loss='sequence'"):
    m(flat)
  no_tokens = nnx.jit(lambda m: m(jnp.zeros((0, 10, 32)))[1].stats.load_balance_loss)(m)
  assert float(no_tokens) == 0.0
  with pytest.raises(ValueError, match="balance_loss='sequence' does not take expert_parallel"):
    _layer(balance_loss="sequence", expert_parallel_axis="ep")


def test_layer_gemma4_router_equals_the_functional_op(rng):
  """router_norm_eps and expert_scale (Gemma 4): the router sees router_input RMS-normalised, times
  its trained scale and d ** -0.5; each weight is times its expert's trained scale. Both scales
  are parameters that get gradients. Then a fixed selection (expert_ids) through the layer."""
  m = _layer(routing="topk_softmax", router_norm_eps=1e-6, use_expert_scale=True)
  m.router_scale[...] = jnp.asarray(rng.uniform(0.5, 2.0, 32), jnp.float32)
  m.expert_scale[...] = jnp.asarray(rng.uniform(0.5, 2.0, 4), jnp.float32)
  x = jnp.asarray(rng.standard_normal((3, 10, 32)), jnp.float32)
  h = jnp.asarray(rng.standard_normal((3, 10, 32)) * 3.0, jnp.float32)
  # A fixed selection too (DeepSeek-V4's hash layers), x's leading dims: the router weights it.
  ids = jnp.asarray(rng.integers(0, 4, (3, 10, 2)), jnp.int32)

  @nnx.jit
  def layer_runs(m, x, h, ids):
    y, aux = m(x, router_input=h)
    y_ids, aux_ids = m(x, router_input=h, expert_ids=ids)
    return (y, aux.stats.expert_ids, y_ids, aux_ids.stats.expert_ids,
            m(x)[0] - m(x, router_input=x)[0])

  @jax.jit
  def functional(x, h, router, w1, w2, router_scale, expert_scale, ids):
    flat = h.reshape(-1, 32)
    r = flat / jnp.sqrt(jnp.mean(flat ** 2, -1, keepdims=True) + 1e-6) * router_scale
    kw = dict(top_k=2, routing="topk_softmax", router_input=r / jnp.sqrt(32.0),
              expert_scale=expert_scale, backend="xla")
    want, stats = sonic_jax.moe(x.reshape(-1, 32), router, w1, w2, **kw)
    return want, stats.expert_ids, sonic_jax.moe(x.reshape(-1, 32), router, w1, w2,
                                                 expert_ids=ids.reshape(-1, 2), **kw)[0]

  y, y_ids_chosen, y_fixed, fixed_ids, default_diff = layer_runs(m, x, h, ids)
  want, want_ids, want_fixed = functional(x, h, m.router[...], m.w1[...], m.w2[...],
                                          m.router_scale[...], m.expert_scale[...], ids)
  assert rel_err(y.reshape(-1, 32), want) < 1e-5
  np.testing.assert_array_equal(y_ids_chosen, want_ids)
  assert not np.any(np.asarray(default_diff))  # router_input defaults to x
  assert rel_err(y_fixed.reshape(-1, 32), want_fixed) < 1e-5
  np.testing.assert_array_equal(fixed_ids, ids.reshape(-1, 2))
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, router_input=h)[0] ** 2)))(m)
  for name in ("router_scale", "expert_scale", "router"):
    assert float(jnp.linalg.norm(getattr(grads, name)[...])) > 0, name
  with pytest.raises(ValueError, match="router_input must have x's shape"):
    m(x, router_input=h[:, :5])
  with pytest.raises(TypeError, match="router_input must have a floating dtype, got int32"):
    m(x, router_input=h.astype(jnp.int32))
  with pytest.raises(TypeError, match="router_input must be an array, got list"):
    m(x, router_input=np.asarray(h).tolist())
  with pytest.raises(ValueError, match="expert_ids must have shape"):
    m(x, expert_ids=ids.reshape(-1, 2))
  with pytest.raises(ValueError, match="router_norm_eps"):
    _layer(router_norm_eps=-1.0)
  with pytest.raises(ValueError, match="router_norm_eps must be None or > 0"):
    _layer(router_norm_eps=0.0)  # an all-zero (padding) token would route by NaN


def test_layer_capacity_on_one_device_drops_and_counts(rng):
  m = _layer(capacity_factor=0.5)
  x = jnp.asarray(rng.standard_normal((40, 32)), jnp.float32)
  # One program: eagerly, each op compiles its own.
  (y, aux), (want, stats) = nnx.jit(lambda m, x: (m(x), sonic_jax.moe(
      x, m.router[...], m.w1[...], m.w2[...], top_k=2, capacity_factor=0.5, backend="xla")))(m, x)
  assert rel_err(y, want) < 1e-6
  assert int(aux.stats.dropped_pairs) == int(stats.dropped_pairs) >= 40 * 2 // 2
  assert int(jnp.sum(aux.stats.expert_ids >= 0)) <= 4 * 10  # ceil(0.5 * 40 * 2 / 4) an expert
  assert int(jnp.sum(aux.stats.expert_counts)) == 80  # the routed load, before the drop


def test_bfloat16_layer_runs_every_gemm_on_bfloat16_operands(rng):
  """A bfloat16 layer (router, experts and shared experts in bfloat16): no GEMM of its forward or
  backward takes float32 operands (autodiff of a float32-result dot would make the backward's
  GEMMs float32); its gradients stay close to those of the same parameters in float32."""
  x = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
  m16 = _layer(num_shared_experts=1, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  graph16, state16 = nnx.split(m16)
  graph32, _ = nnx.split(_layer(num_shared_experts=1, dtype=jnp.float32))
  state32 = jax.tree.map(lambda v: v.astype(jnp.float32), state16)

  def grad_fn(graph, dtype):
    loss = lambda s: jnp.sum(nnx.merge(graph, s)(x.astype(dtype))[0].astype(jnp.float32) ** 2)
    return jax.grad(loss)

  step16 = grad_fn(graph16, jnp.bfloat16)
  assert gemm_operand_dtypes(jax.make_jaxpr(step16)(state16).jaxpr) == {jnp.dtype(jnp.bfloat16)}
  g16, g32 = jax.jit(step16)(state16), jax.jit(grad_fn(graph32, jnp.float32))(state32)
  for name in ("router", "w1", "w2", "shared_in", "shared_out"):
    assert rel_err(g16[name][...], g32[name][...]) < 2e-2, name


def test_sharding_metadata_on_every_parameter():
  """The logical axis names, the defaults and a caller's own (None: an axis left unnamed)."""
  def names(**kw):
    m = _layer(use_bias=True, num_shared_experts=1, **kw)
    specs = nnx.get_partition_spec(nnx.state(m, nnx.Param))
    return {k: tuple(v.out_sharding) for k, v in specs.items()}

  default = names()
  assert default["w1"] == ("expert", "embed", "mlp")
  assert default["w2"] == ("expert", "mlp", "embed")
  assert default["router"] == ("embed", None)
  assert default["b1"] == ("expert", "mlp") and default["shared_in"] == ("embed", "mlp")
  own = names(expert_axis="e", embed_axis=None, mlp_axis="ff")
  assert own["w1"] == ("e", None, "ff") and own["w2"] == ("e", "ff", None)
  assert own["router"] == (None, None) and own["b2"] == ("e", None)
  assert own["shared_in"] == (None, "ff") and own["shared_out"] == ("ff", None)


def test_signature_is_the_constructors():
  """help() and inspect see MoE's constructor arguments, not Flax's metaclass (*args, **kwargs)."""
  import inspect
  params = inspect.signature(MoE).parameters
  assert list(params)[:4] == ["d_model", "num_experts", "expert_dim", "top_k"]
  assert params["rngs"].kind is inspect.Parameter.KEYWORD_ONLY


def test_compute_dtype_and_param_dtype(rng):
  m = _layer(dtype=jnp.bfloat16, param_dtype=jnp.float32)
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  y, grads = nnx.jit(lambda m: (m(x)[0], nnx.grad(
      lambda m: jnp.sum(m(x)[0].astype(jnp.float32) ** 2))(m)))(m)
  assert y.dtype == jnp.bfloat16 and m.w1[...].dtype == jnp.float32
  assert grads["w1"][...].dtype == jnp.float32
  assert np.isfinite(np.asarray(grads["w1"][...])).all()


def test_float32_router_beside_bfloat16_experts(rng):
  """router_param_dtype=float32 with bfloat16 parameters: the router's parameters stored and used
  in float32 (logits a float32 product of the bfloat16 input), the experts' in bfloat16, and each
  parameter's gradient in its own dtype."""
  m = _layer(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, router_param_dtype=jnp.float32,
             use_router_bias=True, use_bias=True)
  assert m.router[...].dtype == m.router_bias[...].dtype == jnp.float32
  assert m.w1[...].dtype == m.b1[...].dtype == jnp.bfloat16
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.bfloat16)
  (y, aux), grads = nnx.jit(lambda m: (m(x), nnx.grad(
      lambda m: jnp.sum(m(x)[0].astype(jnp.float32) ** 2))(m)))(m)
  want = np.asarray(x, np.float64) @ np.asarray(m.router[...], np.float64)
  assert rel_err(aux.stats.router_logits, want) < 1e-6
  assert y.dtype == jnp.bfloat16
  assert grads["router"][...].dtype == jnp.float32 and grads["w1"][...].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="router_param_dtype"):
    _layer(router_param_dtype=jnp.int8)


def test_adamw_training_lowers_the_loss(rng):
  """A student MoE learns a teacher MoE's function under nnx.jit with optax AdamW."""
  teacher = _layer(rngs=nnx.Rngs(1), init_std=0.3)
  student = _layer(rngs=nnx.Rngs(2), init_std=0.1, bias_update_rate=1e-3)
  x = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
  target, _ = nnx.jit(lambda m, x: m(x))(teacher, x)
  opt = nnx.Optimizer(student, optax.adamw(3e-3), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, x, target):
    def loss_fn(model):
      y, aux = model(x)
      return jnp.mean((y - target) ** 2) + aux.loss, aux
    (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    model.update_selection_bias(aux.stats.expert_counts)
    return loss

  losses = [float(step(student, opt, x, target)) for _ in range(60)]
  assert losses[-1] < 0.5 * losses[0], losses[::10]
  assert isinstance(student.selection_bias, SelectionBias)
  assert np.any(np.asarray(student.selection_bias[...]) != 0)  # moved by the update, not the optimizer
  assert "selection_bias" not in nnx.state(student, nnx.Param)


def test_selection_bias_update_moves_towards_balance():
  m = _layer(bias_update_rate=0.1)
  m.update_selection_bias(jnp.array([10, 0, 5, 5]))
  np.testing.assert_allclose(m.selection_bias[...], [-0.1, 0.1, 0.0, 0.0])
  plain = _layer()
  plain.update_selection_bias(jnp.array([10, 0, 5, 5]))  # no bias: a no-op
  assert plain.selection_bias is None
  for counts in (jnp.ones((3, 4)), jnp.int32(3)):  # not the bias's shape (E,)
    with pytest.raises(ValueError, match=r"must have the selection bias's shape \(4,\)"):
      m.update_selection_bias(counts)
  with pytest.raises(TypeError, match="expert_counts must be an array"):
    m.update_selection_bias([10, 0, 5, 5])
  # Layers stacked by nnx.vmap: (L, E) counts, each layer against its own mean.
  stack = nnx.split_rngs(splits=2)(nnx.vmap(lambda r: _layer(bias_update_rate=0.1, rngs=r)))
  stacked = stack(nnx.Rngs(0))
  stacked.update_selection_bias(jnp.array([[10, 0, 5, 5], [1, 1, 1, 5]]))
  np.testing.assert_allclose(stacked.selection_bias[...],
                             [[-0.1, 0.1, 0, 0], [0.1, 0.1, 0.1, -0.1]])
  # A layer whose counts are not all finite keeps its bias; the others still move.
  stacked.update_selection_bias(jnp.array([[np.nan, 0, 5, 5], [1, 1, 1, np.inf]]))
  stacked.update_selection_bias(jnp.array([[10, 0, 5, 5], [np.inf, 1, 1, 5]]))
  np.testing.assert_allclose(stacked.selection_bias[...],
                             [[-0.2, 0.2, 0, 0], [0.1, 0.1, 0.1, -0.1]])


def test_linen_bridge(rng):
  layer = nnx.bridge.to_linen(MoE, 32, 4, 16, 2, backend="xla", init_std=0.2)
  x = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.float32)
  variables = jax.jit(layer.init)(jax.random.key(0), x)
  from flax import linen as nn  # the bridge boxes parameters with their sharding names
  assert tuple(variables["params"]["w1"].metadata["out_sharding"]) == ("expert", "embed", "mlp")

  @jax.jit  # one program: eagerly, each op compiles its own
  def run(variables):
    y, _ = layer.apply(variables, x)
    p = nn.unbox(variables)["params"]
    want, _ = sonic_jax.moe(x.reshape(-1, 32), p["router"], p["w1"], p["w2"], top_k=2,
                            backend="xla")
    return y, want, jax.grad(lambda v: jnp.sum(layer.apply(v, x)[0] ** 2))(variables)

  y, want, g = run(variables)
  assert rel_err(y.reshape(-1, 32), want) < 1e-6
  assert float(jnp.linalg.norm(nn.unbox(g)["params"]["w1"])) > 0


def test_bad_layer_arguments():
  with pytest.raises(ValueError, match="top_k"):
    _layer(top_k=5)
  with pytest.raises(ValueError, match="activation"):
    _layer(activation="tanh")
  # Refused at construction, not at the first call (the last one would never be in eval mode).
  with pytest.raises(ValueError, match="routing"):
    _layer(routing="expert_choice")
  with pytest.raises(ValueError, match="backend"):
    _layer(backend="cuda")
  with pytest.raises(ValueError, match="gate_up_layout"):
    _layer(gate_up_layout="split")
  with pytest.raises(ValueError, match="token_rounding needs a softmax router"):
    _layer(routing="sigmoid_topk", token_rounding="nearest", deterministic=True)
  with pytest.raises(ValueError, match="expert_parallel_scheme"):
    _layer(expert_parallel_axis="ep", expert_parallel_scheme="ring")
  with pytest.raises(ValueError, match="n_group = 3 must divide"):
    _layer(routing=sonic_jax.Router(n_group=3))
  with pytest.raises(ValueError, match="balance_loss"):
    _layer(balance_loss="token")
  with pytest.raises(ValueError, match="shared_expert_gate needs"):
    _layer(shared_expert_gate=True)
  with pytest.raises(ValueError, match="exclude each other"):
    _layer(capacity_factor=1.0, token_rounding="up")
  for kwargs, match in ((dict(token_rounding="up"), "token_rounding"),
                        (dict(bias_update_rate=0.01), "bias_update_rate"),
                        (dict(routing=sonic_jax.Router(n_group=2, topk_group=1)), "n_group")):
    with pytest.raises(ValueError, match=f"fixed_selection=True .*{match}"):
      _layer(fixed_selection=True, **kwargs)  # each would fail at every call
    # and a call given a selection refuses it in the layer's words
    with pytest.raises(ValueError, match=f"expert_ids \\(a given selection\\) takes no .*{match}"):
      _layer(**kwargs)(jnp.ones((6, 32)), expert_ids=jnp.zeros((6, 2), jnp.int32))
  # Types and ranges a call would refuse (or misread), named at construction.
  with pytest.raises(TypeError, match="top_k must be an int"):
    _layer(top_k=2.0)
  with pytest.raises(ValueError, match="expert_dim must be >= 1"):
    _layer(expert_dim=0)
  with pytest.raises(ValueError, match="num_shared_experts must be >= 0"):
    _layer(num_shared_experts=-1)
  with pytest.raises(TypeError, match="capacity_factor"):
    _layer(capacity_factor=True)
  with pytest.raises(ValueError, match="capacity_factor must be finite"):
    _layer(capacity_factor=float("inf"))
  assert _layer(capacity_factor=np.float32(1.25)).capacity_factor == np.float32(1.25)
  assert _layer(expert_parallel_axis="ep", token_axes="data").token_axes == ("data",)
  for kwargs, match in ((dict(shared_expert_dim=0), "shared_expert_dim"),
                        (dict(num_shared_experts=1, shared_expert_dim=-4), "shared_expert_dim"),
                        (dict(bias_update_rate=-0.1), "bias_update_rate"),
                        (dict(z_loss_coef=float("nan")), "z_loss_coef"),
                        (dict(dtype="float33"), "dtype"), (dict(dtype=jnp.int32), "dtype"),
                        (dict(param_dtype=jnp.int8), "param_dtype"),
                        (dict(param_dtype=None), "param_dtype must be a floating dtype, got")):
    with pytest.raises(ValueError, match=match):
      _layer(**kwargs)
  # a wrong type is a TypeError, a wrong value of the right type a ValueError
  for kwargs, match in ((dict(shared_expert_dim=2.0), "shared_expert_dim must be None or an int"),
                        (dict(bias_update_rate="0.1"), "bias_update_rate must be a real number"),
                        (dict(load_balance_coef="a"), "load_balance_coef must be a real number"),
                        (dict(init_std=True), "init_std must be a real number")):
    with pytest.raises(TypeError, match=match):
      _layer(**kwargs)
  with pytest.raises(TypeError, match="token_axes"):
    _layer(token_axes=5)
  with pytest.raises(TypeError, match="expert_parallel_axis must be None or one mesh axis"):
    _layer(expert_parallel_axis=("data", "ep"))
  for token_axes in ((), ("ep", "ep")):
    with pytest.raises(ValueError, match="token_axes must name one or more distinct"):
      _layer(expert_parallel_axis="ep", token_axes=token_axes)
  with pytest.raises(TypeError, match="rngs must be a flax.nnx.Rngs"):
    _layer(rngs=None)
  for name in ("use_bias", "fixed_selection", "deterministic"):
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
      _layer(**{name: "no"})
  for kwargs in (dict(init_std=float("nan")), dict(router_init_std=-1.0)):
    with pytest.raises(ValueError, match="init_std must be a finite number >= 0"):
      _layer(**kwargs)
  assert not np.any(np.asarray(_layer(router_init_std=0.0).router[...]))  # 0 is a std, not unset
  layer = _layer()
  with pytest.raises(TypeError, match="x must be an array"):
    layer([[1.0] * 32] * 4)
  with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., d_model\)"):
    layer(jnp.ones(()))
  with pytest.raises(ValueError, match="d_model = 32"):
    layer(jnp.ones((4, 16)))
  with pytest.raises(TypeError, match="x must have a floating dtype, got int32"):
    layer(jnp.ones((4, 32), jnp.int32))


def test_expert_parallel_axis_needs_a_mesh_or_shard_map():
  layer = _layer(expert_parallel_axis="ep")
  with pytest.raises(ValueError, match="expert_parallel_axis='ep'.*jax.set_mesh"):
    layer(jnp.ones((8, 32)))


def test_expert_parallel_auto_scheme():
  """"auto" moves fewer rows: all-gather when dropless or while P < c * K, all-to-all beyond."""
  from sonic_jax.parallel import resolve_scheme
  assert resolve_scheme("auto", 64, 4) == "all_gather"
  assert [resolve_scheme("auto", p, 4, 1.25) for p in (2, 4, 5, 8)] == ["all_gather"] * 2 + [
      "all_to_all"] * 2
  assert resolve_scheme("auto", 8, 8, 1.25) == "all_gather"
  assert resolve_scheme("all_to_all", 2, 4) == "all_to_all"
  with pytest.raises(ValueError, match="scheme must be 'auto' or one of"):
    resolve_scheme("ring", 2, 4)
  layer = _layer(expert_parallel_axis="ep", capacity_factor=1.25)
  assert layer.expert_parallel_scheme == "auto" and layer.capacity_factor == 1.25
