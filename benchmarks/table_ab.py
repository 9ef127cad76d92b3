r"""The layer under two tuning tables, side by side: its forward and its training step compiled
with each table's kernel configurations and timed in interleaved rounds in one process (a
table change measured as the layer runs it, not kernel by kernel).

  python -m benchmarks.table_ab --tables=before.json,after.json [--thiek=T,d,n,E,K ...]
      [--gate_up_layout=concat] [--wait_all_first] [--do_bench [--do_bench_rounds=R]]
      [--data=unit|sonicmoe] [--out=dir]

Each table is a file in `tuned_configs.json`'s format ("packaged" names the package's own). Every
configuration's outputs under each table are checked against the first table's (the tuned
kernels must agree bit for bit up to dS's float32 summation order: checked to 1e-5 relative).
Prints ms per call and the ratio to the first table; writes `out/table_ab.json`. Needs a GPU.
--wait_all_first adds each table again with the epilogues' store rule of before the twenty-first
session (`epilogue.store_tiles(..., wait_all_first=True)`: each tile's stores first wait for all
of the previous tile's), so that one table suffices to A/B the rule.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import time
from unittest import mock

from absl import app, flags
import jax
import numpy as np

import sonic_jax
from benchmarks import grid, timing
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu import tuning

flags.DEFINE_list("tables", None, "tuning tables to compare (paths, or 'packaged')")
flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_enum("gate_up_layout", "concat", ["concat", "interleaved"], "w1's gate/up layout")
flags.DEFINE_enum("data", "unit", list(grid.DATA_SCALES), "input scales (grid.random_problem)")
flags.DEFINE_integer("repeats", 10, "timed samples per function")
flags.DEFINE_string("backend", "mosaic_gpu", "sonic_jax backend (another than mosaic_gpu reads no "
                    "table: a CPU smoke run)")
flags.DEFINE_bool("do_bench", False, "also time every function as SonicMoE's anchors were timed "
                  "(`timing.time_do_bench`: a 200 ms burst of calls after L2 flushes), one after "
                  "the other, before the interleaved rounds")
flags.DEFINE_integer("do_bench_rounds", 1, "with --do_bench: bursts per function, in rounds "
                     "that alternate the order (reversed every other round), each after "
                     "--do_bench_idle_s idle; "
                     "the median over rounds (a burst's median lands on one of a few clock "
                     "plateaus, so one burst each is noisy)")
flags.DEFINE_float("do_bench_idle_s", 2.0, "idle seconds before each burst with --do_bench_rounds "
                   "above 1 (a burst starts from a cool GPU, as SonicMoE's did)")
flags.DEFINE_bool("wait_all_first", False, "also each table with the epilogues' store rule of "
                  "before (store_tiles(..., wait_all_first=True))")
flags.DEFINE_string("out", "bench_out", "output folder")
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(32768, 4096, 1024, 128, 8), (32768, 4096, 256, 256, 16)]


def _entries(spec):
  if spec == "packaged":
    return None
  with open(spec) as f:
    return tuning.validate(json.load(f)["entries"])


def run_config(cfg, tables):
  args = grid.random_problem(cfg, data=FLAGS.data)
  fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4], backend=FLAGS.backend,
                                            gate_up_layout=FLAGS.gate_up_layout)[0]
  calls, outputs = {}, {}
  for name, (entries, store) in tables.items():
    tuning.set_table(entries)  # before tracing: a compiled function keeps its configurations
    try:
      patch = mock.patch.object(epi, "store_tiles", store) if store else contextlib.nullcontext()
      with patch:
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
  bursts = {name: [] for name in calls} if FLAGS.do_bench else {}
  for r in range(FLAGS.do_bench_rounds if FLAGS.do_bench else 0):
    for name in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
      if FLAGS.do_bench_rounds > 1:
        time.sleep(FLAGS.do_bench_idle_s)
      bursts[name].append(timing.time_do_bench(*calls[name])[0] * 1e3)
  do_bench = {name: statistics.median(v) for name, v in bursts.items()}
  times = timing.time_interleaved(calls, repeats=FLAGS.repeats)
  return {"config": list(cfg), "agree": agree, "do_bench_ms": do_bench, "do_bench_rounds_ms": bursts,
          "ms": {name: t * 1e3 for name, (t, _) in times.items()},
          "samples_ms": {name: [v * 1e3 for v in s] for name, (_, s) in times.items()}}


def main(_):
  if not FLAGS.tables or len(FLAGS.tables) < (1 if FLAGS.wait_all_first else 2):
    raise SystemExit("table_ab: --tables needs at least two tables (one with --wait_all_first)")
  tables = {}
  for spec in FLAGS.tables:
    entries, name = _entries(spec), os.path.basename(spec)
    tables[name] = (entries, None)
    if FLAGS.wait_all_first:
      tables[f"{name} (wait for all first)"] = (
          entries, functools.partial(epi.store_tiles, wait_all_first=True))
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
      ref = f"{first} {name.rsplit(' ', 1)[1]}"  # the first table's row of the same phase
      db = r["do_bench_ms"]
      db = f"   do_bench {db[name]:9.3f} ms  {db[name] / db[ref]:6.3f}" if db else ""
      print(f"  {name:<40} {ms:9.3f} ms  {ms / r['ms'][ref]:6.3f}{db}")


if __name__ == "__main__":
  app.run(main)
