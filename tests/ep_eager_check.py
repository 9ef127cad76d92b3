"""Run in a fresh process with 4 CPU devices (see test_parallel.py): the expert-parallel Flax layer
called eagerly (no jax.jit) under jax.set_mesh with the default mesh, parameters as constructed
(not placed on the mesh), equals the single-device layer in output and gradients; a mesh that
cannot hold the experts is refused by name."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from sonic_jax.layers import MoE  # noqa: E402


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
  scheme = sys.argv[1]
  mesh = jax.make_mesh((4,), ("ep",))
  x = jax.random.normal(jax.random.key(1), (4, 16, 32))
  single = MoE(32, 8, 16, 2, backend="xla", init_std=0.2, rngs=nnx.Rngs(0))
  y_ref, _ = single(x)
  g_ref = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(single)
  with jax.set_mesh(mesh):
    layer = MoE(32, 8, 16, 2, expert_parallel_axis="ep", expert_parallel_scheme=scheme,
                backend="xla", init_std=0.2, rngs=nnx.Rngs(0))
    y, aux = layer(x)  # eager: called outside jax.jit
    g = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(layer)
    errs = [rel(y, y_ref)] + [rel(getattr(g, k)[...], getattr(g_ref, k)[...])
                              for k in ("router", "w1", "w2")]
    print(scheme, ["%.1e" % e for e in errs])
    assert max(errs) < 1e-5, errs
    assert np.isfinite(float(aux.loss))
    try:
      MoE(32, 6, 16, 2, expert_parallel_axis="ep", backend="xla", rngs=nnx.Rngs(0))(x)
    except ValueError as e:
      assert "num_experts=6" in str(e), e
    else:
      raise AssertionError("6 experts over 4 devices were not refused")
  print("OK")


if __name__ == "__main__":
  main()
