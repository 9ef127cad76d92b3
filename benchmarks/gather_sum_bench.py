r"""The aggregation's gather-sum on the GPU: XLA's gather fusion against the Mosaic GPU kernel
(`sonic_jax.mosaic_gpu.gather_sum`) in a few configurations, weighted (the forward's y) and
unweighted (the backward's dX), by profiler device time; then the layer's forward and training step
under each `mosaic_gpu.backend.AGGREGATION` ("xla", "forward", "kernel"), timed in interleaved
rounds in one process (and as SonicMoE's anchors were, with --do_bench).

  python -m benchmarks.gather_sum_bench [--thiek=T,d,n,E,K ...] [--layer=false] [--do_bench]
      [--data=unit|sonicmoe] [--out=dir]

Every kernel variant's output is checked against XLA's (relative error of the float32 view)
before it is timed; the layer's outputs and gradients under each choice against "xla"'s.
Writes out/gather_sum_bench.json. Needs a GPU.
"""

from __future__ import annotations

import json
import os
from unittest import mock

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import sonic_jax
from benchmarks import grid, timing
from sonic_jax import xla_backend
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import gather_sum as gs

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_bool("layer", True, "also time the layer under each aggregation choice")
flags.DEFINE_bool("do_bench", False, "also time the layer as SonicMoE's anchors were timed")
flags.DEFINE_enum("data", "sonicmoe", list(grid.DATA_SCALES), "input scales (grid.random_problem)")
flags.DEFINE_integer("repeats", 10, "timed samples per layer function")
flags.DEFINE_string("out", "bench_out", "output folder")
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(32768, 4096, 256, 256, 16), (32768, 4096, 1024, 128, 8),
                   (32768, 4096, 1024, 64, 4), (40960, 768, 256, 128, 8),
                   (24576, 1536, 1024, 32, 2)]


def _device_us(fn, args):
  compiled = jax.jit(fn).lower(*args).compile()
  return sum(us for _, us in timing.kernel_times(compiled, args, calls=10, top=None))


def _kernel_variants(d, k):
  """(name, config) of the kernel: the default and pieces of half and twice its width."""
  base = gs.default_config(d, k)
  out = [("kernel (default: %d cols, %d stages)" % (base.block_columns, base.num_stages), base)]
  c = gs.view_columns(d)
  for block in (base.block_columns // 2, base.block_columns * 2):
    if block >= c and block % c == 0 and d % block == 0:
      stages = gs.ring_stages(block, k)
      out.append((f"kernel {block} cols, {stages} stages", gs.GatherSumConfig(block, stages)))
  if base.num_stages > 2:
    out.append((f"kernel {base.block_columns} cols, 2 stages",
                gs.GatherSumConfig(base.block_columns, 2)))
  return out


def _layer(k, choice, step):
  def forward(x, rw, w1, w2):
    return sonic_jax.moe(x, rw, w1, w2, top_k=k, backend="mosaic_gpu")[0]
  fn = timing.forward_and_backward(forward) if step else forward

  def traced(*args):
    with mock.patch.object(mosaic_backend, "AGGREGATION", choice):  # read when traced
      return fn(*args)
  return traced


def run_config(cfg):
  t_count, d, n, e, k = cfg
  x, rw, w1, w2, d_out = grid.random_problem(cfg, data=FLAGS.data)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  key = jax.random.split(jax.random.key(3), 2)
  rows = jax.random.normal(key[0], (layout.num_rows, d), jnp.bfloat16)
  scores = jax.random.uniform(key[1], (t_count, k), jnp.float32)
  result = {"config": list(cfg), "kernels_us": {}}
  for weighted in (True, False):
    w = scores if weighted else None
    xla = lambda r, lay, w=w: xla_backend.gather_sum(r, lay, w, jnp.bfloat16)
    want = np.asarray(jax.jit(xla)(rows, layout), np.float32)
    times = {"xla": _device_us(xla, (rows, layout))}
    for name, config in _kernel_variants(d, k):
      fn = lambda r, ids, w=w, config=config: gs.gather_sum(r, ids, w, jnp.bfloat16, config)
      got = np.asarray(jax.jit(fn)(rows, layout.pair_row), np.float32)
      err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
      if not err < 1e-2:
        name += f" (WRONG: {err:.1e})"
      times[name] = _device_us(fn, (rows, layout.pair_row))
    result["kernels_us"]["weighted" if weighted else "unweighted"] = times
    print(f"{grid.config_name(cfg)} {'weighted' if weighted else 'unweighted'}: "
          + " | ".join(f"{name} {us:.1f}" for name, us in times.items()), flush=True)
  if FLAGS.layer:
    calls, outputs = {}, {}
    for choice in ("xla", "forward", "kernel"):
      for step in (False, True):
        args = (x, rw, w1, w2, d_out) if step else (x, rw, w1, w2)
        name = f"{'step' if step else 'forward'}, {choice}"
        compiled = timing.compile_fn(_layer(k, choice, step), *args)[0]
        calls[name] = (compiled, args)
        if step:
          outputs[choice] = [np.asarray(v, np.float32) for v in jax.tree.leaves(compiled(*args))]
    ref = outputs["xla"]
    result["layer_rel_err"] = {
        choice: max(float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0))
                    for a, b in zip(outs, ref)) for choice, outs in outputs.items()}
    if FLAGS.do_bench:
      result["layer_do_bench_ms"] = {name: timing.time_do_bench(c, a)[0] * 1e3
                                     for name, (c, a) in calls.items()}
    times = timing.time_interleaved(calls, repeats=FLAGS.repeats)
    result["layer_ms"] = {name: t * 1e3 for name, (t, _) in times.items()}
    print(f"{grid.config_name(cfg)} layer (rel. err. against xla: {result['layer_rel_err']}) ms: "
          + " | ".join(f"{name} {v:.3f}" for name, v in result["layer_ms"].items())
          + ("" if not FLAGS.do_bench else " || do_bench: " + " | ".join(
              f"{name} {v:.3f}" for name, v in result["layer_do_bench_ms"].items())), flush=True)
  return result


def main(_):
  os.makedirs(FLAGS.out, exist_ok=True)
  results = []
  for cfg in grid.parse_configs(FLAGS.thiek, DEFAULT_CONFIGS):
    results.append(run_config(cfg))
    with open(os.path.join(FLAGS.out, "gather_sum_bench.json"), "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "data": FLAGS.data, "configs": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
