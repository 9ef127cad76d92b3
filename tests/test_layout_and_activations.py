"""The grouped layout's invariants and the hand-written activation derivatives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sonic_jax import activations as acts
from sonic_jax.activations import Activation
from sonic_jax.layout import build_grouped_layout, grouped_rows


@pytest.mark.parametrize("method", ["sort", "block_ranks"])
@pytest.mark.parametrize("row_tile", [1, 4, 32, 128])
@pytest.mark.parametrize("kind", ["random", "skewed", "with_unrouted"])
def test_grouped_layout_invariants(rng, row_tile, kind, method):
  T, S, E = 37, 3, 6
  ids = rng.integers(0, E, size=(T, S))
  if kind == "skewed":
    ids[:, 0] = 2
    ids[ids == 4] = 1  # expert 4 gets nothing
  if kind == "with_unrouted":
    ids[rng.random((T, S)) < 0.3] = -1  # 'no expert'
  build = jax.jit(build_grouped_layout, static_argnums=(1, 2), static_argnames="method")
  lay = build(jnp.asarray(ids, jnp.int32), E, row_tile, method=method)
  lay = jax.tree.map(np.asarray, lay)
  R = grouped_rows(T * S, E, row_tile)
  assert lay.row_token.shape == (R,) and R % row_tile == 0

  counts = np.array([(ids == e).sum() for e in range(E)])
  np.testing.assert_array_equal(lay.expert_counts, counts)
  np.testing.assert_array_equal(lay.group_sizes, -(-counts // row_tile) * row_tile)
  assert lay.num_tiles == lay.group_sizes.sum() // row_tile

  starts = np.concatenate([[0], np.cumsum(lay.group_sizes)[:-1]])
  for e in range(E):
    rows = np.arange(starts[e], starts[e] + lay.group_sizes[e])
    real = rows[: counts[e]]
    pairs = lay.row_pair[real]
    # Expert e's real rows hold exactly its pairs, tokens ascending; the rest of its rows pad.
    np.testing.assert_array_equal(np.sort(pairs), np.flatnonzero(ids.reshape(-1) == e))
    assert np.all(np.diff(pairs) > 0)
    np.testing.assert_array_equal(lay.row_token[real], pairs // S)
    assert np.all(lay.row_pair[rows[counts[e]:]] == -1)
    assert np.all(lay.row_token[rows[counts[e]:]] == pairs[:1] // S)  # padding: its first token
    assert np.all(lay.row_expert[rows] == e)
  # Every tile belongs to one expert; tiles past the used ones are marked E.
  np.testing.assert_array_equal(lay.row_expert.reshape(-1, row_tile), lay.tile_expert[:, None]
                                .repeat(row_tile, 1))
  assert np.all(lay.tile_expert[lay.num_tiles:] == E)
  assert np.all(lay.row_pair[lay.num_tiles * row_tile:] == -1)
  # pair_row and row_pair are inverse; unrouted pairs point past the buffer.
  flat_rows = lay.pair_row.reshape(-1)
  routed = (ids.reshape(-1) >= 0)
  np.testing.assert_array_equal(lay.row_pair[flat_rows[routed]], np.flatnonzero(routed))
  assert np.all(flat_rows[~routed] == R)
  assert np.all((lay.row_token >= 0) & (lay.row_token < T))


def test_layout_refuses_bad_arguments_and_never_wraps_wide_ids():
  """Each refusal names its argument; an int64 id past int32's range is "no expert", not wrapped
  onto a real one by the narrowing (a host array, checked before JAX narrows it)."""
  ids = np.array([[1, 0]], np.int32)
  for args, kwargs, exc, match in (
      ((ids.astype(np.float32), 4, 2), {}, TypeError, "expert_ids must have an integer dtype"),
      ((ids.tolist(), 4, 2), {}, TypeError, "expert_ids must be an array"),
      ((ids[0], 4, 2), {}, ValueError, r"expert_ids must be \(T, S\)"),
      ((ids, 0, 2), {}, ValueError, "num_experts must be >= 1"),
      ((ids, 4.0, 2), {}, TypeError, "num_experts must be an int"),
      ((ids, 4, 2.5), {}, TypeError, "row_tile must be an int"),
      ((ids, 4, 2), dict(extras_by_expert="yes"), TypeError, "extras_by_expert must be a bool"),
      ((ids, 4, 2), dict(extra_tokens=np.zeros(2), extra_experts=np.zeros(2, np.int32)),
       TypeError, "extra_tokens must have an integer dtype")):
    with pytest.raises(exc, match=match):
      jax.eval_shape(lambda: build_grouped_layout(*args, **kwargs))
  wide = np.array([[2**32 + 1, 0]], np.int64)
  counts = jax.jit(lambda: build_grouped_layout(wide, 4, 2).expert_counts)()
  np.testing.assert_array_equal(counts, [1, 0, 0, 0])
  extra = jax.jit(lambda: build_grouped_layout(
      np.array([[1, 0], [2, 3]]), 4, 2, extra_tokens=np.array([1, 0], np.int64),
      extra_experts=np.array([2**32 + 2, 3], np.int64)).expert_counts)()
  np.testing.assert_array_equal(extra, [1, 1, 1, 2])  # the wide extra expert: an unused entry


@pytest.mark.parametrize("num_pairs,e_count", [(1, 1), (5000, 8), (5000, 255), (70000, 256),
                                                (1000, 65535), (1000, 2**21)])
def test_stable_sort_ids_is_the_stable_argsort(rng, num_pairs, e_count):
  """The (key, pair index) sort on the narrowest key that holds E (uint8 up to E = 255 with the
  'no expert' id E itself, uint16 from 256, int32 past 65535) gives the stable argsort's order,
  ties in pair order."""
  from sonic_jax import layout
  values = np.unique(np.concatenate([rng.integers(0, e_count + 1, 38), [0, e_count - 1, e_count]]))
  flat = jnp.asarray(rng.choice(values, num_pairs), jnp.int32)  # many ties, the extreme ids
  order, sorted_ids = jax.jit(layout.stable_sort_ids, static_argnums=1)(flat, e_count)
  want = np.argsort(np.asarray(flat), kind="stable")
  np.testing.assert_array_equal(np.asarray(order), want)
  np.testing.assert_array_equal(np.asarray(sorted_ids), np.asarray(flat)[want])


@pytest.mark.parametrize("name", sorted(acts.ACTIVATIONS))
@pytest.mark.parametrize("layout", acts.GATE_UP_LAYOUTS)
def test_activation_backward_matches_autodiff(rng, name, layout):
  act = acts.ACTIVATIONS[name]
  h = jnp.asarray(rng.standard_normal((16, 24)) * 2, jnp.float32)
  d_a = jnp.asarray(rng.standard_normal((16, 24 // act.width_multiplier())), jnp.float32)
  a, vjp = jax.vjp(lambda h: acts.apply_activation(h, act, layout), h)
  a2, d_h = acts.activation_backward(h, d_a, act, layout)
  np.testing.assert_allclose(a2, a, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(d_h, vjp(d_a)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.xla_optimized  # unoptimized XLA:CPU moves float32 sigmoids near 0 by up to 1e-4
@pytest.mark.parametrize("name", sorted(acts.ACTIVATIONS))
def test_kernel_activations_match_the_reference(name):
  """The kernels' forms of every activation, derivative and GLU backward (`kernel=True`: tanh for
  the sigmoid, a polynomial for erf, rsqrt for the reciprocal) against the reference forms, over
  [-30, 30] (saturated tails and gpt-oss's clamps included), on the CPU where they evaluate
  exactly (a GPU kernel evaluates tanh and rsqrt approximately: the compiled kernel and layer
  tests bound that)."""
  act = acts.get_activation(name)
  g = jnp.concatenate([jnp.linspace(-30.0, 30.0, 60001, dtype=jnp.float32),
                       jnp.asarray([0.0, -0.0, 1e-30, -1e-30], jnp.float32)])
  pairs = [(lambda v: act.fn(v, kernel=True), act.fn),
           (lambda v: act.grad(v, kernel=True), act.grad)]
  if act.is_glu:
    up = jnp.flip(g) * 0.7
    pairs += [(lambda v: act.glu(v, up, kernel=True), lambda v: act.glu(v, up))]
    pairs += [(lambda v, i=i: act.glu_backward(v, up, 0.3 * up, kernel=True)[i],
               lambda v, i=i: act.glu_backward(v, up, 0.3 * up)[i]) for i in range(3)]
  for kernel, ref in pairs:
    got, want = np.asarray(jax.jit(kernel)(g)), np.asarray(jax.jit(ref)(g))
    assert np.all(np.isfinite(got))
    # GLU products scale the sigmoid's absolute float32 error by |gate| * |up| (up to ~200 here)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-4 if act.is_glu else 2e-6)


def test_activation_objects_are_static_values():
  """Activations are frozen and compare by value: two equal ones give one jit trace."""
  assert acts.clamped_swiglu() == acts.ACTIVATIONS["clamped_swiglu"]
  assert hash(acts.clamped_swiglu(1.5, 5.0)) == hash(acts.clamped_swiglu(1.5, 5.0))
  assert acts.get_activation(acts.clamped_swiglu(1.5, 5.0)).limit == 5.0
  with pytest.raises(ValueError, match="limit"):
    acts.Activation("x", "silu", is_glu=True, limit=-1.0)
  with pytest.raises(ValueError, match="alpha"):
    acts.Activation("x", "relu", is_glu=True, alpha=2.0)
  with pytest.raises(ValueError, match="GLU"):
    acts.Activation("x", "silu", is_glu=False, up_offset=1.0)


def test_clamped_swiglu_matches_gpt_oss():
  """gpt-oss's formula as transformers writes it, values and gradients (the clamps' gradients
  are zero where they are active)."""
  # off the clamps' bounds: at a bound jnp.minimum splits the gradient, torch.clamp passes it
  gate = jnp.linspace(-12.0, 12.0, 97) + 0.01
  up = jnp.linspace(9.0, -9.0, 97) + 0.01
  def hf(gate, up):
    gate = jnp.minimum(gate, 7.0)
    up = jnp.clip(up, -7.0, 7.0)
    return gate * jax.nn.sigmoid(gate * 1.702) * (up + 1)
  act = acts.ACTIVATIONS["clamped_swiglu"]
  d_a = jnp.cos(gate)
  a, vjp = jax.vjp(hf, gate, up)
  a2, d_gate, d_up = act.glu_backward(gate, up, d_a)
  np.testing.assert_allclose(a2, a, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(act.glu(gate, up), a, rtol=1e-6, atol=1e-6)
  want_gate, want_up = vjp(d_a)
  np.testing.assert_allclose(d_gate, want_gate, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(d_up, want_up, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(d_up)[np.abs(np.asarray(up)) > 7] == 0)


def test_gate_up_split_and_merge_are_inverse(rng):
  h = jnp.asarray(rng.standard_normal((3, 10)))
  for layout in acts.GATE_UP_LAYOUTS:
    np.testing.assert_array_equal(acts.merge_gate_up(*acts.split_gate_up(h, layout), layout), h)
  g, u = acts.split_gate_up(jnp.arange(6.0)[None], "interleaved")
  np.testing.assert_array_equal(g, [[0, 2, 4]])
  np.testing.assert_array_equal(u, [[1, 3, 5]])


def test_converted_weights_give_the_same_layer(rng):
  """w1 and b1 permuted from concat to interleaved (and back) give the same layer output."""
  import sonic_jax
  from cases import make_problem
  p, _ = make_problem(rng, T=40, d=32, n=16, E=4, K=2, bias=True)
  p = {k: None if v is None else jnp.asarray(v, jnp.float32) for k, v in p.items()}
  to_int = lambda w: sonic_jax.convert_gate_up_layout(w, "concat", "interleaved")
  run = lambda w1, b1, layout: sonic_jax.moe(
      p["x"], p["router_weight"], w1, p["w2"], b1=b1, b2=p["b2"], top_k=2,
      gate_up_layout=layout, backend="xla")[0]
  y = run(p["w1"], p["b1"], "concat")
  w1_int, b1_int = to_int(p["w1"]), to_int(p["b1"])
  assert not np.array_equal(w1_int, p["w1"])
  np.testing.assert_allclose(run(w1_int, b1_int, "interleaved"), y, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(
      sonic_jax.convert_gate_up_layout(w1_int, "interleaved", "concat"), p["w1"])
  np.testing.assert_array_equal(w1_int[..., 0::2], p["w1"][..., :16])  # gate columns
  with pytest.raises(ValueError, match="target"):
    sonic_jax.convert_gate_up_layout(p["w1"], "concat", "blocked")
  with pytest.raises(ValueError, match="even last dimension"):
    sonic_jax.convert_gate_up_layout(jnp.zeros((2, 5)), "concat", "interleaved")


def test_unknown_activation_and_layout():
  with pytest.raises(ValueError, match="activation"):
    acts.get_activation("tanh")
  with pytest.raises(ValueError, match="gate_up_layout"):
    acts.split_gate_up(jnp.zeros((2, 4)), "blocked")


def test_activation_fields_are_checked_python_values():
  """Python values only (hashable as a static argument; an int limit names the float's
  activation), each field refused by name."""
  act = Activation("a", "silu", np.bool_(True), alpha=np.float32(1.5), limit=7, up_offset=1)
  assert (type(act.is_glu), type(act.alpha), act.limit, act.up_offset) == (bool, float, 7.0, 1.0)
  assert hash(act) == hash(Activation("a", "silu", True, 1.5, 7.0, 1.0))
  with pytest.raises(TypeError, match="Activation.is_glu must be a bool"):
    Activation("a", "silu", "no")
  with pytest.raises(TypeError, match="Activation.alpha must be a real number"):
    Activation("a", "silu", True, alpha=jnp.float32(1.5))
  with pytest.raises(ValueError, match="Activation.limit must be finite"):
    Activation("a", "silu", True, limit=float("inf"))
  assert acts.clamped_swiglu(1.5, 5) == acts.clamped_swiglu(1.5, 5.0)
  assert acts.clamped_swiglu(limit=None).limit is None  # no clamp, as Activation allows
  for kwargs in (dict(alpha="a"), dict(alpha=True), dict(up_offset=None)):
    with pytest.raises(TypeError, match="Activation.(alpha|up_offset) must be a real number"):
      acts.clamped_swiglu(**kwargs)
  with pytest.raises(TypeError, match="w must be an array"):
    acts.convert_gate_up_layout([1.0, 2.0], "concat", "interleaved")
