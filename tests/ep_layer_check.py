"""Run in a fresh process with 4 CPU devices (see test_parallel.py): the Flax `MoE` layer with
`expert_parallel_axis` under `jax.shard_map` equals the same layer on one device, output and the
gradients of every parameter."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
from flax import nnx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from sonic_jax.layers import MoE  # noqa: E402


def main():
  kw = dict(d_model=16, num_experts=8, expert_dim=8, top_k=2, use_bias=True, num_shared_experts=1,
            token_rounding="up", backend="xla", init_std=0.3, dtype=jnp.float64,
            param_dtype=jnp.float64)
  single = MoE(**kw, rngs=nnx.Rngs(0))
  sharded = MoE(**kw, expert_parallel_axis="ep", expert_parallel_scheme=sys.argv[1],
                rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 16)))
  d_y = jnp.asarray(np.random.default_rng(2).standard_normal((64, 16)))

  def loss_of(graphdef, run):
    def loss(state, x):
      y, aux = run(graphdef, state, x)
      return jnp.vdot(y, d_y) + aux, y
    return loss

  g1, s1 = nnx.split(single)
  (_, y_ref), grads_ref = jax.value_and_grad(
      loss_of(g1, lambda g, s, x: (lambda y, a: (y, a.loss))(*nnx.merge(g, s)(x))),
      has_aux=True)(s1, x)

  mesh = jax.make_mesh((4,), ("ep",))
  g2, s2 = nnx.split(sharded)
  # Expert parameters (logical axis "expert" first) over the mesh axis, the rest replicated.
  specs = jax.tree.map(lambda p: P("ep") if p and p[0] == "expert" else P(),
                       nnx.get_partition_spec(s2), is_leaf=lambda v: isinstance(v, P))

  def local(state, x):
    y, aux = nnx.merge(g2, state)(x)
    return y, aux.loss

  run = jax.shard_map(local, mesh=mesh, in_specs=(specs, P("ep")), out_specs=(P("ep"), P()),
                      check_vma=False)
  placed = jax.tree.map(lambda a, p: jax.device_put(a, jax.NamedSharding(mesh, p)), s2, specs)
  x_placed = jax.device_put(x, jax.NamedSharding(mesh, P("ep")))
  (_, y), grads = jax.jit(jax.value_and_grad(loss_of(g2, lambda g, s, x: run(s, x)),
                                             has_aux=True))(placed, x_placed)
  rel = lambda a, b: float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(b))
  errs = {"y": rel(y, y_ref)}
  for (path, g), (_, g_ref) in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves_with_path(grads_ref)):
    errs[jax.tree_util.keystr(path)] = rel(g, g_ref)
  print(errs)
  assert len(errs) == 1 + 7 and max(errs.values()) < 1e-10, errs
  print("OK")


if __name__ == "__main__":
  main()
