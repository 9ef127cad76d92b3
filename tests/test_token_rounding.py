"""Token rounding: its invariants, the selection against a NumPy model of SonicMoE's algorithm, the
layer's output and every gradient against the float64 oracle, router gradients against finite
differences, and the Flax layer's train/eval switch."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import sonic_jax
from sonic_jax import routing as routing_lib
from sonic_jax.layers import MoE
from cases import make_problem
from oracle import reference_values_and_grads_masks, rel_err, token_rounding_reference
from test_moe import ARG_NAMES, run_moe

MODES = list(routing_lib.TOKEN_ROUNDINGS)
TILE = sonic_jax.backends.resolve_backend("xla").row_tile  # 32 on the CPU
# Jitted: each eager op would compile a program of its own for every shape.
route = jax.jit(routing_lib.route, static_argnums=(1, 2))
round_tokens = jax.jit(routing_lib.round_tokens, static_argnums=(1, 2, 3))
moe = jax.jit(sonic_jax.moe, static_argnames=("top_k", "routing", "token_rounding", "backend"))


def pair_masks(aux, t_count, e_count):
  """(T, E) masks of the kept slot pairs and of the added pairs, from the op's aux."""
  ids = np.asarray(aux.expert_ids)
  kept = np.zeros((t_count, e_count), bool)
  rows, slots = np.nonzero(ids >= 0)
  kept[rows, ids[rows, slots]] = True
  added = np.zeros_like(kept)
  tok, exp = np.asarray(aux.extra_tokens), np.asarray(aux.extra_experts)
  used = tok < t_count
  assert np.all(used == (exp < e_count))
  assert not np.any(kept[tok[used], exp[used]]), "a pair is both a slot and an extra"
  np.add.at(added, (tok[used], exp[used]), True)
  assert len(set(zip(tok[used], exp[used]))) == used.sum(), "an extra pair appears twice"
  return kept, added


@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_token_rounding_invariants_and_selection(rng, mode, skew):
  # Skewed with K = 1: most tokens pick expert 0, the others' small counts round down to zero.
  T, E, K = 600, 8, (1 if skew else 2)
  p, _ = make_problem(rng, T=T, d=32, n=16, E=E, K=K, skew=skew)
  x, rw = (jnp.asarray(p[k], jnp.float32) for k in ("x", "router_weight"))
  y, aux = moe(x, rw, jnp.asarray(p["w1"], jnp.float32), jnp.asarray(p["w2"], jnp.float32),
               top_k=K, routing="topk_softmax", token_rounding=mode, backend="xla")
  probs = np.asarray(jax.nn.softmax(aux.router_logits, axis=-1), np.float64)
  tc, kept_ref, added_ref = token_rounding_reference(probs, K, TILE, mode)
  kept, added = pair_masks(aux, T, E)
  # The same pairs as SonicMoE's algorithm.
  np.testing.assert_array_equal(kept, kept_ref)
  np.testing.assert_array_equal(added, added_ref)
  # Every expert's count is a multiple of the tile, moved by less than one tile in the mode's
  # direction; the layout has no padding rows left.
  before, after = tc.sum(0), (kept | added).sum(0)
  np.testing.assert_array_equal(np.asarray(aux.expert_counts), after)
  assert np.all((after % TILE == 0) | (after == T)), after  # rounding up is capped at T
  assert np.all(np.abs(after - before) < TILE)
  if mode == "down":
    assert np.all(after <= before) and not added.any()
  if mode == "up":
    assert np.all(after >= before) and np.all(kept == tc)
  assert int(aux.padded_rows) == np.sum(-after % TILE)  # 0 unless capped at T
  # Kept pairs keep their renormalised TC score, added pairs get their raw probability.
  top = np.where(tc, probs, 0.0)
  renorm = top / top.sum(-1, keepdims=True)
  ids, scores = np.asarray(aux.expert_ids), np.asarray(aux.scores)
  for t, s in zip(*np.nonzero(ids >= 0)):
    np.testing.assert_allclose(scores[t, s], renorm[t, ids[t, s]], rtol=1e-5)
  assert np.all(scores[ids < 0] == 0)
  ok = np.asarray(aux.extra_tokens) < T
  tok, exp = np.asarray(aux.extra_tokens)[ok], np.asarray(aux.extra_experts)[ok]
  np.testing.assert_allclose(np.asarray(aux.extra_scores)[ok], probs[tok, exp], rtol=1e-5)
  # Extras come grouped by expert, J entries each, tokens increasing, then unused entries.
  grid = np.asarray(aux.extra_tokens).reshape(E, -1)
  in_use = grid < T
  assert np.all(in_use[:, :-1] >= in_use[:, 1:]), "an expert's extras come before unused entries"
  for row, u in zip(grid, in_use):
    assert np.all(np.diff(row[u]) > 0), "an expert's extras are in token order"
  owners = np.broadcast_to(np.arange(E)[:, None], grid.shape)
  np.testing.assert_array_equal(np.asarray(aux.extra_experts).reshape(grid.shape),
                                np.where(grid < T, owners, E))
  # Tokens left with no expert give exactly zero output.
  nowhere = ~(kept | added).any(1)
  if mode == "down" and skew:
    assert nowhere.any(), "the skewed case should drop some token entirely"
  assert np.all(np.asarray(y)[nowhere] == 0)


# float32 compiled optimized: unoptimized XLA:CPU sums its router gradient past 2e-5 of the
# oracle (2.4e-5 with skewed routing rounded up); bfloat16's 2e-2 leaves room for either. Each
# mode in float32, "nearest" and "up" in bfloat16 too (the selection itself is the same code in
# both: test_token_rounding_invariants_and_selection checks it per mode).
_F32 = pytest.mark.xla_optimized


@pytest.mark.parametrize("mode,activation,bias,skew,dtype", [
    pytest.param("up", "swiglu", False, False, jnp.float32, marks=_F32),
    pytest.param("nearest", "gelu", True, True, jnp.float32, marks=_F32),
    pytest.param("down", "geglu", True, False, jnp.float32, marks=_F32),
    ("nearest", "gelu", True, True, jnp.bfloat16),
    ("up", "relu_sq", False, True, jnp.bfloat16),
])
def test_token_rounding_layer_against_oracle(rng, mode, activation, bias, skew, dtype):
  T, E, K = 200, 8, 2
  p, d_y = make_problem(rng, T=T, d=32, n=16, E=E, K=K, activation=activation, bias=bias,
                        skew=skew)
  y, aux, grads, cast = run_moe(p, d_y, dtype, top_k=K, activation=activation,
                                routing="softmax_topk", token_rounding=mode, backend="xla")
  seen = {k: None if v is None else np.asarray(v.astype(jnp.float32), np.float64)
          for k, v in cast.items()}
  probs = np.asarray(jax.nn.softmax(aux.router_logits, axis=-1), np.float64)
  tc, kept, added = token_rounding_reference(probs, K, TILE, mode)
  np.testing.assert_array_equal((kept, added), pair_masks(aux, T, E))
  y_ref, g_ref = reference_values_and_grads_masks(seen, d_y, tc, kept, added,
                                                  activation=activation, gate_up_layout="concat")
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  errs = {"y": rel_err(y, y_ref), **{k: rel_err(grads[k], g_ref[k]) for k in grads}}
  assert all(v < tol for v in errs.values()), errs
  assert set(errs) == {"y", *[k for k in ARG_NAMES if p[k] is not None]}


def test_token_rounding_router_gradient_finite_differences(rng):
  from jax.test_util import check_grads
  T, E, K = 96, 4, 2
  p, d_y = make_problem(rng, T=T, d=16, n=8, E=E, K=K)
  with jax.enable_x64(True):
    a = {k: jnp.asarray(v) for k, v in p.items() if v is not None}
    dy = jnp.asarray(d_y)

    @jax.jit  # one program for the perturbed points, one for the VJP: no per-op compiles
    def f(x, rw):
      y, aux = sonic_jax.moe(x, rw, a["w1"], a["w2"], top_k=K, token_rounding="up",
                             backend="xla")
      assert aux.extra_tokens.shape[0] > 0
      return jnp.vdot(y, dy)

    # The selection is piecewise constant, so finite differences see only the scores' gradient.
    check_grads(f, (a["x"], a["router_weight"]), order=1, modes=["rev"], eps=1e-6, atol=1e-6,
                rtol=1e-6)


def test_token_rounding_static_shapes_under_jit(rng):
  # The program of test_token_rounding_invariants_and_selection[nearest-False]: compiled once.
  T, E, K = 600, 8, 2
  shapes, cache_sizes = set(), set()
  for _ in range(3):  # fresh routings, one compilation
    p, _ = make_problem(rng, T=T, d=32, n=16, E=E, K=K)
    _, aux = moe(*(jnp.asarray(p[k], jnp.float32) for k in ("x", "router_weight", "w1", "w2")),
                 top_k=K, routing="topk_softmax", token_rounding="nearest", backend="xla")
    shapes.add(aux.extra_tokens.shape)
    cache_sizes.add(moe._cache_size())
  assert len(cache_sizes) == 1
  assert shapes == {(E * (TILE // 2),)}


def test_token_rounding_bad_arguments():
  # Traced only (the refusals need no values): no program is compiled.
  args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((8, 16), (16, 4), (4, 16, 16), (4, 8, 16))]
  with pytest.raises(ValueError, match="token_rounding must be"):
    jax.eval_shape(lambda *a: sonic_jax.moe(*a, top_k=2, token_rounding="sideways",
                                            backend="xla"), *args)
  with pytest.raises(ValueError, match="softmax router"):
    jax.eval_shape(lambda *a: sonic_jax.moe(*a, top_k=2, routing="sigmoid_topk",
                                            token_rounding="up", backend="xla"), *args)


def test_layer_rounds_in_training_and_uses_top_k_in_eval(rng):
  layer = MoE(32, 8, 16, 2, token_rounding="up", backend="xla",
                               init_std=0.2, rngs=nnx.Rngs(0))
  x = jnp.asarray(rng.standard_normal((4, 50, 32)), jnp.float32)
  # Under nnx.jit the mode is part of the layer's static graph: each mode is its own program.
  call = nnx.jit(lambda layer, x: layer(x))
  y_train, aux_train = call(layer, x)
  assert aux_train.stats.extra_tokens.shape[0] > 0
  assert np.all(np.asarray(aux_train.stats.expert_counts) % TILE == 0)
  layer.eval()
  y_eval, aux_eval = call(layer, x)
  assert aux_eval.stats.extra_tokens.shape == (0,)
  y_plain, _ = jax.jit(lambda *a: sonic_jax.moe(*a, top_k=2, backend="xla"))(
      x.reshape(-1, 32), layer.router[...], layer.w1[...], layer.w2[...])
  np.testing.assert_allclose(np.asarray(y_eval).reshape(-1, 32), np.asarray(y_plain), rtol=1e-6,
                             atol=1e-6)
  assert np.all(np.isfinite(np.asarray(y_train)))
  assert not np.allclose(np.asarray(y_train), np.asarray(y_eval))
  layer.train()
  assert call(layer, x)[1].stats.extra_tokens.shape[0] > 0


COMPILED = [pytest.param(False, id="interpret"),
            pytest.param(True, id="compiled", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("compiled", COMPILED)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("t,e,k,tile,ties", [
    (300, 8, 2, 32, False),   # T not a power of two
    (513, 16, 4, 32, True),   # many equal scores and probabilities: ties go to the lower token
    (100, 4, 1, 32, True),
    (64, 8, 8, 16, False),    # every token picks every expert: nothing to add
    (1, 4, 1, 32, False),     # one token
    (90, 1, 1, 32, False),    # one expert
])
def test_selection_kernel_equals_the_xla_selection(rng, compiled, mode, t, e, k, tile, ties):
  """`round_tokens`'s Pallas selection (`sonic_jax.pallas.rounding_select`) returns the same
  routing, bit for bit, as the XLA one (a sort and `lax.top_k`), which the NumPy model checks."""
  if compiled != (jax.default_backend() == "gpu"):
    pytest.skip("compiled on a GPU, interpreted elsewhere")
  if compiled:
    t *= 57
  logits = rng.normal(size=(t, e)).astype(np.float32)
  if ties:
    logits = np.round(logits * 2) / 2
  routed = route(jnp.asarray(logits), k, "softmax_topk")
  want = round_tokens(routed, tile, mode, "xla")
  got = round_tokens(routed, tile, mode, "kernel")
  for name, a, b in zip(want._fields, want, got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  if mode != "down" and e > 1 and k < e and t > 1:
    assert int(jnp.sum(got.extra_tokens < t)) > 0, "the case should add pairs"


@pytest.mark.gpu
@pytest.mark.parametrize("t", [40960, 61440, 65536])  # 80, 60 and 64 keys a thread
def test_selection_kernel_compiled_at_long_rows(rng, t):
  """The longest rows the kernel takes, compiled, give XLA's selection."""
  if jax.default_backend() != "gpu":
    pytest.skip("compiled on a GPU")
  logits = rng.normal(size=(t, 128)).astype(np.float32)
  routed = route(jnp.asarray(logits), 8, "softmax_topk")
  want = round_tokens(routed, 128, "nearest", "xla")
  got = round_tokens(routed, 128, "nearest", "kernel")
  for name, a, b in zip(want._fields, want, got):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("mode", ["down", "up"])  # "nearest": test_selection_kernel_default_pieces
def test_selection_kernel_over_several_chunks(rng, mode):
  """A row longer than the kernel's prefix-sum chunk (ties across chunk boundaries), padded to a
  multiple of the chunk that is not a power of two (5 chunks)."""
  from sonic_jax.pallas import rounding_select
  t, e, k, tile = 300, 8, 2, 32
  logits = np.round(rng.normal(size=(t, e)) * 2).astype(np.float32) / 2
  routed = route(jnp.asarray(logits), k, "softmax_topk")
  per_expert = routing_lib.extra_pairs_per_expert(mode, tile, t)

  @jax.jit
  def whole_and_chunked(routed):
    keys = lambda chunk: rounding_select.selection_keys(
        routed.probs, routed.expert_ids, routed.scores, rounding_select.padded_tokens(t, chunk))
    assert keys(64).shape == (e, 320) and keys(rounding_select.CHUNK).shape == (e, 512)
    select = lambda chunk: rounding_select.select(
        keys(chunk), num_tokens=t, tile=tile, mode=mode, added_per_expert=per_expert,
        interpret=True, chunk=chunk)
    return select(rounding_select.CHUNK), select(64)

  whole, chunked = whole_and_chunked(routed)
  want = round_tokens(routed, tile, mode, "xla")
  for a, b in zip(whole, chunked):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if per_expert:
    np.testing.assert_array_equal(np.asarray(chunked[1]).reshape(-1), np.asarray(want.extra_tokens))


def test_selection_kernel_default_pieces(rng):
  """`round_tokens`'s own call, interpreted, on rows the default split cuts in several pieces
  (12,288 and 20,480 tokens: 3 and 5 pieces of 4,096 keys, no padding), with many ties."""
  from sonic_jax.pallas import rounding_select
  for t, mode in ((12288, "up"), (20480, "nearest")):  # 3 and 5 pieces
    assert rounding_select.row_chunk(t) == 4096 and rounding_select.padded_tokens(t) == t
    logits = np.round(rng.normal(size=(t, 2)) * 2).astype(np.float32) / 2
    routed = route(jnp.asarray(logits), 1, "softmax_topk")
    want = round_tokens(routed, 128, mode, "xla")
    got = round_tokens(routed, 128, mode, "kernel")
    for name, a, b in zip(want._fields, want, got):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{mode} {name}")


@pytest.mark.parametrize("a,b,second", [(-0.0, 0.0, 1), (0.0, 1e-40, 2)])
def test_selection_ranks_signed_zeros_and_subnormals_alike(a, b, second):
  """-0.0 ties with 0.0 and a subnormal probability ranks above 0 in both selections, also where
  XLA flushes subnormals (a CPU): each token added by "up" is the NumPy model's."""
  probs = jnp.asarray([[0.5, 0.5], [1.0, a], [1.0, b], [0.75, 0.25]], jnp.float32)
  routed = routing_lib.RouterOutput(scores=jnp.asarray([[0.5], [1.0], [1.0], [0.75]], jnp.float32),
                                    expert_ids=jnp.asarray([[1], [0], [0], [0]], jnp.int32),
                                    probs=probs)
  # Expert 1 has one TC token (0) and rounds up to 3: it adds token 3 (0.25), then the first of
  # tokens 1 and 2 when their probabilities tie (-0.0 and 0.0), else the larger (1e-40 > 0).
  want = [3, second]
  for method in ("xla", "kernel"):
    got = round_tokens(routed, 3, "up", method)
    added = np.asarray(got.extra_tokens)[np.asarray(got.extra_experts) == 1]
    assert sorted(added.tolist()) == sorted(want), (method, added)


def test_a_nan_token_ranks_last_and_stays_in_its_experts(rng):
  """A token whose probabilities and scores are NaN (a NaN in its row of x) ranks last in both
  selections, as one whose are 0 would where no other is: not added while other tokens are left,
  its TC pairs the first to drop. Through `moe` rounding up, its NaN reaches the weight gradients
  of its own experts only."""

  def selected(logits, k, modes):
    routed = route(jnp.asarray(logits, jnp.float32), k, "softmax_topk")
    as_row = lambda value: routed._replace(probs=routed.probs.at[3].set(value),
                                           scores=routed.scores.at[3].set(value))
    for mode in modes:
      want = round_tokens(as_row(0.0), TILE, mode, "xla")
      for method in ("xla", "kernel"):
        got = round_tokens(as_row(jnp.nan), TILE, mode, method)
        for name in ("expert_ids", "extra_tokens", "extra_experts"):
          np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                        np.asarray(getattr(want, name)), err_msg=(mode, name))
    return got

  # Adding: 64 tokens, K = 2 of 8 experts, every expert short of its tile.
  t, e, k = 64, 8, 2
  got = selected(rng.normal(size=(t, e)), k, ["up"])
  assert 3 not in np.asarray(got.extra_tokens)
  # Dropping part of a TC set: 39 tokens (token 3 among them) choose expert 0 and 41 expert 1;
  # rounding down or to nearest keeps 32 of each, token 3's pair first out.
  logits = 0.1 * rng.normal(size=(80, 2)) + np.where(np.arange(80)[:, None] < 39, [2, 0], [0, 2])
  for mode in ("down", "nearest"):
    ids = np.asarray(selected(logits, 1, [mode]).expert_ids[:, 0])
    assert ids[3] == -1 and np.sum(ids[:39] == 0) == 32, (mode, ids)
  p, _ = make_problem(rng, t, 32, 16, e, k)
  x, rw, w1, w2 = (jnp.asarray(p[name], jnp.float32) for name in ARG_NAMES[:4])
  x = x.at[3, 5].set(jnp.nan)
  others = (jnp.arange(t) != 3)[:, None]

  def loss(w1):  # the other tokens' outputs
    y, aux = sonic_jax.moe(x, rw, w1, w2, top_k=k, token_rounding="up", backend="xla")
    return jnp.sum(jnp.where(others, y, 0) ** 2), aux

  dw1, aux = jax.jit(jax.grad(loss, has_aux=True))(w1)
  ids = np.asarray(aux.expert_ids[3])
  assert 3 not in np.asarray(aux.extra_tokens)
  assert set(np.flatnonzero(np.isnan(dw1).any(axis=(1, 2)))) == set(ids[ids >= 0])


def test_selection_target_rounds_half_to_even():
  from sonic_jax.pallas import rounding_select
  counts = jnp.arange(0, 400, dtype=jnp.int32)
  for mode, want in (("down", np.floor), ("up", np.ceil), ("nearest", np.round)):
    got = rounding_select.target_count(counts, 32, mode, 390)
    np.testing.assert_array_equal(np.asarray(got),
                                  np.minimum(want(np.arange(400) / 32) * 32, 390).astype(int))


def test_without_the_triton_lowering_the_kernel_paths_say_so(monkeypatch):
  """Where Pallas's Triton lowering is missing (`sonic_jax.pallas.TRITON_AVAILABLE`), asking for
  a Pallas kernel names why it cannot run, and "auto" takes the XLA paths."""
  from sonic_jax import layout
  from sonic_jax.pallas import layout_ranks, rounding_select, router_topk
  for module in (layout_ranks, rounding_select, router_topk):
    monkeypatch.setattr(module, "AVAILABLE", False)
  missing = "Triton lowering is not available"
  ids = jnp.zeros((8, 2), jnp.int32)
  with pytest.raises(ValueError, match=missing):
    layout.build_grouped_layout(ids, 4, 32, method="block_ranks")
  routed = routing_lib.route(jnp.zeros((8, 4)), 2, "softmax_topk")
  with pytest.raises(ValueError, match=missing):
    routing_lib.round_tokens(routed, 32, "nearest", "kernel")
  assert missing in routing_lib.fused_top_k_unsupported(
      jnp.zeros((8, 16), jnp.bfloat16), jnp.zeros((16, 4), jnp.bfloat16), 2, "softmax_topk",
      gpu_only=False)
  assert routing_lib.round_tokens(routed, 32, "nearest").expert_ids.shape == (8, 2)


def test_selection_kernel_refusals_and_lowering():
  from cases import export_for_h100
  from sonic_jax.pallas import rounding_select
  assert "T=70000" in rounding_select.supports(70000, 8, 4)
  with pytest.raises(ValueError, match="method must be one of"):
    routing_lib.round_tokens(routing_lib.route(jnp.zeros((4, 4)), 1, "softmax_topk"), 32, "up",
                             "sorting")
  keys = jnp.zeros((4, 8), jnp.int32)
  with pytest.raises(ValueError, match="added_per_expert=3 is below"):
    rounding_select.select(keys, num_tokens=8, tile=32, mode="nearest", added_per_expert=3,
                           interpret=True)
  with pytest.raises(ValueError, match="chunk must be a power of two of at most 16384, got 32768"):
    rounding_select.select(keys, num_tokens=8, tile=32, mode="up", added_per_expert=8,
                           interpret=True, chunk=32768)
  with pytest.raises(ValueError, match="chunk must be a power of two"):
    rounding_select.select(keys, num_tokens=8, tile=32, mode="up", added_per_expert=8,
                           interpret=True, chunk=6)
  with pytest.raises(ValueError, match="warps must be a power of two"):
    rounding_select.select(keys, num_tokens=8, tile=32, mode="up", added_per_expert=8,
                           interpret=True, warps=12)
  assert [rounding_select.num_warps(t) for t in (64, 16384, 24576, 40960, 49152, 61440, 65536)] == [
      4, 8, 16, 16, 16, 32, 32]
  # The row's pieces pad T least: 40,960 keys as 5 pieces of 8,192, not 49,152 as 3 of 16,384.
  rows = (300, 12288, 16384, 24576, 40960, 49152, 65536)
  assert [rounding_select.row_chunk(t) for t in rows] == [
      512, 4096, 16384, 8192, 8192, 16384, 16384]
  assert [rounding_select.padded_tokens(t) for t in rows] == [512] + list(rows[1:])
  with pytest.raises(ValueError, match=r"keys must be \(E, 48\) for T=40 and chunk=16"):
    rounding_select.select(jnp.zeros((4, 64), jnp.int32), num_tokens=40, tile=32, mode="up",
                           added_per_expert=31, interpret=True, chunk=16)
  big = routing_lib.route(jnp.zeros((70000, 2)), 1, "softmax_topk")
  with pytest.raises(ValueError, match="T=70000"):
    routing_lib.round_tokens(big, 32, "up", "kernel")
  if jax.default_backend() != "gpu":  # the Triton kernel lowers for a GPU from this machine
    for t in (16384, 40960, 61440):  # one piece; five of 8,192; fifteen of 4,096
      module = export_for_h100(
          lambda keys: rounding_select.select(keys, num_tokens=t, tile=128, mode="nearest",
                                              added_per_expert=64),
          jax.ShapeDtypeStruct((256, rounding_select.padded_tokens(t)), jnp.int32))
      assert "xla.gpu.triton" in module



@pytest.mark.parametrize("mode,tokens,warns", [("nearest", 24, True), ("down", 48, True),
                                               ("nearest", 48, False), ("up", 8, False)])
def test_warns_where_most_experts_would_keep_no_pairs(mode, tokens, warns):
  """Rounding over fewer pairs per expert than it keeps (half a tile under "nearest", a tile
  under "down"; E = 4, K = 2, the CPU's 32-row tile) warns as the call is traced, naming the
  counts; "up" drops nothing and never warns."""
  x, rw = jnp.ones((tokens, 8)), jnp.ones((8, 4))
  w1, w2 = jnp.ones((4, 8, 16)), jnp.ones((4, 8, 8))
  call = lambda: jax.eval_shape(lambda x: sonic_jax.moe(x, rw, w1, w2, top_k=2,
                                                        token_rounding=mode, backend="xla"), x)
  if warns:
    with pytest.warns(routing_lib.RoundingWarning, match=f"over {tokens} tokens with K = 2"):
      call()
  else:
    with warnings.catch_warnings():
      warnings.simplefilter("error", routing_lib.RoundingWarning)
      call()
