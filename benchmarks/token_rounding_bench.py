r"""Token rounding against plain top-K: padding removed and grouped-GEMM kernel time.

  python -m benchmarks.token_rounding_bench [--thiek=T,d,n,E,K ...] [--backend=auto] [--out=dir]

For each configuration and routing (top-K, then each token-rounding mode): the (token, expert) pairs
after routing, the padding rows of the tile-aligned layout, the time of the expert GEMMs alone (up-
projection with its activation epilogue and down-projection, on the routing's layout: what the
paper's "kernel execution time" compares), of the routing metadata (router, top-K, rounding,
layout), and of the whole layer's forward. TFLOP/s count the pairs actually computed, as SonicMoE's
token-rounding benchmark does. The default configurations are the grid's high-sparsity ones and
the paper's token-rounding benchmark shape (16384, 4096, 1024, 256, 8).
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import sonic_jax
from benchmarks import grid, timing
from sonic_jax import activations as acts
from sonic_jax import routing as routing_lib
from sonic_jax.backends import resolve_backend
from sonic_jax.layout import build_grouped_layout

DEFAULT_CONFIGS = [(16384, 4096, 1024, 256, 8), (32768, 4096, 256, 256, 16),
                   (32768, 4096, 512, 256, 16), (40960, 768, 256, 128, 8),
                   (24576, 1536, 256, 128, 8)]

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_enum("grid", "default", ["default", "tiny"], "configurations when --thiek is not given")
flags.DEFINE_string("backend", "auto", "sonic_jax backend")
flags.DEFINE_list("modes", list(routing_lib.TOKEN_ROUNDINGS), "token-rounding modes to compare")
flags.DEFINE_integer("repeats", 10, "timed samples per measurement (median reported)")
flags.DEFINE_string("out", "bench_out", "output folder")
FLAGS = flags.FLAGS


def _time(fn, *args):
  return timing.time_fn(fn, *args, repeats=FLAGS.repeats)


def run_config(cfg, impl):
  t_count, d, n, e, k = cfg
  act = acts.get_activation("swiglu")
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (t_count, d), dtype)
  rw = jax.random.normal(keys[1], (d, e), jnp.float32) / np.sqrt(d)
  w1 = (jax.random.normal(keys[2], (e, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(dtype)
  w2 = (jax.random.normal(keys[3], (e, n, d), jnp.float32) / np.sqrt(n)).astype(dtype)
  out = {"config": list(cfg), "row_tile": impl.row_tile, "routings": []}
  for mode in [None] + FLAGS.modes:

    def route(x, rw, mode=mode):
      routed = routing_lib.route(routing_lib.router_logits(x, rw), k, "softmax_topk")
      if mode is None:
        return build_grouped_layout(routed.expert_ids, e, impl.row_tile)
      r = routing_lib.round_tokens(routed, impl.row_tile, mode)
      return build_grouped_layout(r.expert_ids, e, impl.row_tile, r.extra_tokens, r.extra_experts)

    def gemms(x, w1, w2, layout):
      _, a = impl.up_projection(x, w1, None, layout, act, "concat")
      return impl.down_projection(a, w2, None, layout)

    def layer(x, rw, w1, w2, mode=mode):
      return sonic_jax.moe(x, rw, w1, w2, top_k=k, token_rounding=mode, backend=impl.name)[0]

    layout = jax.jit(route)(x, rw)
    pairs = int(jnp.sum(layout.expert_counts))
    rows = int(layout.num_tiles) * impl.row_tile
    flops = 6 * pairs * d * n
    t_gemm, t_route, t_layer = _time(gemms, x, w1, w2, layout), _time(route, x, rw), _time(
        layer, x, rw, w1, w2)
    out["routings"].append({
        "routing": "top-K" if mode is None else f"token rounding ({mode})",
        "pairs": pairs, "rows": rows, "padding_fraction": (rows - pairs) / max(pairs, 1),
        "gemm_ms": t_gemm * 1e3, "gemm_tflops": flops / t_gemm / 1e12,
        "route_layout_ms": t_route * 1e3, "forward_ms": t_layer * 1e3,
        "forward_tflops": flops / t_layer / 1e12})
  base = out["routings"][0]
  for r in out["routings"]:
    r["gemm_speedup"] = base["gemm_ms"] / r["gemm_ms"]
    r["forward_speedup"] = base["forward_ms"] / r["forward_ms"]
  return out


def table(results):
  lines = ["| config (T,d,n,E,K) | routing | pairs | padding rows | expert GEMMs ms (TF/s) | "
           "speed-up vs top-K | route+layout ms | layer forward ms (TF/s) | speed-up vs top-K |",
           "|---|---|---|---|---|---|---|---|---|"]
  for res in results["configs"]:
    for r in res["routings"]:
      lines.append(
          f"| {','.join(map(str, res['config']))} | {r['routing']} | {r['pairs']} | "
          f"{100 * r['padding_fraction']:.1f}% | {r['gemm_ms']:.3f} ({r['gemm_tflops']:.0f}) | "
          f"{r['gemm_speedup']:.3f}× | {r['route_layout_ms']:.3f} | "
          f"{r['forward_ms']:.3f} ({r['forward_tflops']:.0f}) | {r['forward_speedup']:.3f}× |")
  return "\n".join(lines)


def main(_):
  configs = grid.parse_configs(FLAGS.thiek,
                               grid.TINY_GRID if FLAGS.grid == "tiny" else DEFAULT_CONFIGS)
  impl = resolve_backend(FLAGS.backend)
  os.makedirs(FLAGS.out, exist_ok=True)
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "backend": impl.name, "command": "python -m benchmarks.token_rounding_bench",
             "configs": []}
  for cfg in configs:
    results["configs"].append(run_config(cfg, impl))
    with open(os.path.join(FLAGS.out, "token_rounding.json"), "w") as f:
      json.dump(results, f, indent=1)
    print(table({"configs": results["configs"][-1:]}), flush=True)
  with open(os.path.join(FLAGS.out, "token_rounding.md"), "w") as f:
    f.write(table(results) + "\n")


if __name__ == "__main__":
  app.run(main)
