r"""The routing-metadata pass piece by piece: router logits, top-K routing, grouped layout.

  python -m benchmarks.layout_bench [--thiek=T,d,n,E,K ...] [--baseline_layout=path/to/layout.py]

For each configuration (default: the paper's grid), median ms of: the router GEMM, `route`
(top-K selection and scores), `build_grouped_layout` with the backend's row tile (128), and all
three together; the top-K selection alone (XLA's and, on a GPU, the Pallas kernel at several block
sizes); with --baseline_layout (repeatable), the same layout pass from other versions of
sonic_jax/layout.py (A/B comparison, e.g. `git show HEAD~1:sonic_jax/layout.py > /tmp/old.py`),
each checked to give the same layout.
"""

from __future__ import annotations

import importlib.util
import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks import grid, timing
from sonic_jax import routing
from sonic_jax.layout import build_grouped_layout
from sonic_jax.pallas import router_topk

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_multi_string("baseline_layout", None, "layout.py files to compare against")
flags.DEFINE_integer("repeats", 10, "timed samples (median reported)")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_bool("trace", False, "also list every kernel of route+layout with its device time "
                  "(profiler trace)")
FLAGS = flags.FLAGS
ROW_TILE = 128


def run_config(cfg, baselines):
  _, _, _, e, k = cfg
  x, rw = grid.random_problem(cfg)[:2]
  logits = routing.router_logits(x, rw)
  ids = routing.route(logits, k, "softmax_topk").expert_ids
  time = lambda fn, *a: timing.time_fn(fn, *a, repeats=FLAGS.repeats) * 1e3
  res = {"config": list(cfg),
         "router_logits_ms": time(routing.router_logits, x, rw),
         "route_ms": time(lambda lg: routing.route(lg, k, "softmax_topk"), logits),
         "layout_ms": time(lambda i: build_grouped_layout(i, e, ROW_TILE), ids)}

  whole = grid.route_fn(cfg, ROW_TILE)
  res["route_and_layout_ms"] = time(whole, x, rw)
  if FLAGS.trace:
    res["route_and_layout_kernels_us"] = timing.kernel_times(timing.compile_fn(whole, x, rw)[0],
                                                             (x, rw), top=None)
  # The top-K selection alone: XLA's, and the Pallas kernel at several block sizes.
  res["lax_top_k_ms"] = time(lambda lg: jax.lax.top_k(lg, k), logits)
  if router_topk.supports(logits, k) is None and jax.default_backend() == "gpu":
    res["kernel_top_k_ms"] = {
        v: time(lambda lg, v=v: router_topk.top_k(lg, k, values_per_program=v), logits)
        for v in (1024, 2048, 4096, 8192)}
  res["baselines"] = {}
  for name, baseline in baselines.items():
    fn = lambda i, b=baseline: b.build_grouped_layout(i, e, ROW_TILE)
    a = jax.jit(lambda i: build_grouped_layout(i, e, ROW_TILE))(ids)
    same = all(bool(jnp.array_equal(u, v)) for u, v in zip(a, jax.jit(fn)(ids)))
    res["baselines"][name] = {"layout_ms": time(fn, ids), "same_layout": same}
  return res


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, grid.PAPER_GRID)
  baselines = {}
  for path in FLAGS.baseline_layout or []:
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    baselines[path] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(baselines[path])
  os.makedirs(FLAGS.out, exist_ok=True)
  results = []
  print("| config | logits ms | route ms | layout ms | baseline layouts ms | all ms |")
  for cfg in configs:
    r = run_config(cfg, baselines)
    results.append(r)
    base = ", ".join(f"{os.path.basename(k)} {v['layout_ms']:.3f} (same: {v['same_layout']})"
                     for k, v in r["baselines"].items()) or "–"
    print(f"| {','.join(map(str, cfg))} | {r['router_logits_ms']:.3f} | {r['route_ms']:.3f} | "
          f"{r['layout_ms']:.3f} | {base} | {r['route_and_layout_ms']:.3f} |", flush=True)
    print(f"  top-K: lax {r['lax_top_k_ms']:.3f} ms, kernel "
          + ", ".join(f"{v}: {t:.3f}" for v, t in r.get("kernel_top_k_ms", {}).items()), flush=True)
    for name, us in r.get("route_and_layout_kernels_us", []):
      print(f"    {us:8.1f} us  {name[:90]}", flush=True)
  with open(os.path.join(FLAGS.out, "layout.json"), "w") as f:
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
               "results": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
