"""Run in a fresh process with 4 CPU devices (see test_parallel.py): the Flax `MoE` layer with
`expert_parallel_axis` called in a plain `jax.jit` program under `jax.set_mesh` on a (data 2, ep 2)
mesh — the layer adds its own shard_map — against the same layer on one device: output, the
gradients of every parameter and of x, the expert counts, the z-loss, and the load-balance loss as the
mean of the two data shards' losses. Explicit and auto mesh axes, both schemes."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
from flax import nnx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

from sonic_jax.layers import MoE  # noqa: E402

T = 64


def main():
  scheme = sys.argv[1]
  kw = dict(d_model=16, num_experts=8, expert_dim=8, top_k=2, use_bias=True, num_shared_experts=1,
            backend="xla", init_std=0.3, dtype=jnp.float64, param_dtype=jnp.float64)
  extra = dict(capacity_factor=None) if scheme == "all_gather" else {}
  single = MoE(**kw, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((T, 16)))
  d_y = jnp.asarray(np.random.default_rng(2).standard_normal((T, 16)))

  def loss_of(graphdef):
    def loss(state, x):
      y, aux = nnx.merge(graphdef, state)(x)
      return jnp.vdot(y, d_y) + aux.stats.z_loss, (y, aux.stats)
    return loss

  g1, s1 = nnx.split(single)
  (_, (y_ref, st_ref)), (gs_ref, gx_ref) = jax.value_and_grad(loss_of(g1), argnums=(0, 1),
                                                              has_aux=True)(s1, x)
  halves = [nnx.merge(g1, s1)(x[i * T // 2:(i + 1) * T // 2])[1].stats.load_balance_loss
            for i in range(2)]
  rel = lambda a, b: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))
  for types in ((AxisType.Explicit,) * 2, (AxisType.Auto,) * 2):
    mesh = jax.make_mesh((2, 2), ("data", "ep"), axis_types=types)
    sharded = MoE(**kw, expert_parallel_axis="ep", expert_parallel_scheme=scheme, **extra,
                  rngs=nnx.Rngs(0))
    g2, s2 = nnx.split(sharded)
    specs = jax.tree.map(lambda p: P("ep") if p and p[0] == "expert" else P(),
                         nnx.get_partition_spec(s2), is_leaf=lambda v: isinstance(v, P))
    with jax.set_mesh(mesh):
      placed = jax.tree.map(lambda a, p: jax.device_put(a, NamedSharding(mesh, p)), s2, specs)
      x_placed = jax.device_put(x, NamedSharding(mesh, P(("data", "ep"))))
      (_, (y, st)), (gs, gx) = jax.jit(jax.value_and_grad(loss_of(g2), argnums=(0, 1),
                                                          has_aux=True))(placed, x_placed)
    errs = {"y": rel(y, y_ref), "dx": rel(gx, gx_ref), "z_loss": rel(st.z_loss, st_ref.z_loss),
            "load_balance": rel(st.load_balance_loss, np.mean(halves))}
    for (path, g), (_, g_ref) in zip(jax.tree.leaves_with_path(gs), jax.tree.leaves_with_path(gs_ref)):
      errs[jax.tree_util.keystr(path)] = rel(g, g_ref)
    print(types[0], {k: f"{v:.1e}" for k, v in errs.items()})
    assert len(errs) == 4 + 7 and max(errs.values()) < 1e-10, errs
    np.testing.assert_array_equal(st.expert_counts, st_ref.expert_counts)
    np.testing.assert_array_equal(st.expert_ids, st_ref.expert_ids)
  print("OK")


if __name__ == "__main__":
  main()
