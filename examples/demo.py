"""End-to-end sonic_jax demo: forward and backward of one MoE layer, on whatever device JAX has.

  python examples/demo.py                       # small problem, runs on a CPU in seconds
  python examples/demo.py --tokens=32768 --d=4096 --n=512 --experts=128 --top_k=8 --dtype=bfloat16
"""

from __future__ import annotations

import time

from absl import app, flags, logging
import jax
import jax.numpy as jnp

import sonic_jax

flags.DEFINE_integer("tokens", 2048, "T, tokens in the batch")
flags.DEFINE_integer("d", 256, "d, hidden size")
flags.DEFINE_integer("n", 128, "n, expert intermediate size")
flags.DEFINE_integer("experts", 16, "E, number of experts")
flags.DEFINE_integer("top_k", 4, "K, experts per token")
flags.DEFINE_enum("activation", "swiglu", sorted(sonic_jax.ACTIVATIONS), "expert activation")
flags.DEFINE_enum("routing", "softmax_topk", list(sonic_jax.ROUTINGS), "router")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "compute dtype")
flags.DEFINE_enum("backend", "auto", list(sonic_jax.BACKENDS), "sonic_jax backend")
flags.DEFINE_integer("steps", 5, "timed forward+backward steps")
FLAGS = flags.FLAGS


def main(_):
  logging.set_verbosity(logging.WARNING)  # absl's INFO default would print JAX's backend probing
  T, d, n, E, K = FLAGS.tokens, FLAGS.d, FLAGS.n, FLAGS.experts, FLAGS.top_k
  dtype = jnp.dtype(FLAGS.dtype)
  glu = sonic_jax.ACTIVATIONS[FLAGS.activation].is_glu
  keys = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(keys[0], (T, d), dtype)
  router_weight = jax.random.normal(keys[1], (d, E), jnp.float32) / d**0.5
  w1 = (jax.random.normal(keys[2], (E, d, (2 if glu else 1) * n)) / d**0.5).astype(dtype)
  w2 = (jax.random.normal(keys[3], (E, n, d)) / n**0.5).astype(dtype)
  d_y = jax.random.normal(keys[4], (T, d), dtype)

  @jax.jit
  def step(x, router_weight, w1, w2):
    def loss(x, router_weight, w1, w2):
      y, aux = sonic_jax.moe(x, router_weight, w1, w2, top_k=K, activation=FLAGS.activation,
                             routing=FLAGS.routing, backend=FLAGS.backend)
      main_loss = jnp.vdot(y.astype(jnp.float32), d_y.astype(jnp.float32)) / T
      return main_loss + 0.01 * aux.load_balance_loss + 1e-3 * aux.z_loss, (y, aux)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, router_weight, w1, w2)

  print(f"sonic_jax {sonic_jax.__version__} on {jax.devices()[0].device_kind} "
        f"({jax.default_backend()}), backend={FLAGS.backend}")
  print(f"T={T} d={d} n={n} E={E} K={K} activation={FLAGS.activation} routing={FLAGS.routing} "
        f"dtype={dtype.name}")
  t0 = time.perf_counter()
  (loss, (y, aux)), grads = jax.block_until_ready(step(x, router_weight, w1, w2))
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(FLAGS.steps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(x, router_weight, w1, w2))
    times.append(time.perf_counter() - t0)
  times.sort()
  median = times[len(times) // 2]
  flops = 3 * (6 if glu else 4) * T * K * d * n  # forward + backward, the paper's count

  norm = lambda a: float(jnp.linalg.norm(a.astype(jnp.float32)))
  print(f"output norm        {norm(y):.4f}")
  for name, g in zip(("x", "router_weight", "w1", "w2"), grads):
    print(f"grad norm {name:<15}{norm(g):.4f}")
  print(f"expert counts      {aux.expert_counts.tolist()}")
  print(f"load balance loss  {float(aux.load_balance_loss):.4f}   z loss {float(aux.z_loss):.4f}")
  print(f"first step (compile + run) {compile_s:.2f} s; fwd+bwd median of {FLAGS.steps}: "
        f"{median * 1e3:.2f} ms ({flops / median / 1e12:.3f} TFLOP/s)")


if __name__ == "__main__":
  app.run(main)
