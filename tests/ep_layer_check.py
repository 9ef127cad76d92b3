"""Run in a fresh process with 4 CPU devices (see test_parallel.py): the Flax `MoE` layer with
`expert_parallel_axis`, each scheme given as an argument, against the same layer on one device:

- under a user's `jax.shard_map`: output and the gradients of every parameter (float64);
- in a plain `jax.jit` program under `jax.set_mesh` on a (data 2, ep 2) mesh, where the layer adds
  its own shard_map, on Explicit and on Auto mesh axes: output, the gradients of every parameter
  (Gemma 4's router scales among them) and of x, the expert counts, the z-loss, and the
  load-balance loss as the mean of the two data shards' losses; on Explicit axes also the output
  with a fixed selection (expert_ids), the output for a batch of 2 sequences over the 4 token
  shards (B not a multiple of them), and inside a user's shard_map over "data" (the layer adding
  its own over "ep") output and parameter gradients, refused by name under that shard_map's type
  check, and for x sharded over its sequence dim; token axes of mixed types refused;
- called eagerly (no jax.jit) under `jax.set_mesh` with the default mesh, parameters as
  constructed (not placed on the mesh), on an input with batch dimensions: output and gradients;
  a mesh that cannot hold the experts is refused by name;
- the all-gather scheme with a capacity factor under `jax.set_mesh`: output, kept ids and dropped
  count equal one device's;
- the parallel op inside a `jax.lax.scan` inside the user's shard_map: output and gradients;
- without expert parallelism: expert weights split over an Explicit axis refused by name, taken
  (gradients too) over a size-1 axis; `sonic_jax.moe` with x split over d and the expert weights
  and biases over their other dims; the layer data parallel under `jax.set_mesh` (x's tokens split
  over an Explicit axis, or `token_axes` on an Auto one), against one device; `sonic_jax.moe`
  vmapped over a batch split over an Explicit axis; the sequence-wise balance loss with the
  sequences split over an Explicit axis.

Float64 throughout: compare to rounding, not to fusion order. The single-device references are
computed once and shared by the schemes."""

import functools
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
from flax import nnx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import oracle  # noqa: E402
import sonic_jax  # noqa: E402
from sonic_jax.layers import MoE  # noqa: E402

T = 64
KW = dict(d_model=16, num_experts=8, expert_dim=8, top_k=2, use_bias=True, num_shared_experts=1,
          backend="xla", init_std=0.3, dtype=jnp.float64, param_dtype=jnp.float64)
X = np.random.default_rng(1).standard_normal((T, 16))
D_Y = np.random.default_rng(2).standard_normal((T, 16))


# A result with a NaN or an infinity is infinitely far off: a NaN error would pass `max(errs) <`.
rel = oracle.rel_err


def same_spec(a, b) -> bool:
  """a and b are split alike in their types (trailing unsplit dims aside)."""
  def entries(v):
    spec = tuple(jax.typeof(v).sharding.spec) + (None,) * v.ndim
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e)
                 for e in spec[:v.ndim])
  return entries(a) == entries(b)


def expert_specs(state):
  """Expert parameters (logical axis "expert" first) over the mesh axis, the rest replicated."""
  return jax.tree.map(lambda p: P("ep") if p and p[0] == "expert" else P(),
                      nnx.get_partition_spec(state), is_leaf=lambda v: isinstance(v, P))


def refused(fn, message, what):
  """fn() raises a ValueError saying `message` (traced abstractly: nothing compiles)."""
  try:
    fn()
  except ValueError as e:
    assert message in str(e), e
  else:
    raise AssertionError(f"{what} were not refused")


def placed_experts(state, mesh):
  """state with its expert parameters split over the mesh's "ep" axis, the rest replicated."""
  return jax.tree.map(lambda a, p: jax.device_put(a, NamedSharding(mesh, p)), state,
                      expert_specs(state))


def grad_errs(grads, grads_ref):
  return {jax.tree_util.keystr(path): rel(g, g_ref) for (path, g), (_, g_ref) in
          zip(jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(grads_ref))}


def loss_of(graphdef, run):
  def loss(state, x):
    y, aux = run(graphdef, state, x)
    return jnp.vdot(y, D_Y) + aux, y
  return loss


# The references compiled (jax.jit), like the sharded runs: a fresh process would otherwise
# compile each of their ops on its own.
@functools.cache
def shard_map_reference():
  single = MoE(**KW, token_rounding="up", rngs=nnx.Rngs(0))
  g1, s1 = nnx.split(single)
  return jax.jit(jax.value_and_grad(
      loss_of(g1, lambda g, s, x: (lambda y, a: (y, a.loss))(*nnx.merge(g, s)(x))),
      has_aux=True))(s1, jnp.asarray(X))


def check_shard_map(scheme):
  (_, y_ref), grads_ref = shard_map_reference()
  sharded = MoE(**KW, token_rounding="up", expert_parallel_axis="ep",
                expert_parallel_scheme=scheme, rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((4,), ("ep",))
  g2, s2 = nnx.split(sharded)
  specs = expert_specs(s2)

  def local(state, x):
    y, aux = nnx.merge(g2, state)(x)
    return y, aux.loss

  run = jax.shard_map(local, mesh=mesh, in_specs=(specs, P("ep")), out_specs=(P("ep"), P()),
                      check_vma=False)
  placed = placed_experts(s2, mesh)
  x_placed = jax.device_put(X, NamedSharding(mesh, P("ep")))
  (_, y), grads = jax.jit(jax.value_and_grad(loss_of(g2, lambda g, s, x: run(s, x)),
                                             has_aux=True))(placed, x_placed)
  errs = {"y": rel(y, y_ref), **grad_errs(grads, grads_ref)}
  print("shard_map", scheme, {k: f"{v:.1e}" for k, v in errs.items()})
  assert len(errs) == 1 + 7 and max(errs.values()) < 1e-10, errs


SET_MESH_KW = dict(KW, router_norm_eps=1e-6, use_expert_scale=True)  # Gemma 4's router: 2 inputs
IDS = np.random.default_rng(3).integers(0, 8, (T, 2)).astype(np.int32)


def set_mesh_loss(graphdef):
  def loss(state, x):
    y, aux = nnx.merge(graphdef, state)(x)
    return jnp.vdot(y, D_Y) + aux.stats.z_loss, (y, aux.stats)
  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


@functools.cache
def set_mesh_reference():
  """One program: the value and gradients, each half's load-balance loss, the output with the
  fixed selection IDS."""
  g1, s1 = nnx.split(MoE(**SET_MESH_KW, rngs=nnx.Rngs(0)))

  def reference(s, x, ids):
    halves = [nnx.merge(g1, s)(x[i * T // 2:(i + 1) * T // 2])[1].stats.load_balance_loss
              for i in range(2)]
    return set_mesh_loss(g1)(s, x), halves, nnx.merge(g1, s)(x, expert_ids=ids)[0]

  return jax.jit(reference)(s1, jnp.asarray(X), jnp.asarray(IDS))


def check_set_mesh(scheme):
  ((_, (y_ref, st_ref)), (gs_ref, gx_ref)), halves, y_ids_ref = set_mesh_reference()
  extra = dict(capacity_factor=None) if scheme == "all_gather" else {}
  sharded = MoE(**SET_MESH_KW, expert_parallel_axis="ep", expert_parallel_scheme=scheme, **extra,
                rngs=nnx.Rngs(0))
  g2, s2 = nnx.split(sharded)
  for types in ((AxisType.Explicit,) * 2, (AxisType.Auto,) * 2):
    explicit = types[0] == AxisType.Explicit
    mesh = jax.make_mesh((2, 2), ("data", "ep"), axis_types=types)
    tokens = NamedSharding(mesh, P(("data", "ep")))

    def run(s, x, ids, x_data, x_batch, x_seq):
      out = set_mesh_loss(g2)(s, x)
      if not explicit:
        return out, None, None, None, None
      # A fixed selection (expert_ids), sharded as the tokens by the layer's own shard_map; and
      # the layer inside a user's shard_map over "data" alone (without its type check, as the
      # layer asks), value and gradients: all in the program of the gradients (one compilation).
      y_ids = nnx.merge(g2, s)(x, expert_ids=ids)[0]

      def in_data_shard_map(s, x):
        def local(s, x):
          y, aux = nnx.merge(g2, s)(x)
          return y, jax.lax.pmean(aux.stats.z_loss, "data")  # equal shards: the whole's
        y, z_loss = jax.shard_map(local, in_specs=(P(), P("data")),
                                  out_specs=(P("data"), P()), axis_names={"data"},
                                  check_vma=False)(s, x)
        return jnp.vdot(y, D_Y) + z_loss, y

      inner = jax.value_and_grad(in_data_shard_map, has_aux=True)(s, x_data)
      # x, the router's input and the fixed selection sharded over the sequence dim
      ids_seq = jax.sharding.reshard(ids.reshape(4, T // 4, 2), P(None, "ep"))
      y_batch, y_seq = nnx.merge(g2, s)(x_batch)[0], nnx.merge(g2, s)(x_seq)[0]
      # The output in x's sharding, whatever the layer's token shards (a residual x + y needs it)
      for x_in, y_out in ((x_batch, y_batch), (x_seq, y_seq)):
        assert same_spec(x_in, y_out), (jax.typeof(x_in), jax.typeof(y_out))
      return out, y_ids, inner, x_batch + y_batch, (
          y_seq, nnx.merge(g2, s)(x_seq, x_seq, ids_seq)[0])

    with jax.set_mesh(mesh):
      if explicit:  # refused, abstractly: inside a type-checked shard_map over "data"
        try:
          jax.eval_shape(jax.shard_map(lambda s, x: nnx.merge(g2, s)(x)[0],
                                       in_specs=(P(), P("data")), out_specs=P("data"),
                                       axis_names={"data"}), s2, X)
        except ValueError as e:
          assert "check_vma=True" in str(e), e
        else:
          raise AssertionError("the layer's own shard_map inside a checked one was not refused")
      placed = placed_experts(s2, mesh)
      ((_, (y, st)), (gs, gx)), y_ids, y_inner, y_batch, y_seq = jax.jit(run)(
          placed, jax.device_put(X, tokens), jax.device_put(IDS, tokens),
          jax.device_put(X, NamedSharding(mesh, P("data"))),
          jax.device_put(X.reshape(2, T // 2, 16), NamedSharding(mesh, P("data"))),
          jax.device_put(X.reshape(4, T // 4, 16), NamedSharding(mesh, P(None, "ep"))))
    errs = {"y": rel(y, y_ref), "dx": rel(gx, gx_ref), "z_loss": rel(st.z_loss, st_ref.z_loss),
            "load_balance": rel(st.load_balance_loss, np.mean(halves)), **grad_errs(gs, gs_ref)}
    print("set_mesh", scheme, types[0], {k: f"{v:.1e}" for k, v in errs.items()})
    assert len(errs) == 4 + 9 and max(errs.values()) < 1e-10, errs
    np.testing.assert_array_equal(st.expert_counts, st_ref.expert_counts)
    np.testing.assert_array_equal(st.expert_ids, st_ref.expert_ids)
    if explicit:
      assert rel(y_ids, y_ids_ref) < 1e-10, rel(y_ids, y_ids_ref)
      (_, y_inner), g_inner = y_inner
      errs = {"y": rel(y_inner, y_ref), **grad_errs(g_inner, gs_ref)}
      assert max(errs.values()) < 1e-10, errs
      assert rel(y_batch, y_ref.reshape(2, T // 2, 16) + X.reshape(2, T // 2, 16)) < 1e-10
      assert rel(y_seq[0], y_ref.reshape(4, T // 4, 16)) < 1e-10
      assert rel(y_seq[1], y_ids_ref.reshape(4, T // 4, 16)) < 1e-10


def check_all_gather_capacity():
  """The all-gather scheme with a capacity factor, under `jax.set_mesh` on an "ep" axis of 4:
  output, kept ids and dropped count equal one device's layer with the same capacity (the scheme
  drops over the axis's tokens as the single-device op over all of them)."""
  kw = dict(KW, capacity_factor=0.5)

  def forward(graphdef):
    def run(s, x):
      y, aux = nnx.merge(graphdef, s)(x)
      return y, aux.stats.expert_ids, aux.stats.dropped_pairs
    return jax.jit(run)

  g1, s1 = nnx.split(MoE(**kw, rngs=nnx.Rngs(0)))
  y_ref, ids_ref, dropped_ref = forward(g1)(s1, jnp.asarray(X))
  g2, s2 = nnx.split(MoE(**kw, expert_parallel_axis="ep", expert_parallel_scheme="all_gather",
                         rngs=nnx.Rngs(0)))
  mesh = jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Explicit,))
  with jax.set_mesh(mesh):
    y, ids, dropped = forward(g2)(placed_experts(s2, mesh),
                                  jax.device_put(X, NamedSharding(mesh, P("ep"))))
  print("all_gather capacity", int(dropped), f"{rel(y, y_ref):.1e}")
  assert 0 < int(dropped_ref) and int(dropped) == int(dropped_ref)
  np.testing.assert_array_equal(ids, ids_ref)
  assert rel(y, y_ref) < 1e-10, rel(y, y_ref)


def check_mixed_axis_types():
  """Token axes of two axis types (Explicit data, Auto ep) are refused by name, abstractly."""
  layer = MoE(**KW, expert_parallel_axis="ep", rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((2, 2), ("data", "ep"), axis_types=(AxisType.Explicit, AxisType.Auto))
  with jax.set_mesh(mesh):
    refused(lambda: jax.eval_shape(lambda: layer(jnp.asarray(X))), "mix mesh axis types",
            "token axes of mixed types")


def check_split_experts_without_parallelism():
  """Expert weights split over an Explicit axis: `sonic_jax.hf.load_into_layer` keeps them so,
  and the layer without an expert_parallel_axis refuses them by name, abstractly."""
  from sonic_jax import hf  # pylint: disable=import-outside-toplevel
  layer = MoE(**KW, rngs=nnx.Rngs(0))
  params = hf.layer_params(layer)
  # The expert weights (w1, w2) split over "ep", the rest replicated.
  weights_over = lambda mesh: jax.tree.map(lambda v: jax.device_put(v, NamedSharding(
      mesh, P("ep") if v.ndim == 3 else P())), nnx.state(layer))
  mesh = jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Explicit,))
  nnx.update(layer, weights_over(mesh))
  hf.load_into_layer(layer, params)
  assert layer.w1[...].sharding.spec == P("ep"), layer.w1[...].sharding
  assert np.array_equal(np.asarray(layer.w2[...]), params["w2"])
  refused(lambda: jax.eval_shape(lambda: layer(jnp.asarray(X))),
          "w1 is split over its experts on the mesh axes ('ep',)",
          "experts split without expert parallelism")
  # An axis of size 1 splits nothing: taken, the biases (b1, b2) so placed too, gradients included.
  one = jax.make_mesh((1, 4), ("ep", "data"), axis_types=(AxisType.Explicit,) * 2)
  nnx.update(layer, placed_experts(nnx.state(layer), one))
  assert layer.b1[...].sharding.spec == P("ep"), layer.b1[...].sharding
  jax.eval_shape(nnx.grad(lambda m: jnp.sum(m(jnp.asarray(X))[0])), layer)


SCAN_ARGS = [jnp.asarray(np.random.default_rng(5).standard_normal(shape) * 0.5) for shape in
             ((T, 16), (16, 8), (8, 16, 16), (8, 8, 16))]  # x, router, w1, w2


def scan_layers(run):
  """Two layers of shared weights in a `jax.lax.scan`."""
  return lambda x, router, w1, w2: jax.lax.scan(
      lambda h, _: (run(h, router, w1, w2), None), x, None, length=2)[0]


def scan_grads(forward):
  loss = lambda *a: (lambda y: (jnp.vdot(y, D_Y), y))(forward(*a))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


@functools.cache
def scan_reference():
  from sonic_jax import moe  # pylint: disable=import-outside-toplevel
  return scan_grads(scan_layers(lambda h, r, w1, w2: moe(h, r, w1, w2, top_k=2,
                                                         backend="xla")[0]))(*SCAN_ARGS)


def check_scan(scheme):
  """The parallel op inside a `jax.lax.scan` (two layers of shared weights) inside the user's
  shard_map: output and every gradient against `sonic_jax.moe` in the same scan, float64."""
  from sonic_jax import parallel  # pylint: disable=import-outside-toplevel
  op = getattr(parallel, f"moe_{scheme}")
  sharded = jax.shard_map(
      scan_layers(lambda h, r, w1, w2: op(h, r, w1, w2, axis_name="ep", top_k=2,
                                          backend="xla")[0]),
      mesh=jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Auto,)),
      in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep"))
  (_, y_ref), g_ref = scan_reference()
  (_, y), g = scan_grads(sharded)(*SCAN_ARGS)
  errs = [rel(y, y_ref)] + [rel(a, b) for a, b in zip(g, g_ref)]
  print("scan", scheme, ["%.1e" % e for e in errs])
  assert max(errs) < 1e-10, errs


def check_split_operands():
  """`sonic_jax.moe` (no expert parallelism) with x split over d, the router over E and the expert
  weights and biases over their other dims on an Explicit mesh (as FSDP places them): the output
  and gradients of the unsplit call, the gradients split as their operands."""
  from sonic_jax import moe  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(4)
  # x, router, w1, w2, b1, b2
  shapes = ((T, 16), (16, 8), (8, 16, 16), (8, 8, 16), (8, 16), (8, 16))
  args = [jnp.asarray(rng.standard_normal(shape)) for shape in shapes]

  def loss(x, router, w1, w2, b1, b2):
    y = moe(x, router, w1, w2, top_k=2, b1=b1, b2=b2, backend="xla")[0]
    return jnp.vdot(y, D_Y), y

  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))
  (_, y_ref), g_ref = grad(*args)
  mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
  specs = (P(None, "fsdp"), P(None, "data"), P(None, "data", "fsdp"), P(None, "fsdp"),
           P(None, "data"), P(None, "fsdp"))
  with jax.set_mesh(mesh):
    placed = [jax.device_put(a, NamedSharding(mesh, spec)) for a, spec in zip(args, specs)]
    (_, y), g = grad(*placed)
  errs = [rel(y, y_ref)] + [rel(a, b) for a, b in zip(g, g_ref)]
  print("split operands", ["%.1e" % e for e in errs])
  assert max(errs) < 1e-10, errs
  full = lambda spec, ndim: tuple(spec) + (None,) * (ndim - len(spec))
  assert [full(jax.typeof(a).sharding.spec, a.ndim) for a in g] == [
      full(spec, a.ndim) for spec, a in zip(specs, args)], g
  # The functional pieces under the op take the same placements, and refuse split tokens or
  # experts by name (abstractly) rather than failing inside JAX.
  x, router, w1, w2, b1, b2 = args
  routed = sonic_jax.route(x @ router, 2)
  layout = sonic_jax.build_grouped_layout(routed.expert_ids, 8, 32)
  pieces = lambda x, w1, w2, b1, b2: (
      sonic_jax.routed_experts(x, routed.expert_ids, routed.scores, w1, w2, b1=b1, b2=b2,
                               backend="xla")[0],
      sonic_jax.expert_mixture(x, routed.scores, layout, w1, w2, b1=b1, b2=b2, backend="xla"))
  with jax.set_mesh(mesh):
    y = jax.jit(pieces)(placed[0], *placed[2:])
    errs = [rel(a, y_ref) for a in y]  # moe's routing is this one
    assert max(errs) < 1e-10, errs
    over = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    tokens = {k: over(v, P("data")) for k, v in routed._asdict().items()}
    split_routed = sonic_jax.RouterOutput(**tokens)
    for fn, message in (
        (lambda: sonic_jax.routed_experts(over(x, P("data")), routed.expert_ids, routed.scores,
                                          w1, w2), "x is split over its tokens"),
        (lambda: sonic_jax.routed_experts(x, routed.expert_ids, routed.scores,
                                          over(w1, P("data")), w2), "w1 is split over its experts"),
        (lambda: sonic_jax.expert_mixture(x, tokens["scores"], layout, w1, w2),
         "scores is split over its tokens"),
        (lambda: sonic_jax.build_grouped_layout(tokens["expert_ids"], 8, 32),
         "expert_ids is split over its tokens"),
        (lambda: sonic_jax.round_tokens(split_routed, 32, "up"),
         "routed.scores is split over its tokens")):
      refused(lambda: jax.eval_shape(fn), message, message)
  # A size-1 axis splits nothing: the same placements taken (traced only).
  one = jax.make_mesh((1, 4), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
  with jax.set_mesh(one):
    over = lambda a: jax.device_put(a, NamedSharding(one, P("data")))
    tokens = {k: over(v) for k, v in routed._asdict().items()}
    jax.eval_shape(lambda: (
        sonic_jax.routed_experts(over(x), tokens["expert_ids"], tokens["scores"], w1, w2),
        sonic_jax.expert_mixture(over(x), tokens["scores"], layout, w1, w2),
        sonic_jax.build_grouped_layout(tokens["expert_ids"], 8, 32),
        sonic_jax.round_tokens(sonic_jax.RouterOutput(**tokens), 32, "up"),
        sonic_jax.moe(over(x), router, w1, w2, top_k=2, expert_ids=tokens["expert_ids"])))


def check_vmap_over_split_batch():
  """`sonic_jax.moe` vmapped over a batch that an Explicit mesh axis splits (a family router with
  groups, a selection bias and a per-expert scale; biases): output and every gradient of the
  unsplit vmap, the output split as the batch; nested under a vmap of a split batch, and a
  second-order gradient; the mosaic_gpu backend refuses such a batch by name (interpret mode: the
  refusal comes before any kernel is traced)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu  # pylint: disable=import-outside-toplevel
  import sonic_jax  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(5)
  # x (batch 4), router, w1, w2, b1, b2, expert_scale, router_bias
  shapes = ((4, T // 4, 16), (16, 8), (8, 16, 16), (8, 8, 16), (8, 16), (8, 16), (8,), (8,))
  args = [jnp.asarray(rng.standard_normal(shape)) for shape in shapes]
  router = sonic_jax.Router("sigmoid", n_group=4, topk_group=2, routed_scaling_factor=2.0)
  selection_bias = jnp.asarray(rng.standard_normal(8) * 0.1)
  d_y = jnp.asarray(D_Y.reshape(4, T // 4, 16))

  def loss(x, rw, w1, w2, b1, b2, scale, bias, backend="xla"):
    one = lambda xb: sonic_jax.moe(xb, rw, w1, w2, top_k=2, b1=b1, b2=b2, routing=router,
                                   expert_scale=scale, router_bias=bias,
                                   selection_bias=selection_bias, backend=backend)[0]
    y = jax.vmap(one)(x)
    return jnp.vdot(y, d_y), y

  grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(8)), has_aux=True))
  (_, y_ref), g_ref = grad(*args)
  with jax.set_mesh(jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))):
    x = jax.device_put(args[0], P("data"))
    (_, y), g = grad(x, *args[1:])
    assert jax.typeof(y).sharding.spec[0] == "data", jax.typeof(y)
    with plgpu.force_gpu_interpret_mode():
      refused(lambda: jax.eval_shape(functools.partial(loss, backend="mosaic_gpu"),
                                     x.astype(jnp.bfloat16), *(a.astype(jnp.bfloat16)
                                                               for a in args[1:])),
              "batch split over the mesh axes ('data',)", "mosaic_gpu under a split vmap")
  errs = [rel(y, y_ref)] + [rel(a, b) for a, b in zip(g, g_ref)]
  print("vmap over a split batch", ["%.1e" % e for e in errs])
  assert max(errs) < 1e-10, errs

  # Nested, the outer batch split; and a second-order gradient (the expert scale's) split.
  def nested(x, *params):
    one = lambda xb: sonic_jax.moe(xb, params[0], params[1], params[2], top_k=2, backend="xla",
                                   expert_scale=params[3])[0]
    return jax.vmap(jax.vmap(one))(x)

  def second_order(x, *params):
    inner = lambda scale: jnp.sum(nested(x, *params[:3], scale) ** 2)
    return jax.grad(lambda scale: jnp.sum(jax.grad(inner)(scale) ** 2))(params[3])

  params = (args[1], args[2], args[3], args[6])
  x4 = args[0][:, None]
  want = [jax.jit(nested)(x4, *params), jax.jit(second_order)(x4, *params)]
  with jax.set_mesh(jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))):
    x4 = jax.device_put(x4, P("data"))
    got = [jax.jit(nested)(x4, *params), jax.jit(second_order)(x4, *params)]
  errs = [rel(a, b) for a, b in zip(got, want)]
  print("nested vmap, second order", ["%.1e" % e for e in errs])
  assert max(errs) < 1e-10, errs


def check_data_parallel():
  """The layer without expert parallelism under `jax.set_mesh`, x's tokens split over "data" (an
  Explicit axis: from x's type; an Auto one: by token_axes): each data shard routed on its own, as
  data-parallel replicas would. Output, the gradients of every parameter and of x, counts, the
  z-loss, and the load-balance loss as the mean of the two shards' (float64), the output and
  parameter gradients with the weights' model dim split over "data" too (FSDP's placement);
  `sonic_jax.moe` given such tokens refuses them by name; the layer with token_axes inside the
  user's shard_map over them runs on the shard as it is."""
  ((_, (y_ref, st_ref)), (gs_ref, gx_ref)), halves, _ = set_mesh_reference()
  for types in ((AxisType.Explicit,) * 2, (AxisType.Auto,) * 2):
    explicit = types[0] == AxisType.Explicit
    g2, s2 = nnx.split(MoE(**SET_MESH_KW, token_axes=None if explicit else "data",
                           rngs=nnx.Rngs(0)))
    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=types)
    with jax.set_mesh(mesh):
      x = jax.device_put(X, NamedSharding(mesh, P("data")))
      (_, (y, st)), (gs, gx) = jax.jit(set_mesh_loss(g2))(s2, x)
      if not explicit:  # inside the user's shard_map over its token axes: the op on each shard
        y_user = jax.jit(jax.shard_map(lambda s, x: nnx.merge(g2, s)(x)[0], in_specs=(P(), P(
            "data")), out_specs=P("data")))(s2, x)
        assert rel(y_user, y_ref) < 1e-10, rel(y_user, y_ref)
      if explicit:
        # FSDP's placement: each weight's model dim split over the token axis too (the routed
        # experts' and the shared expert's weights gathered whole for the call)
        fsdp = jax.tree.map(
            lambda v, spec: jax.device_put(v, NamedSharding(mesh, P(*(
                "data" if name == "embed" else None for name in spec)))),
            s2, nnx.get_partition_spec(s2), is_leaf=lambda a: isinstance(a, P))
        (_, (y_fsdp, _)), (gs_fsdp, _) = jax.jit(set_mesh_loss(g2))(fsdp, x)
        errs = {"y": rel(y_fsdp, y_ref), **grad_errs(gs_fsdp, gs_ref)}
        assert max(errs.values()) < 1e-10 and same_spec(x, y_fsdp), (errs, jax.typeof(y_fsdp))
        from sonic_jax import moe  # pylint: disable=import-outside-toplevel
        refused(lambda: jax.eval_shape(lambda x: moe(x, s2["router"][...], s2["w1"][...],
                                                     s2["w2"][...], top_k=2), x),
                "x is split over its tokens on the mesh axes ('data',)", "split tokens")
    errs = {"y": rel(y, y_ref), "dx": rel(gx, gx_ref), "z_loss": rel(st.z_loss, st_ref.z_loss),
            "load_balance": rel(st.load_balance_loss, np.mean(halves)), **grad_errs(gs, gs_ref)}
    print("data parallel", types[0], {k: f"{v:.1e}" for k, v in errs.items()})
    assert len(errs) == 4 + 9 and max(errs.values()) < 1e-10, errs
    np.testing.assert_array_equal(st.expert_counts, st_ref.expert_counts)
    np.testing.assert_array_equal(st.choice_ids, st_ref.choice_ids)


def check_sequence_balance_loss():
  """balance_loss="sequence" data parallel: x (4, 16, d) with its sequences split over an
  Explicit "data" axis, the loss (computed from the whole batch's routing) and every parameter's
  gradient of vdot(y, dY) + the loss against one device."""
  g, s = nnx.split(MoE(**KW, balance_loss="sequence", rngs=nnx.Rngs(0)))
  x, d_y = X.reshape(4, T // 4, 16), D_Y.reshape(4, T // 4, 16)

  def loss(state, x):
    y, aux = nnx.merge(g, state)(x)
    return jnp.vdot(y, d_y) + aux.loss, (y, aux.loss)

  grad = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (_, (y_ref, l_ref)), gs_ref = grad(s, x)
  with jax.set_mesh(jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,),
                                  devices=jax.devices()[:2])):
    (_, (y, l)), gs = grad(s, jax.device_put(x, P("data")))
  errs = {"y": rel(y, y_ref), "loss": rel(l, l_ref), **grad_errs(gs, gs_ref)}
  print("sequence balance loss, data parallel", {k: f"{v:.1e}" for k, v in errs.items()})
  assert max(errs.values()) < 1e-10, errs


@functools.cache
def eager_reference():
  single = MoE(**KW, rngs=nnx.Rngs(0))
  x = jnp.asarray(X.reshape(4, T // 4, 16))
  # (sum y^2, y) and the gradients in one program
  return nnx.jit(nnx.value_and_grad(lambda m: (lambda y: (jnp.sum(y ** 2), y))(m(x)[0]),
                                    has_aux=True))(single)


def check_eager(scheme):
  (_, y_ref), g_ref = eager_reference()
  x = jnp.asarray(X.reshape(4, T // 4, 16))  # batch dimensions
  with jax.set_mesh(jax.make_mesh((4,), ("ep",))):
    layer = MoE(**KW, expert_parallel_axis="ep", expert_parallel_scheme=scheme, rngs=nnx.Rngs(0))
    y, aux = layer(x)  # eager: called outside jax.jit
    g = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(layer)
    errs = {"y": rel(y, y_ref), **grad_errs(g, g_ref)}
    print("eager", scheme, {k: "%.1e" % e for k, e in errs.items()})
    assert len(errs) == 1 + 7 and max(errs.values()) < 1e-10, errs
    assert np.isfinite(float(aux.loss))
    refused(lambda: jax.eval_shape(lambda: MoE(16, 6, 8, 2, expert_parallel_axis="ep",
                                               backend="xla", rngs=nnx.Rngs(0))(x)),
            "num_experts=6", "6 experts over 4 devices")
  if scheme == "all_gather":  # on Auto axes too, parameters made before the mesh (on one device)
    layer = MoE(**KW, expert_parallel_axis="ep", expert_parallel_scheme=scheme, rngs=nnx.Rngs(0))
    with jax.set_mesh(jax.make_mesh((4,), ("ep",), axis_types=(AxisType.Auto,))):
      y = layer(x)[0]
    assert rel(y, y_ref) < 1e-10, rel(y, y_ref)


if __name__ == "__main__":
  for scheme in sys.argv[1:]:
    for check in (check_shard_map, check_set_mesh, check_eager, check_scan):
      check(scheme)
  check_all_gather_capacity()
  check_mixed_axis_types()
  check_split_experts_without_parallelism()
  check_split_operands()
  check_vmap_over_split_batch()
  check_data_parallel()
  check_sequence_balance_loss()
  print("OK")
