r"""The routing-metadata pass piece by piece: router logits, top-K routing, grouped layout.

  python -m benchmarks.layout_bench [--thiek=T,d,n,E,K ...] [--baseline_layout=path/to/layout.py]
      [--trace] [--layer_backend=mosaic_gpu]

For each configuration (default: the paper's grid), median ms of: the router GEMM, `route`
(top-K selection and scores), `build_grouped_layout` with the backend's row tile (128), and all
three together; the top-K selection alone (XLA's and, on a GPU, the Pallas kernel at several block
sizes). Then each layout method (`build_grouped_layout(method=...)`: "sort", and "block_ranks"
where it applies) alone and inside the layer's forward (`sonic_jax.moe` on --layer_backend), timed
in interleaved rounds and checked to give the same layout; with --trace, the kernels of the
route+layout step and of each method's layout pass with their device times. With
--baseline_layout (repeatable), the same layout pass from other versions of sonic_jax/layout.py
(A/B comparison, e.g. `git show HEAD~1:sonic_jax/layout.py > /tmp/old.py`), each checked to give
the same layout.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.util
import json
import os
import statistics
import sys

from absl import app, flags
import jax
import jax.numpy as jnp

import sonic_jax
from benchmarks import grid, timing
from sonic_jax import layout as layout_lib
from sonic_jax import ops, routing
from sonic_jax.layout import build_grouped_layout
from sonic_jax.pallas import layout_ranks, router_topk

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_multi_string("baseline_layout", None, "layout.py files to compare against")
flags.DEFINE_integer("repeats", 10, "timed samples (median reported)")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_bool("trace", False, "also list every kernel of route+layout with its device time "
                  "(profiler trace)")
flags.DEFINE_string("layer_backend", "mosaic_gpu", "backend of the layer forward timed with each "
                    "layout method (empty: skip the layer)")
FLAGS = flags.FLAGS
ROW_TILE = 128


@contextlib.contextmanager
def _layout_method(method, build=build_grouped_layout):
  """The layer (`sonic_jax.moe`) traced with `build(method=method)` as its layout."""
  saved = ops.build_grouped_layout
  ops.build_grouped_layout = functools.partial(build, method=method)
  try:
    yield
  finally:
    ops.build_grouped_layout = saved


def compare_methods(cfg, x, rw, ids, baselines=None):
  """Each applicable layout method alone and in the layer's forward, interleaved rounds; also the
  layer's forward with each baseline layout.py ("auto" method)."""
  _, _, _, e, k = cfg
  on_gpu = jax.default_backend() == "gpu"
  methods = ["sort"] + (["block_ranks"] if on_gpu and layout_lib.block_ranks_unsupported(ids, e) is None
                        else [])
  calls = {}
  for m in methods:
    calls[f"layout {m}"] = (timing.compile_fn(
        lambda i, m=m: build_grouped_layout(i, e, ROW_TILE, method=m), ids)[0], [(ids,)])
  layouts = {m: calls[f"layout {m}"][0](ids) for m in methods}
  if FLAGS.layer_backend:
    _, _, w1, w2, _ = grid.random_problem(cfg)
    forwards = {f"forward {m}": (m, build_grouped_layout) for m in methods}
    forwards.update({f"forward baseline {name}": ("auto", baseline.build_grouped_layout)
                     for name, baseline in (baselines or {}).items()})
    for name, (method, build) in forwards.items():
      with _layout_method(method, build):
        calls[name] = (timing.compile_fn(
            lambda *a: sonic_jax.moe(*a, top_k=k, backend=FLAGS.layer_backend)[0],
            x, rw, w1, w2)[0], [(x, rw, w1, w2)])
  # Rounds in both orders: a GPU that heats during one function's batch slows the next one, which
  # in a fixed order is always the same (d = 4096 forwards read 3% apart that way).
  forward = timing.time_interleaved(calls, repeats=FLAGS.repeats)
  backward = timing.time_interleaved(dict(reversed(calls.items())), repeats=FLAGS.repeats)
  out = {"methods_ms": {name: statistics.median(forward[name][1] + backward[name][1]) * 1e3
                        for name in calls},
         "same_layout": all(bool(jnp.array_equal(u, v)) for m in methods
                            for u, v in zip(layouts[m], layouts["sort"]))}
  if FLAGS.trace:
    out["layout_kernels_us"] = {m: timing.kernel_times(calls[f"layout {m}"][0], (ids,), top=None)
                                for m in methods}
    if FLAGS.layer_backend:
      out["forward_kernels_us"] = {m: timing.kernel_times(calls[f"forward {m}"][0],
                                                          calls[f"forward {m}"][1][0], top=None)
                                   for m in methods}
  return out


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
  if jax.default_backend() == "gpu" and layout_lib.block_ranks_unsupported(ids, e) is None:
    # The block-rank kernel alone at several block sizes: device time from a profiler trace (a
    # wall-clock time of this one small kernel would be mostly launch overhead).
    res["block_ranks_kernel_us"] = {
        v: sum(us for _, us in timing.kernel_times(timing.compile_fn(
            lambda i, v=v: layout_ranks.block_ranks(i, e, values_per_program=v), ids)[0],
            (ids,), top=None))
        for v in (2048, 4096, 8192)}
  res.update(compare_methods(cfg, x, rw, ids, baselines))
  res["baselines"] = {}
  for name, baseline in baselines.items():
    fn = lambda i, b=baseline: b.build_grouped_layout(i, e, ROW_TILE)
    a = jax.jit(lambda i: build_grouped_layout(i, e, ROW_TILE))(ids)
    same = all(bool(jnp.array_equal(u, v)) for u, v in zip(a, jax.jit(fn)(ids)))
    res["baselines"][name] = {"layout_ms": time(fn, ids), "same_layout": same}
    if FLAGS.trace:  # its layout pass's kernels and their device time
      kernels = timing.kernel_times(timing.compile_fn(fn, ids)[0], (ids,), top=None)
      res["baselines"][name]["layout_kernels_us"] = kernels
      print(f"  baseline {os.path.basename(name)} layout: {len(kernels)} kernels, "
            f"{sum(u for _, u in kernels):.1f} us", flush=True)
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
    if "block_ranks_kernel_us" in r:
      print("  block-rank kernel (device us by values per program): " + ", ".join(
          f"{v}: {t:.1f}" for v, t in r["block_ranks_kernel_us"].items()), flush=True)
    print("  methods (interleaved): " + ", ".join(
        f"{name} {ms:.3f} ms" for name, ms in r["methods_ms"].items())
        + f"; same layout: {r['same_layout']}", flush=True)
    for name, us in r.get("route_and_layout_kernels_us", []):
      print(f"    {us:8.1f} us  {name[:90]}", flush=True)
    for method, kernels in r.get("layout_kernels_us", {}).items():
      print(f"  layout {method}: {len(kernels)} kernels, {sum(u for _, u in kernels):.1f} us")
      for name, us in kernels:
        print(f"    {us:8.1f} us  {name[:90]}", flush=True)
    for method, kernels in r.get("forward_kernels_us", {}).items():
      print(f"  forward {method}: {len(kernels)} kernels, {sum(u for _, u in kernels):.1f} us; "
            "longest: " + ", ".join(f"{name[:40]} {us:.1f}" for name, us in kernels[:8]))
  with open(os.path.join(FLAGS.out, "layout.json"), "w") as f:
    json.dump({"jax": jax.__version__, "device": jax.devices()[0].device_kind,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": "python -m benchmarks.layout_bench " + " ".join(sys.argv[1:]),
               "results": results}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
