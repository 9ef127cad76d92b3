r"""Token rounding against plain top-K: padding removed and grouped-GEMM kernel time.

  python -m benchmarks.token_rounding_bench [--thiek=T,d,n,E,K ...] [--backend=auto] [--out=dir]
  python -m benchmarks.token_rounding_bench --grid=tiny --backend=xla     # a CPU run

On a GPU machine: `PYTHONPATH=$PWD python3 -m benchmarks.token_rounding_bench --out=$OUT` (about
3 minutes on an H100); it writes $OUT/<device>_<date>_token_rounding.json for benchmarks/results/.

For each configuration and routing (top-K, then each token-rounding mode): the (token, expert) pairs
after routing, the padding rows of the tile-aligned layout, the time of the expert GEMMs alone
(up-projection with its activation and down-projection on the routing's layout: the paper's "kernel
execution time"), of the routing as the layer runs it (router GEMM and top-K, one kernel where the
layer fuses them; rounding; layout), of the layer's forward and of its training step (forward and
backward: the gradients of x, the router and the expert weights for a random output gradient).
TFLOP/s count the pairs actually computed, as SonicMoE's token-rounding benchmark does. Each of the
four times every routing in alternating rounds (`benchmarks.timing.time_interleaved`), so a speed-up
to top-K compares samples taken side by side rather than runs timed one after the other. The default
configurations: the paper's token-rounding shape (16384, 4096, 1024, 256, 8), that shape at E = 128
and 512, and four of the grid's with E/K = 16 ((32768, 4096, 256 and 512, 256, 16), (40960, 768,
256, 128, 8), (24576, 1536, 256, 128, 8)).
--sample_ms sets a sample's length (25 ms, as every one-GPU interleaved table; 400 ms measures the
GPU under sustained load). --kernel_trace adds each routing's route+layout kernels and
training-step kernels (device us per call); --role_times times each GEMM role alone on each
routing's layout (up-projection, down-projection, dH, dX, the two weight gradients) on random
operands, which says where the training step's speed-up goes.
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp

import sonic_jax
from benchmarks import grid, report, timing
from sonic_jax import activations as acts
from sonic_jax import routing as routing_lib
from sonic_jax.backends import resolve_backend
from sonic_jax.layout import build_grouped_layout

DEFAULT_CONFIGS = [(16384, 4096, 1024, 256, 8), (16384, 4096, 1024, 128, 8),
                   (16384, 4096, 1024, 512, 8), (32768, 4096, 256, 256, 16),
                   (32768, 4096, 512, 256, 16), (40960, 768, 256, 128, 8),
                   (24576, 1536, 256, 128, 8)]

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: the tests call main in their process
  flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
  flags.DEFINE_enum("grid", "default", ["default", "tiny"], "configurations without --thiek")
  flags.DEFINE_string("backend", "auto", "sonic_jax backend")
  flags.DEFINE_list("modes", list(routing_lib.TOKEN_ROUNDINGS), "token-rounding modes to compare")
  flags.DEFINE_enum("data", "sonicmoe", list(grid.DATA_SCALES),
                    "input scales (grid.random_problem)")
  flags.DEFINE_integer("repeats", 10, "timed samples per measurement (median reported)")
  flags.DEFINE_float("sample_ms", 25.0, "back-to-back calls per sample, in ms (the tables' 25; "
                     "several hundred time the GPU under sustained load, where top-K's step slows "
                     "more than rounding's: docs/design.md, \"Token rounding\")")
  flags.DEFINE_bool("kernel_trace", False, "each routing's route+layout and training-step kernels "
                    "from profiler traces")
  flags.DEFINE_bool("role_times", False, "each GEMM role alone on each routing's layout")
  flags.DEFINE_string("out", "bench_out", "output folder")


def _time(fn, *args):
  return timing.time_fn(fn, *args, repeats=FLAGS.repeats)


def role_times(impl, act, x, w1, w2, d_y, layout):
  """ms of each GEMM role alone on `layout`, through the backend's entry points; the grouped
  operands (A, dH, H) 0.2 N(0, 1) (SonicMoE's benchmark's scale), zero on padding rows."""
  n = w2.shape[1]
  valid = layout.row_valid()
  keys = jax.random.split(jax.random.key(1), 3)
  rows = lambda key, width: jnp.where(valid[:, None], 0.2 * jax.random.normal(
      key, (layout.num_rows, width)), 0).astype(x.dtype)
  a, d_h, h = rows(keys[0], n), rows(keys[1], 2 * n), rows(keys[2], 2 * n)
  scores = jnp.where(valid, 0.1, 0.0).astype(jnp.float32)
  # The layout and scores are arguments, as in the layer, not constants of the timed program.
  calls = {
      "up": (lambda x, w1, lay: impl.up_projection(x, w1, None, lay, act, "concat"),
             (x, w1, layout)),
      "down": (lambda a, w2, lay: impl.down_projection(a, w2, None, lay), (a, w2, layout)),
      "dh": (lambda d_y, h, s, w2, lay: impl.dh_projection(d_y, h, s, w2, None, lay, act,
                                                           "concat"), (d_y, h, scores, w2, layout)),
      "dx": (lambda d_h, w1, lay: impl.dx_projection(d_h, w1, lay), (d_h, w1, layout)),
      "weight_grads": (lambda x, d_y, d_h, a, s, lay: impl.weight_grads(
          x, d_y, None, d_h, a, s, lay, with_b1=False, with_b2=False)[:2],
                       (x, d_y, d_h, a, scores, layout)),
  }
  assert tuple(calls) == report.ROLES
  return {role: _time(fn, *args) * 1e3 for role, (fn, args) in calls.items()}


def run_config(cfg, impl):
  _, d, n, e, k = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, d_y = grid.random_problem(cfg, data=FLAGS.data)
  out = {"config": list(cfg), "row_tile": impl.row_tile, "routings": []}
  modes = [None] + FLAGS.modes
  measured = {}  # mode -> {measure: (fn, args)}
  for mode in modes:

    def route(x, rw, mode=mode):  # as `sonic_jax.moe` routes and lays out its pairs
      logits, ids = routing_lib.router_logits_and_ids(x, rw, k, "softmax_topk")
      r, _ = routing_lib.route_tokens(logits, k, "softmax_topk", None, mode, impl.row_tile, ids)
      if mode is None:
        return build_grouped_layout(r.expert_ids, e, impl.row_tile)
      return build_grouped_layout(r.expert_ids, e, impl.row_tile, r.extra_tokens, r.extra_experts,
                                  extras_by_expert=True)

    def gemms(x, w1, w2, layout):
      _, a = impl.up_projection(x, w1, None, layout, act, "concat")
      return impl.down_projection(a, w2, None, layout)

    def layer(x, rw, w1, w2, mode=mode):
      return sonic_jax.moe(x, rw, w1, w2, top_k=k, token_rounding=mode, backend=impl.name)[0]

    layout = jax.jit(route)(x, rw)
    measured[mode] = {"layout": layout, "route": (route, (x, rw)),
                      "gemm": (gemms, (x, w1, w2, layout)), "forward": (layer, (x, rw, w1, w2)),
                      "step": (timing.forward_and_backward(layer), (x, rw, w1, w2, d_y))}
  # Each measure times every routing in alternating rounds (`timing.time_interleaved`), so that
  # the ratios to top-K do not carry the drift between separately timed runs.
  seconds = {mode: {} for mode in modes}
  sample_s = FLAGS.sample_ms / 1e3
  max_inner = round(200 * max(sample_s / 0.025, 1))  # time_interleaved's cap, scaled with samples
  for measure in ("gemm", "route", "forward", "step"):
    calls = {}
    for mode in modes:
      fn, args = measured[mode][measure]
      calls[mode] = (timing.compile_fn(fn, *args)[0], args)
    for mode, (t, _) in timing.time_interleaved(calls, repeats=FLAGS.repeats,
                                                min_sample_s=sample_s,
                                                max_inner=max_inner).items():
      seconds[mode][measure] = t
  for mode in modes:
    layout = measured[mode]["layout"]
    pairs = int(jnp.sum(layout.expert_counts))
    rows = int(layout.num_tiles) * impl.row_tile
    flops = 6 * pairs * d * n
    t = seconds[mode]
    roles = role_times(impl, act, x, w1, w2, d_y, layout) if FLAGS.role_times else {}
    kernels, step_kernels = {}, {}
    if FLAGS.kernel_trace:
      for name, part, top in (("route", kernels, 20), ("step", step_kernels, 40)):
        fn, args = measured[mode][name]
        part.update(timing.kernel_times(timing.compile_fn(fn, *args)[0], args, top=top))
    out["routings"].append({
        "routing": "top-K" if mode is None else f"token rounding ({mode})",
        "pairs": pairs, "rows": rows, "padding_fraction": (rows - pairs) / max(pairs, 1),
        "gemm_ms": t["gemm"] * 1e3, "gemm_tflops": flops / t["gemm"] / 1e12,
        "route_layout_ms": t["route"] * 1e3, "forward_ms": t["forward"] * 1e3,
        "forward_tflops": flops / t["forward"] / 1e12, "step_ms": t["step"] * 1e3,
        "step_tflops": 3 * flops / t["step"] / 1e12, "role_ms": roles,
        "route_layout_kernels_us": kernels,
        "step_kernels_us": step_kernels})
  base = out["routings"][0]
  for r in out["routings"]:
    r["gemm_speedup"] = base["gemm_ms"] / r["gemm_ms"]
    r["forward_speedup"] = base["forward_ms"] / r["forward_ms"]
    r["route_layout_vs_top_k"] = r["route_layout_ms"] / base["route_layout_ms"]
    r["step_speedup"] = base["step_ms"] / r["step_ms"]
  return out


def main(_):
  configs = grid.parse_configs(FLAGS.thiek,
                               grid.TINY_GRID if FLAGS.grid == "tiny" else DEFAULT_CONFIGS)
  impl = resolve_backend(FLAGS.backend)
  os.makedirs(FLAGS.out, exist_ok=True)
  results = grid.run_record("token_rounding_bench", backend=impl.name, data=FLAGS.data,
                            configs=[])
  path = os.path.join(FLAGS.out, grid.results_name(results, "token_rounding"))
  for cfg in configs:
    results["configs"].append(run_config(cfg, impl))
    with open(path, "w") as f:
      json.dump(results, f, indent=1)
    print(report.token_rounding_table({"configs": results["configs"][-1:]}), flush=True)
    if FLAGS.role_times:
      print(report.token_rounding_roles_table({"configs": results["configs"][-1:]}), flush=True)
    for r in results["configs"][-1]["routings"]:
      for part in ("route_layout_kernels_us", "step_kernels_us"):
        for name, us in r[part].items():
          print(f"  {r['routing']:<26} {part[:4]} {us:8.1f} us  {name[:90]}", flush=True)
  print(f"wrote {path}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
