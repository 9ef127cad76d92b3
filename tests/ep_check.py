"""Run in a fresh process with 8 CPU devices (see test_parallel.py): the expert-parallel op
against the single-device op, output and gradients, for 2 and 8 shards (and 1 with skewed top-K
routing); with token rounding or a family router (its own router input and a per-expert scale,
and DeepSeek-V4's with a fixed selection) for one count: 8, or 2 for the all-to-all rounding to
nearest; each command-line argument is one case."""

import functools
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)  # float64: compare to rounding, not to fusion order
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import oracle  # noqa: E402
import sonic_jax  # noqa: E402
from sonic_jax.parallel import moe_all_gather, moe_all_to_all  # noqa: E402

T, d, n, E, K = 64, 32, 16, 8, 2
SCHEMES = {"all_gather": moe_all_gather,
           "all_to_all": moe_all_to_all}
ROUTERS = {  # family routers: groups, a selection bias on the scores, scaling; input scaling
    "deepseek_v3": sonic_jax.Router("sigmoid", renorm_epsilon=1e-20, n_group=4, topk_group=2,
                                    group_score="top2_sum", routed_scaling_factor=2.5),
    "llama4": sonic_jax.Router("sigmoid", renormalize=False, scale_input=True),
    # with a fixed selection (its hash-routed layers) besides
    "deepseek_v4": sonic_jax.Router("sqrt_softplus", renorm_epsilon=1e-20,
                                    routed_scaling_factor=1.5)}


# A result with a NaN or an infinity is infinitely far off: a NaN error would pass `max(errs) <`.
rel = oracle.rel_err


def options(mode):
  """The op's keywords for a mode (a token rounding mode, a family router or None), and the names
  of the differentiated inputs past (x, rw, w1, w2, b1)."""
  router = ROUTERS.get(mode, "softmax_topk")
  rounding = None if mode in ROUTERS else mode
  names = ("router_input", "expert_scale") if mode in ROUTERS else ()
  return dict(top_k=K, routing=router, token_rounding=rounding, backend="xla"), names


def inputs(routing, mode):
  """(args, extra, fixed, dy): the differentiated inputs, the router and selection biases, the
  fixed selection (or None) and the output's cotangent."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((T, d))
  rw = rng.standard_normal((d, E)) / np.sqrt(d)
  if routing == "skew":
    x[:, 0] = 3.0
    rw[0, 0], rw[0, 5:] = 4.0, -4.0  # expert 0 takes most tokens, 5..7 none
  w1 = rng.standard_normal((E, d, 2 * n)) / np.sqrt(d)
  w2 = rng.standard_normal((E, n, d)) / np.sqrt(n)
  b1 = rng.standard_normal((E, 2 * n)) * 0.1
  dy = jnp.asarray(rng.standard_normal((T, d)))
  args = [jnp.asarray(a, jnp.float64) for a in (x, rw, w1, w2, b1)]
  # with a family router: a trainable router bias (gpt-oss) and a selection bias (DeepSeek-V3),
  # a router input of its own and a trained per-expert scale (Gemma 4), all differentiated
  extra, fixed = {}, None
  if mode in ROUTERS:
    extra = dict(router_bias=jnp.asarray(rng.standard_normal(E) * 0.1),
                 selection_bias=jnp.asarray(rng.standard_normal(E) * 0.01))
    args += [jnp.asarray(x + rng.standard_normal((T, d))), jnp.asarray(rng.uniform(0.5, 2, E))]
  if mode == "deepseek_v4":
    fixed = jnp.asarray(np.stack([rng.permutation(E)[:K] for _ in range(T)]), jnp.int32)
    extra.pop("selection_bias")  # a fixed selection takes none
  return args, extra, fixed, dy


# The programs are cached: the cases of a mode (each scheme's, random and skewed inputs alike)
# share the single-device program, and those of a scheme, mode and shard count the sharded one.
@functools.cache
def reference(mode):
  """The single-device op's loss and its gradients, with the output, compiled as the sharded runs
  are: eagerly a fresh process compiles each op on its own."""
  kw, names = options(mode)

  def loss_single(args, extra, fixed, dy):
    x, rw, w1, w2, b1, *more = args
    y, aux = sonic_jax.moe(x, rw, w1, w2, b1=b1, expert_ids=fixed, **kw, **extra,
                           **dict(zip(names, more)))
    if mode == "up":
      assert aux.extra_tokens.shape[0] > 0
    return jnp.vdot(y, dy) + aux.load_balance_loss + 0.1 * aux.z_loss, y

  # the router and selection biases (`extra`) differentiated too: the selection bias's gradient
  # is zero on both sides
  return jax.jit(jax.value_and_grad(loss_single, argnums=(0, 1), has_aux=True))


@functools.cache
def sharded(scheme_name, mode, shards):
  """The same through the scheme over `shards` devices, under shard_map's replication check."""
  kw, names = options(mode)
  scheme = SCHEMES[scheme_name]
  mesh = jax.make_mesh((shards,), ("ep",), devices=jax.devices()[:shards])
  specs = (P("ep"), P(), P("ep"), P("ep"), P("ep")) + (P("ep"), P())[:len(names)]

  def local(args, extra, fixed):
    x, rw, w1, w2, b1, *more = args
    mine = None if fixed is None else jax.lax.dynamic_slice_in_dim(
        fixed, jax.lax.axis_index("ep") * x.shape[0], x.shape[0])
    y, aux = scheme(x, rw, w1, w2, b1=b1, axis_name="ep", expert_ids=mine, **kw, **extra,
                    **dict(zip(names, more)))
    # all-to-all: the aux of this device's tokens; all-gather: of the whole axis's
    tokens = x.shape[0] * (shards if scheme_name == "all_gather" else 1)
    assert aux.dropped_pairs is not None and aux.probs.shape == (tokens, E), aux.probs.shape
    return y, aux.load_balance_loss + 0.1 * aux.z_loss

  # The losses come out replicated (out_specs P()); the biases and the whole fixed selection
  # come in replicated.
  mapped = jax.shard_map(local, mesh=mesh, in_specs=(list(specs), P(), P()),
                         out_specs=(P("ep"), P()))

  def loss_ep(args, extra, fixed, dy):
    y, lb = mapped(args, extra, fixed)
    return jnp.vdot(y, dy) + lb, y

  place = lambda args: [jax.device_put(a, jax.NamedSharding(mesh, s))
                        for a, s in zip(args, specs)]
  return jax.jit(jax.value_and_grad(loss_ep, argnums=(0, 1), has_aux=True)), place


def check(scheme_name, routing, mode=None):
  """One case: a scheme, "random" or "skew" routing, and a token rounding mode or a family
  router (or neither)."""
  args, extra, fixed, dy = inputs(routing, mode)
  (_, y_ref), g_ref = reference(mode)(args, extra, fixed, dy)
  # one shard (no exchange; the skewed top-K case takes it), a pair, all eight; a family
  # router's case and rounding up all eight alone (the exchange does not depend on the router);
  # rounding to nearest over a pair in the all-to-all, over all eight in the all-gather
  if mode is None:
    counts = (1, 2, 8) if routing == "skew" else (2, 8)
  else:
    counts = (2,) if mode == "nearest" and scheme_name == "all_to_all" else (8,)
  for shards in counts:
    run, place = sharded(scheme_name, mode, shards)
    (_, y), g = run(place(args), extra, fixed, dy)
    errs = [rel(y, y_ref)] + [rel(a, b) for a, b in zip(jax.tree.leaves(g),
                                                         jax.tree.leaves(g_ref))]
    print(scheme_name, routing, mode, shards, ["%.1e" % e for e in errs])
    assert max(errs) < 1e-10, (scheme_name, routing, mode, shards, errs)


def check_no_tokens(scheme_name):
  """T = 0 on every device: zeros, an empty routing and zero losses, as the single-device op
  gives, and gradients."""
  scheme = moe_all_gather if scheme_name == "all_gather" else moe_all_to_all
  d, n, E, K = 8, 4, 4, 2
  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
  specs = (P("ep"), P(), P("ep"), P("ep"))
  args = [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(
      (jnp.zeros((0, d)), jnp.ones((d, E)), jnp.ones((E, d, 2 * n)), jnp.ones((E, n, d))), specs)]

  def local(x, rw, w1, w2):
    y, aux = scheme(x, rw, w1, w2, axis_name="ep", top_k=K, backend="xla")
    assert aux.expert_ids.shape == (0, K) and aux.probs.shape == (0, E)
    return y, aux.load_balance_loss + aux.z_loss

  f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=(P("ep"), P()))
  (y, loss), grads = jax.jit(lambda *a: (f(*a), jax.grad(lambda *b: f(*b)[1], (0, 2))(*a)))(*args)
  assert y.shape == (0, d) and float(loss) == 0.0, (y.shape, loss)
  assert grads[0].shape == (0, d) and not np.any(np.asarray(grads[1])), grads
  print(scheme_name, "no tokens")


@functools.cache
def single_reference():
  """<y, dy> of the single-device op (top-K, no aux losses) and its gradients: the placements'
  reference, in float64 and in bfloat16 (jit specializes it per dtype)."""
  kw, _ = options(None)

  def loss(args, dy):
    x, rw, w1, w2, b1 = args
    return jnp.vdot(sonic_jax.moe(x, rw, w1, w2, b1=b1, **kw)[0], dy)

  return jax.jit(jax.value_and_grad(loss))


def check_given_selection_and_zero_width(scheme_name):
  """A given selection naming one expert twice for a token (the odd tokens' pairs [0, 0], E_local
  = 1 < K): every pair kept, the output and gradients the single device's (the all-to-all's
  dropless slots hold K pairs a token then, not min(K, E_local)); axis_name as a list. Then
  d = 0: the output (T_local, 0), as the single-device op gives, and its gradients' shapes."""
  scheme = SCHEMES[scheme_name]
  rng = np.random.default_rng(7)
  t, d, n, e = 8, 8, 4, 2
  args = [jnp.asarray(rng.standard_normal(shape)) for shape in
          ((t, d), (d, e), (e, d, 2 * n), (e, n, d))]
  ids = jnp.zeros((t, K), jnp.int32).at[::2, 1].set(1)  # even tokens [0, 1], odd ones [0, 0]
  mesh = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2])
  specs = (P("ep"), P(), P("ep"), P("ep"))
  loss = lambda y, dropped: (jnp.sum(y ** 2), dropped)

  def single(args):
    y, aux = sonic_jax.moe(*args, top_k=K, expert_ids=ids, backend="xla")
    return loss(y, aux.dropped_pairs)

  def local(x, rw, w1, w2, ids):
    y, aux = scheme(x, rw, w1, w2, axis_name=["ep"], top_k=K, expert_ids=ids, backend="xla")
    return y, jax.lax.psum(aux.dropped_pairs, "ep")

  mapped = jax.shard_map(local, mesh=mesh, in_specs=(*specs, P("ep")), out_specs=(P("ep"), P()))
  (v_ref, dropped_ref), g_ref = jax.jit(jax.value_and_grad(single, has_aux=True))(args)
  ids_placed = jax.device_put(ids, jax.NamedSharding(mesh, P("ep")))
  (v, dropped), g = jax.jit(jax.value_and_grad(lambda a: loss(*mapped(*a, ids_placed)),
                                               has_aux=True))(
      [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(args, specs)])
  errs = [rel(v, v_ref)] + [rel(a, b) for a, b in zip(g, g_ref)]
  print(scheme_name, "repeated ids", int(dropped), ["%.1e" % e for e in errs])
  assert int(dropped) == int(dropped_ref) == 0 and max(errs) < 1e-10, (dropped, errs)

  zero = [jax.device_put(jnp.zeros(shape), jax.NamedSharding(mesh, s)) for shape, s in
          zip(((t, 0), (0, e), (e, 0, 2 * n), (e, n, 0)), specs)]
  f = jax.shard_map(lambda *a: scheme(*a, axis_name="ep", top_k=K, backend="xla")[0], mesh=mesh,
                    in_specs=specs, out_specs=P("ep"))
  y, grads = jax.jit(lambda a: (f(*a), jax.grad(lambda b: jnp.sum(f(*b)))(a)))(zero)
  assert y.shape == (t, 0) and [a.shape for a in grads] == [a.shape for a in zero], y.shape
  print(scheme_name, "d = 0")


def check_placement(scheme_name, placement):
  """x placed otherwise than split over one "ep" axis, under shard_map's type check, against the
  single device (no aux losses: they are per data shard or per copy): "replicated", x replicated
  over 2 devices, each routing the same T tokens, so the output holds 2 copies of the single
  device's and every gradient is twice its (x's summed over the devices that used it);
  "data_axis", a (data 2, ep 4) mesh with the tokens split over both axes and the expert weights
  over "ep" alone, their gradients summed over "data"; "data_axis_bf16", the same in bfloat16
  (the router's 16-bit GEMM has a backward of its own), against one device in bfloat16 to 2e-2;
  "tuple_axis", that mesh with the experts split over both axes too, axis_name=("data", "ep")."""
  args, _, _, dy = inputs("random", None)
  bf16 = placement.endswith("_bf16")
  if bf16:
    args, dy = [a.astype(jnp.bfloat16) for a in args], dy.astype(jnp.bfloat16)
  kw, _ = options(None)
  scheme = SCHEMES[scheme_name]

  axis, both = "ep", P(("data", "ep"))
  if placement == "replicated":
    mesh, x_spec, w_spec, copies = jax.make_mesh((2,), ("ep",), devices=jax.devices()[:2]), P(), \
        P("ep"), 2
  else:
    mesh, x_spec, w_spec, copies = jax.make_mesh((2, 4), ("data", "ep")), both, P("ep"), 1
    if placement == "tuple_axis":  # the experts over both axes, named as one
      axis, w_spec = ("data", "ep"), both
  specs = [x_spec, P(), w_spec, w_spec, w_spec]
  mapped = jax.shard_map(lambda a: scheme(*a[:4], b1=a[4], axis_name=axis, **kw)[0], mesh=mesh,
                         in_specs=(specs,), out_specs=both if copies == 1 else P("ep"))
  v_ref, g_ref = single_reference()(args, dy)
  placed = [jax.device_put(a, jax.NamedSharding(mesh, s)) for a, s in zip(args, specs)]
  v, g = jax.jit(jax.value_and_grad(lambda a, dy: jnp.vdot(mapped(a), dy)))(
      placed, jnp.concatenate([dy] * copies))
  # the output through <y, dy>: every copy's equals one device's
  errs = [rel(v, copies * v_ref)] + [rel(a, copies * b) for a, b in zip(g, g_ref)]
  print(scheme_name, placement, ["%.1e" % e for e in errs])
  assert max(errs) < (2e-2 if bf16 else 1e-10), errs


if __name__ == "__main__":
  # Each argument one case: "scheme:routing[:mode]", "scheme:empty", "scheme:given_ids", or
  # "scheme:replicated", "scheme:data_axis", "scheme:data_axis_bf16" or "scheme:tuple_axis"
  # (`check_placement`).
  for case in sys.argv[1:]:
    if case.endswith(":empty"):
      check_no_tokens(case.split(":")[0])
    elif case.endswith(":given_ids"):
      check_given_selection_and_zero_width(case.split(":")[0])
    elif case.endswith((":replicated", ":data_axis", ":data_axis_bf16", ":tuple_axis")):
      check_placement(*case.split(":"))
    else:
      check(*case.split(":"))
  print("OK")
