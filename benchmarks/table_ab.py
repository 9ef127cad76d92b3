r"""The layer under two tuning tables, side by side: its forward and its training step compiled
with each table's kernel configurations and timed in interleaved rounds in one process (a
table change measured as the layer runs it, not kernel by kernel).

  python -m benchmarks.table_ab --tables=before.json,after.json [--thiek=T,d,n,E,K ...]
      [--gate_up_layout=concat] [--out=dir]

Each table is a file in `tuned_configs.json`'s format ("packaged" names the package's own). Every
configuration's outputs under each table are checked against the first table's (the tuned
kernels must agree bit for bit up to dS's float32 summation order: checked to 1e-5 relative).
Prints ms per call and the ratio to the first table; writes `out/table_ab.json`. Needs a GPU.
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import numpy as np

import sonic_jax
from benchmarks import grid, timing
from sonic_jax.mosaic_gpu import tuning

flags.DEFINE_list("tables", None, "tuning tables to compare (paths, or 'packaged')")
flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_enum("gate_up_layout", "concat", ["concat", "interleaved"], "w1's gate/up layout")
flags.DEFINE_integer("repeats", 10, "timed samples per function")
flags.DEFINE_string("backend", "mosaic_gpu", "sonic_jax backend (another than mosaic_gpu reads no "
                    "table: a CPU smoke run)")
flags.DEFINE_string("out", "bench_out", "output folder")
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(32768, 4096, 1024, 128, 8), (32768, 4096, 256, 256, 16)]


def _entries(spec):
  if spec == "packaged":
    return None
  with open(spec) as f:
    return tuning.validate(json.load(f)["entries"])


def run_config(cfg, tables):
  args = grid.random_problem(cfg)
  fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4], backend=FLAGS.backend,
                                            gate_up_layout=FLAGS.gate_up_layout)[0]
  calls, outputs = {}, {}
  for name, entries in tables.items():
    tuning.set_table(entries)  # before tracing: a compiled function keeps its configurations
    try:
      c_fwd = timing.compile_fn(fwd, *args[:4])[0]
      c_step = timing.compile_fn(timing.forward_and_backward(fwd), *args)[0]
    finally:
      tuning.set_table(None)
    calls[f"{name} forward"] = (c_fwd, args[:4])
    calls[f"{name} step"] = (c_step, args)
    outputs[name] = [np.asarray(v, np.float32) for v in jax.tree.leaves(c_step(*args))]
  first = next(iter(outputs.values()))
  agree = {name: all(np.allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max() or 1))
                     for a, b in zip(outs, first)) for name, outs in outputs.items()}
  times = timing.time_interleaved(calls, repeats=FLAGS.repeats)
  return {"config": list(cfg), "agree": agree,
          "ms": {name: t * 1e3 for name, (t, _) in times.items()},
          "samples_ms": {name: [v * 1e3 for v in s] for name, (_, s) in times.items()}}


def main(_):
  if not FLAGS.tables or len(FLAGS.tables) < 2:
    raise SystemExit("table_ab: --tables needs at least two tables")
  tables = {os.path.basename(spec): _entries(spec) for spec in FLAGS.tables}
  os.makedirs(FLAGS.out, exist_ok=True)
  results = []
  for cfg in grid.parse_configs(FLAGS.thiek, DEFAULT_CONFIGS):
    results.append(run_config(cfg, tables))
    with open(os.path.join(FLAGS.out, "table_ab.json"), "w") as f:
      json.dump({"tables": FLAGS.tables, "gate_up_layout": FLAGS.gate_up_layout,
                 "configs": results}, f, indent=1)
  first = next(iter(tables))
  for r in results:
    print(f"\n{grid.config_name(tuple(r['config']))} (outputs agree: {r['agree']})")
    for name, ms in r["ms"].items():
      base = r["ms"][f"{first} {name.rsplit(' ', 1)[1]}"]
      print(f"  {name:<40} {ms:9.3f} ms  {ms / base:6.3f}")


if __name__ == "__main__":
  app.run(main)
