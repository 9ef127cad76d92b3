"""Run in a fresh process with 8 CPU devices (see test_parallel.py): `moe_all_to_all` with a
capacity that drops pairs, against a float64 oracle of the layer without exactly
the pairs that a NumPy model of the exchange drops; `moe_all_gather` with a capacity against
`sonic_jax.moe` with the same capacity on the concatenated tokens; the all-to-all scheme inside
`lax.scan` + `jax.checkpoint` on a (data, ep) = (2, 4) mesh, against one device."""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sonic_jax  # noqa: E402
import oracle  # noqa: E402
from sonic_jax.parallel import moe_all_gather, moe_all_to_all, slot_capacity  # noqa: E402

T, d, n, E, K = 64, 32, 16, 8, 2


# A result with a NaN or an infinity is infinitely far off: a NaN error would pass `max(errs) <`.
rel = oracle.rel_err


def inputs(seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((T, d))
  rw = rng.standard_normal((d, E)) / np.sqrt(d)
  x[:, 0] = 3.0
  rw[0, 0], rw[0, 5:] = 4.0, -4.0  # expert 0 (device 0) takes most tokens, 5..7 none
  w1 = rng.standard_normal((E, d, 2 * n)) / np.sqrt(d)
  w2 = rng.standard_normal((E, n, d)) / np.sqrt(n)
  b1 = rng.standard_normal((E, 2 * n)) * 0.1
  return x, rw, w1, w2, b1, rng.standard_normal((T, d))


def dropped_by_model(ids, p, slot_rows):
  """(T, E) bool: the pairs that the exchange drops, from the rule 'a sender's slot for device j
  takes its pairs for j's experts in expert order (stable in pair order), the first slot_rows'."""
  t_local, e_local = T // p, E // p
  dropped = np.zeros((T, E), bool)
  for i in range(p):
    pairs = [(t, e) for t in range(i * t_local, (i + 1) * t_local) for e in ids[t]]  # t*K + s
    for j in range(p):
      mine = sorted((q for q in pairs if j * e_local <= q[1] < (j + 1) * e_local),
                    key=lambda q: q[1])  # stable: pair order within an expert
      for rank, (t, e) in enumerate(mine):
        dropped[t, e] = rank >= slot_rows
  return dropped


def check_capacity(p=4, factor=0.75):
  x, rw, w1, w2, b1, d_y = inputs(0)
  args = [jnp.asarray(a) for a in (x, rw, w1, w2, b1)]
  ids = oracle.select_experts(x, rw, K)
  slot_rows = slot_capacity(T // p, K, 0, p, E // p, factor)
  dropped = dropped_by_model(ids, p, slot_rows)
  tc = np.zeros((T, E), bool)
  np.put_along_axis(tc, ids, True, axis=1)
  assert 0 < dropped.sum() < tc.sum()
  y_ref, g_ref = oracle.reference_values_and_grads_masks(
      dict(x=x, router_weight=rw, w1=w1, w2=w2, b1=b1), d_y, tc, tc & ~dropped,
      np.zeros_like(tc), compiled=True, activation="swiglu", gate_up_layout="concat")

  mesh = jax.make_mesh((p,), ("ep",), devices=jax.devices()[:p])
  specs = (P("ep"), P(), P("ep"), P("ep"), P("ep"))

  def local(x, rw, w1, w2, b1):
    y, aux = moe_all_to_all(x, rw, w1, w2, b1=b1, axis_name="ep", top_k=K,
                            capacity_factor=factor, backend="xla")
    return y, aux.dropped_pairs, aux.expert_ids, aux.scores

  sharded = jax.shard_map(local, mesh=mesh, in_specs=specs,
                          out_specs=(P("ep"), P(), P("ep"), P("ep")), check_vma=False)

  def loss(*a):
    y, n_dropped, kept_ids, kept_scores = sharded(*a)
    return jnp.vdot(y, jnp.asarray(d_y)), (y, n_dropped, kept_ids, kept_scores)

  placed = [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  (_, (y, n_dropped, kept_ids, kept_scores)), g = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*placed)
  errs = [rel(y, y_ref)] + [rel(a, g_ref[k]) for a, k in zip(g, ("x", "router_weight", "w1",
                                                                   "w2", "b1"))]
  print("capacity", int(n_dropped), int(dropped.sum()), ["%.1e" % e for e in errs])
  assert int(n_dropped) == int(dropped.sum())
  # The aux marks exactly the dropped pairs, as `moe` marks its capacity's.
  lost = np.take_along_axis(dropped, ids, axis=1)
  np.testing.assert_array_equal(np.asarray(kept_ids), np.where(lost, -1, ids))
  assert not np.any(np.asarray(kept_scores)[lost]) and np.all(np.asarray(kept_scores)[~lost] > 0)
  assert max(errs) < 1e-10, errs


def check_all_gather_capacity(routing, p=4, factor=0.75):
  """The all-gather scheme drops as `moe` does on the axis's tokens: output, every gradient, the
  dropped count and the aux's marks (ids -1, scores 0) equal one device's; Llama 4's router scales
  the inputs (one pseudo-token per pair, `ops.scaled_inputs`)."""
  x, rw, w1, w2, b1, d_y = inputs(1)
  args = [jnp.asarray(a) for a in (x, rw, w1, w2, b1)]
  kw = dict(top_k=K, routing=routing, capacity_factor=factor, backend="xla")

  def loss_of(run):  # run: (y, (dropped count, kept ids, their weights))
    def loss(*a):
      y, marks = run(*a)
      return jnp.vdot(y, jnp.asarray(d_y)), (y, *marks)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))

  def single(x, rw, w1, w2, b1):
    y, aux = sonic_jax.moe(x, rw, w1, w2, b1=b1, **kw)
    return y, (aux.dropped_pairs, aux.expert_ids, aux.scores)

  (_, ref), g_ref = loss_of(single)(*args)
  mesh = jax.make_mesh((p,), ("ep",), devices=jax.devices()[:p])
  specs = (P("ep"), P(), P("ep"), P("ep"), P("ep"))

  def local(x, rw, w1, w2, b1):
    y, aux = moe_all_gather(x, rw, w1, w2, b1=b1, axis_name="ep", **kw)
    # The per-token fields cover the axis's tokens (varying in shard_map's types): this device's
    # rows; the dropped count is replicated.
    mine = lambda a: jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index("ep") * x.shape[0],
                                                  x.shape[0])
    return y, (aux.dropped_pairs, mine(aux.expert_ids), mine(aux.scores))

  # Under shard_map's type check (check_vma), as a user calls it.
  sharded = jax.shard_map(local, mesh=mesh, in_specs=specs,
                          out_specs=(P("ep"), (P(), P("ep"), P("ep"))))
  placed = [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  (_, out), g = loss_of(sharded)(*placed)
  errs = [rel(out[0], ref[0])] + [rel(a, b) for a, b in zip(g, g_ref)]
  print("all_gather capacity", routing, int(out[1]), ["%.1e" % e for e in errs])
  assert 0 < int(ref[1]) < T * K and int(out[1]) == int(ref[1])
  np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(ref[2]))
  np.testing.assert_allclose(np.asarray(out[3]), np.asarray(ref[3]), rtol=1e-12, atol=0)
  assert max(errs) < 1e-10, errs


def check_scan_checkpoint_data_and_expert_parallel():
  """Two layers in a `lax.scan` under `jax.checkpoint`, all-to-all inside, on a (data, ep) =
  (2, 4) mesh, tokens over both axes: equals one device (one program for both features)."""
  x, rw, w1, w2, b1, d_y = inputs(2)
  stack = lambda a: jnp.stack([a, 0.5 * a])  # two layers' weights, (L, ...)
  args = [jnp.asarray(x)] + [stack(jnp.asarray(a)) for a in (rw, w1, w2, b1)]

  def layers(layer):
    def run(x, rws, w1s, w2s, b1s):
      body = jax.checkpoint(lambda h, ws: (h + layer(h, *ws), None))
      return jax.lax.scan(body, x, (rws, w1s, w2s, b1s))[0]
    return run

  def loss_of(run):
    def loss(*a):
      y = run(*a)
      return jnp.vdot(y, jnp.asarray(d_y)), y
    return loss

  single = layers(lambda h, rw, w1, w2, b1: sonic_jax.moe(h, rw, w1, w2, b1=b1, top_k=K,
                                                          backend="xla")[0])
  (_, y_ref), g_ref = jax.jit(jax.value_and_grad(loss_of(single), argnums=(0, 1, 2, 3, 4),
                                                 has_aux=True))(*args)
  mesh = jax.make_mesh((2, 4), ("data", "ep"))
  tokens, experts = P(("data", "ep")), P(None, "ep")
  specs = (tokens, P(), experts, experts, experts)
  sharded = jax.shard_map(
      layers(lambda h, rw, w1, w2, b1: moe_all_to_all(h, rw, w1, w2, b1=b1, axis_name="ep",
                                                      top_k=K, backend="xla")[0]),
      mesh=mesh, in_specs=specs, out_specs=tokens, check_vma=False)
  placed = [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  (_, y), g = jax.jit(jax.value_and_grad(loss_of(sharded), argnums=(0, 1, 2, 3, 4),
                                         has_aux=True))(*placed)
  errs = [rel(y, y_ref)] + [rel(a, b) for a, b in zip(g, g_ref)]
  print("scan x checkpoint, data x ep", ["%.1e" % e for e in errs])
  assert max(errs) < 1e-10, errs


def check_bad_arguments():
  """Mistakes a user makes get errors naming what to change."""
  x, rw, w1, w2, _, _ = inputs(3)
  args = [jnp.asarray(a) for a in (x, rw, w1, w2)]
  mesh = jax.make_mesh((4,), ("ep",), devices=jax.devices()[:4])

  def expect(error, match, call, specs=(P("ep"), P(), P("ep"), P("ep")), **kw):
    run = lambda *a: call(*a, axis_name="ep", top_k=K, backend="xla", **kw)[0]
    placed = [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    try:
      jax.jit(jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=P("ep")))(*placed)
    except error as e:
      assert match in str(e), (match, str(e))
    else:
      raise AssertionError(f"no {error.__name__} for {match!r}")

  try:  # outside shard_map: the axis is unbound
    moe_all_to_all(*args, axis_name="ep", top_k=K)
    raise AssertionError("no error outside shard_map")
  except ValueError as e:
    assert "call the op inside jax.shard_map" in str(e), e
  expect(ValueError, "shard them over 'ep'", moe_all_gather, specs=(P("ep"), P(), P(), P()))
  expect(ValueError, "router_weight is split over ['ep']: it must be replicated", moe_all_to_all,
         specs=(P("ep"), P(None, "ep"), P("ep"), P("ep")))
  expect(ValueError, "exclude each other", moe_all_to_all, capacity_factor=1.0,
         token_rounding="up")
  expect(ValueError, "capacity_factor must be finite", moe_all_to_all,
         capacity_factor=float("inf"))
  expect(TypeError, "capacity_factor", moe_all_to_all, capacity_factor=True)
  # Replicated weights of E = 6 experts on 4 devices: the error says 6 does not split over them
  run6 = lambda x, rw, w1, w2: moe_all_gather(x, rw, w1, w2, axis_name="ep", top_k=K,
                                              backend="xla")[0]
  try:
    six = [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(
        (args[0], args[1][:, :6], args[2][:6], args[3][:6]), (P("ep"), P(), P(), P()))]
    jax.jit(jax.shard_map(run6, mesh=mesh, in_specs=(P("ep"), P(), P(), P()),
                          out_specs=P("ep")))(*six)
  except ValueError as e:
    assert "E = 6 does not split over the 4 devices" in str(e), e
  else:
    raise AssertionError("no error for E = 6 over 4 devices")
  # w1's rank is checked before its first dim is read as the local expert count (here d)
  expect(ValueError, "w1 must have shape (E_local, d, 2n or n)",
         lambda x, rw, w1, w2, **kw: moe_all_gather(x, rw, w1[0], w2, **kw))
  # Experts split over another axis of a (data, ep) mesh: each device's count fits E = P x E_local,
  # but every "ep" device would hold the same experts.
  mesh2 = jax.make_mesh((2, 2), ("data", "ep"), devices=jax.devices()[:4])
  specs = (P(("data", "ep")), P(), P("data"), P("data"))
  placed = [jax.device_put(a, jax.NamedSharding(mesh2, s)) for a, s in zip(args, specs)]
  for call in (moe_all_gather, moe_all_to_all):
    run = lambda *a, call=call: call(*a, axis_name="ep", top_k=K, backend="xla")[0]
    try:
      jax.jit(jax.shard_map(run, mesh=mesh2, in_specs=specs, out_specs=specs[0]))(*placed)
    except ValueError as e:
      assert "must be split over 'ep'" in str(e), e
    else:
      raise AssertionError("no error for experts split over 'data' only")
  print("bad arguments refused")


if __name__ == "__main__":
  check_bad_arguments()
  check_capacity()
  check_all_gather_capacity("softmax_topk")
  check_all_gather_capacity(sonic_jax.Router("sigmoid", renormalize=False, scale_input=True))
  check_scan_checkpoint_data_and_expert_parallel()
  print("OK")
