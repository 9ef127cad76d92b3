r"""How fast XLA:GPU moves the expert-parallel exchange, under different XLA flags.

  python -m benchmarks.a2a_transport [--rows=65536 --d=4096]

Times, on all devices of the host, at the size of one dispatch (each device sends `rows` bf16 rows
of width d, balanced over the devices): `jax.lax.ragged_all_to_all` through `sonic_jax.exchange`
(checked against the all-gather emulation), and a dense `jax.lax.all_to_all` of the same bytes.
Run it once per XLA_FLAGS setting (benchmarks/a2a_transport.sh) to find the fastest transport.
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import timing
from sonic_jax import exchange

flags.DEFINE_integer("rows", 65536, "rows each device sends")
flags.DEFINE_integer("d", 4096, "row width")
flags.DEFINE_string("label", "default", "name of this XLA_FLAGS setting")
flags.DEFINE_string("out", "bench_out", "output folder (appends to a2a_transport.jsonl)")
FLAGS = flags.FLAGS


def main(_):
  devices = jax.devices()
  p, rows, d = len(devices), FLAGS.rows, FLAGS.d
  mesh = jax.make_mesh((p,), ("ep",), devices=devices)
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("ep")))
  # A skewed but full plan: device i sends rows split unevenly over the receivers.
  rng = np.random.default_rng(0)
  counts = np.zeros((p, p), np.int32)
  for i in range(p):
    split = rng.multinomial(rows, np.full(p, 1 / p))
    counts[i] = split
  plans = [exchange.exchange_plan(jnp.asarray(counts), jnp.int32(me), p * rows)[0]
           for me in range(p)]
  stacked = jax.tree.map(lambda *a: put(jnp.stack(a)), *plans)
  x = put(jax.random.normal(jax.random.key(0), (p * rows, d), jnp.bfloat16))

  def ragged(native):
    def f(v, plan):
      plan = jax.tree.map(lambda a: a[0], plan)
      return exchange.ragged_exchange(v, p * rows, plan, "ep", native=native)
    return jax.shard_map(f, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"),
                         check_vma=False)

  result = {"label": FLAGS.label, "xla_flags": os.environ.get("XLA_FLAGS", ""), "devices": p,
            "rows": rows, "d": d}
  try:
    got = jax.jit(ragged(True))(x, stacked)
    want = jax.jit(ragged(False))(x, stacked)
    result["ragged_matches_emulation"] = bool(jnp.array_equal(got, want))
    t = timing.time_fn(ragged(True), x, stacked, repeats=5, max_inner=20)
    result["ragged_ms"] = t * 1e3
    result["ragged_gbps"] = (p - 1) / p * rows * d * 2 / t / 1e9
  except Exception as e:  # noqa: BLE001 -- report the failing setting, keep the others
    result["ragged_error"] = f"{type(e).__name__}: {str(e)[:300]}"
  dense = jax.shard_map(lambda v: jax.lax.all_to_all(v, "ep", 0, 0, tiled=True), mesh=mesh,
                        in_specs=P("ep"), out_specs=P("ep"), check_vma=False)
  t = timing.time_fn(dense, x, repeats=5, max_inner=20)
  result["dense_ms"] = t * 1e3
  result["dense_gbps"] = (p - 1) / p * rows * d * 2 / t / 1e9
  print(json.dumps(result), flush=True)
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(os.path.join(FLAGS.out, "a2a_transport.jsonl"), "a") as f:
    f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
  app.run(main)
