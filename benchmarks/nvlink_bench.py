r"""The all-gather of expert parallelism's token rows: NCCL (`jax.lax.all_gather`) against the
Mosaic GPU peer copies of `sonic_jax.mosaic_gpu.peer_copy` (TMA over NVLink, pull and push).

  python -m benchmarks.nvlink_bench [--rows=16384,8192] [--d=4096] [--num_blocks=8,16,32]
      [--out=dir]

On a host of P >= 2 GPUs (all of `jax.devices()`). For each per-device row count: every variant's
output is checked bit for bit against NCCL's, then timed (median of interleaved samples after
warm-up, `benchmarks.timing`); GB/s is the bytes each device receives, (P - 1) * rows * d * 2,
over the time. Writes DIR/<device>x<P>_<date>_nvlink.json and prints a table.
"""

from __future__ import annotations

import functools
import json
import os

from absl import app, flags
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import grid, timing
from sonic_jax.mosaic_gpu import peer_copy

flags.DEFINE_list("rows", ["16384", "8192"], "rows per device (T_local)")
flags.DEFINE_integer("d", 4096, "row width")
flags.DEFINE_list("num_blocks", ["8", "16", "32"], "CTAs of the peer-copy kernels")
flags.DEFINE_integer("repeats", 10, "timed samples per variant (median reported)")
flags.DEFINE_string("out", "bench_out", "output folder")
FLAGS = flags.FLAGS


def variants(mesh, num_blocks):
  """{name: jitted all-gather of a (P * rows, d) array sharded over "ep"}."""
  gather = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                                            check_vma=False))
  calls = {"nccl": gather(lambda x: lax.all_gather(x, "ep", tiled=True))}
  for mode in peer_copy.MODES:
    for blocks in num_blocks:
      calls[f"{mode} {blocks} CTAs"] = gather(functools.partial(
          peer_copy.all_gather, axis="ep", mode=mode, num_blocks=blocks))
  return calls


def main(_):
  devices = jax.devices()
  p = len(devices)
  if p < 2:
    raise SystemExit(f"nvlink_bench needs at least 2 devices, found {p}")
  mesh = jax.make_mesh((p,), ("ep",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Explicit,))
  results = []
  for rows in map(int, FLAGS.rows):
    x = jax.device_put(
        jax.random.normal(jax.random.key(rows), (p * rows, FLAGS.d), jnp.bfloat16),
        NamedSharding(mesh, P("ep")))
    calls = variants(mesh, [int(b) for b in FLAGS.num_blocks])
    compiled, errors = {}, {}
    want = None
    for name, fn in calls.items():
      try:
        compiled[name] = (timing.compile_fn(fn, x)[0], (x,))
        got = np.asarray(compiled[name][0](x))
      except Exception as e:  # a variant that fails is reported, not fatal
        errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
        compiled.pop(name, None)
        continue
      if want is None:
        want = got
      elif not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
        errors[name] = "output differs from NCCL's all-gather"
        compiled.pop(name)
    times = timing.time_interleaved(compiled, repeats=FLAGS.repeats)
    received = (p - 1) * rows * FLAGS.d * 2
    for name in calls:
      row = {"rows": rows, "d": FLAGS.d, "variant": name}
      if name in times:
        row.update(ms=times[name][0] * 1e3, gbps=received / times[name][0] / 1e9)
      else:
        row["error"] = errors[name]
      results.append(row)
  print("| rows per device | d | variant | ms | GB/s received per device |\n|---|---|---|---|---|")
  for r in results:
    cells = (f"{r['ms']:.3f} | {r['gbps']:.0f}" if "ms" in r else f"– | {r['error']}")
    print(f"| {r['rows']} | {r['d']} | {r['variant']} | {cells} |")
  os.makedirs(FLAGS.out, exist_ok=True)
  record = grid.run_record("nvlink_bench", devices, results=results)
  path = os.path.join(FLAGS.out, grid.results_name(record, "nvlink"))
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
