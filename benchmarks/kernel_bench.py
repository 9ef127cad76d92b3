r"""Per-kernel timings of the layer's Mosaic GPU kernels against rooflines measured on the GPU.

  python -m benchmarks.kernel_bench [--thiek=T,d,n,E,K ...] [--out=dir]
  PJRT_NPROC=16 python -m benchmarks.kernel_bench --interpret --thiek=256,256,128,4,2 \
      --repeats=1                          # on a CPU (interpret mode: see sonic_jax.interpret)

On a GPU machine `bash benchmarks/gpu_check.sh` runs it on the paper's 12 configurations after the
compiled tests, writing $OUT/<device>_<date>_kernels.json (copy it into benchmarks/results/ for
BENCHMARKS.md's kernel table). --interpret runs the kernels in Mosaic GPU interpret mode (a CPU:
slow, for tiny shapes only).

For each configuration: the routing and layout; the up-projection, which gathers x's rows inside
the kernel, and an XLA gather of those rows alone (what a separate gather would cost); the
down-projection; the forward's weighted gather-sum by XLA and as the backend runs it; then the
backward's kernels: dH, dw1 = x^T dH and dw2 = A_s^T dO (each gathering its rows of x or dO
inside), and dX. Every kernel runs with the configuration the backend gives it
(`mosaic_gpu.backend.role_configs`: the tuning table). A kernel's roofline time is max(FLOPs /
measured dense bf16 GEMM rate, bytes / measured device copy bandwidth).
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp

import sonic_jax
from benchmarks import grid, timing
from sonic_jax import activations as acts
from sonic_jax import xla_backend
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import dh_projection as dh
from sonic_jax.mosaic_gpu import down_projection as down
from sonic_jax.mosaic_gpu import dx_projection as dx
from sonic_jax.mosaic_gpu import up_projection as up
from sonic_jax.mosaic_gpu import weight_grad as wgrad

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: the tests call main in their process
  flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
  flags.DEFINE_string("out", "bench_out", "output folder")
  flags.DEFINE_integer("repeats", 10, "timed samples per kernel")
  flags.DEFINE_enum("gate_up_layout", "concat", list(acts.GATE_UP_LAYOUTS),
                    "gate/up layout of w1, H and dH in the up-projection and dH kernels")
  flags.DEFINE_enum("data", "sonicmoe", list(grid.DATA_SCALES),
                    "input scales (grid.random_problem)")
  flags.DEFINE_bool("interpret", False, "Mosaic GPU interpret mode (a CPU run)")


def _time(fn, *args):
  return timing.time_fn(fn, *args, repeats=FLAGS.repeats)


def ceilings():
  """(dense bf16 GEMM FLOP/s, device copy bytes/s) measured here (small sizes off a GPU)."""
  on_gpu = jax.devices()[0].platform == "gpu"
  size, elements = (8192, 1 << 30) if on_gpu else (512, 1 << 22)
  k = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(k[0], (size, size), jnp.bfloat16)
  b = jax.random.normal(k[1], (size, size), jnp.bfloat16)
  t_mm = _time(lambda a, b: a @ b, a, b)
  big = jax.random.normal(k[0], (elements,), jnp.bfloat16)
  t_cp = _time(lambda v: v * 2, big)
  return 2 * size**3 / t_mm, 2 * big.size * 2 / t_cp


def build_kernels(cfg, gate_up="concat", data="sonicmoe"):
  """({"config", "rows_used", "pairs"}, {name: (fn, args, FLOPs, bytes)}): the layer's kernels for
  configuration `cfg` as the backend configures them by default, on their inputs."""
  config = sonic_jax.Config()
  t_count, d, n, e, k = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, d_out = grid.random_problem(cfg, data=data)
  route = grid.route_fn(cfg, mosaic_backend.ROW_TILE, config)
  r, layout = jax.jit(route)(x, rw)
  rows = int(layout.num_tiles) * mosaic_backend.ROW_TILE
  roles = mosaic_backend.role_configs(d, n, e, True, gate_up, config)
  up_fn = lambda x, w1, lay: up.up_projection(x, w1, None, lay, act, gate_up, config=roles.up)
  down_fn = lambda a, w2, lay: down.down_projection(a, w2, None, lay, config=roles.down)
  h, a = jax.jit(up_fn)(x, w1, layout)
  y_rows = jax.jit(down_fn)(a, w2, layout)
  row_scores = jnp.where(layout.row_valid(), 0.5, 0.0).astype(jnp.float32)
  dh_fn = lambda g, h, s, w, lay: dh.dh_projection(g, h, s, w, lay, act, config=roles.dh,
                                                   gate_up_layout=gate_up)
  d_h, a_s, _ = jax.jit(dh_fn)(d_out, h, row_scores, w2, layout)

  pairs, b16 = t_count * k, 2
  up_bytes = (e * d * 2 * n + rows * 3 * n + t_count * d) * b16  # w1, H and A, x's rows read
  aggregate_bytes = (pairs * d + t_count * d) * b16
  kernels = {
      "route+layout": (route, (x, rw), 0, t_count * d * b16 + pairs * 4 * 6),
      "up (fused gather)": (up_fn, (x, w1, layout), 2 * rows * d * 2 * n, up_bytes),
      "xla gather x[rows]": (lambda x, lay: x[lay.row_token], (x, layout), 0, 2 * rows * d * b16),
      "down": (down_fn, (a, w2, layout), 2 * rows * n * d, (rows * n + e * n * d + rows * d) * b16),
      "aggregate (xla)": (lambda y, s, lay: xla_backend.gather_sum(y, lay, s, jnp.bfloat16),
                          (y_rows, r.scores, layout), 0, aggregate_bytes),
      "aggregate (backend)": (
          lambda y, s, lay: mosaic_backend.gather_sum(y, lay, s, jnp.bfloat16, config=config),
          (y_rows, r.scores, layout), 0, aggregate_bytes),
      "bwd dH (fused gather)": (dh_fn, (d_out, h, row_scores, w2, layout), 2 * rows * d * n,
                                (e * n * d + 2 * rows * 2 * n + rows * n + t_count * d) * b16),
      "bwd dw1 = x^T dH (fused gather)": (
          lambda x, g, lay: wgrad.weight_grad(x, g, lay, roles.weight_grad), (x, d_h, layout),
          2 * rows * d * 2 * n, (rows * 2 * n + e * d * 2 * n + t_count * d) * b16),
      "bwd dw2 = A_s^T dO (fused gather)": (
          lambda a, g, lay: mosaic_backend.dw2_gathering_d_out(g, a, lay, roles.weight_grad),
          (a_s, d_out, layout), 2 * rows * n * d, (rows * n + e * n * d + t_count * d) * b16),
      "bwd dX rows (dH w1^T)": (
          lambda g, w, lay: dx.dx_projection(g, w, lay, roles.dx), (d_h, w1, layout),
          2 * rows * 2 * n * d, (rows * 2 * n + e * d * 2 * n + rows * d) * b16),
  }
  return {"config": list(cfg), "rows_used": rows, "pairs": pairs}, kernels


def summarize(res):
  """Adds the forward and backward sums of the kernels the backend runs (pure arithmetic)."""
  t_count, d, n, _, k = res["config"]
  fwd_flops = grid.forward_flops((t_count, d, n, 0, k))
  ms = {name: r["ms"] for name, r in res["kernels"].items()}
  res["forward_sum_ms"] = (ms["route+layout"] + ms["up (fused gather)"] + ms["down"]
                           + ms["aggregate (backend)"])
  res["backward_sum_ms"] = sum(ms[name] for name in ms if name.startswith("bwd "))
  res["forward_sum_tflops"] = fwd_flops / (res["forward_sum_ms"] * 1e-3) / 1e12
  res["backward_sum_tflops"] = 2 * fwd_flops / (res["backward_sum_ms"] * 1e-3) / 1e12
  return res


def run_config(cfg, flops_rate, bw):
  res, kernels = build_kernels(cfg, FLAGS.gate_up_layout, FLAGS.data)
  res["kernels"] = {}
  for name, (fn, args, flops, nbytes) in kernels.items():
    t = _time(fn, *args)
    res["kernels"][name] = {"ms": t * 1e3,
                            "roofline_ms": max(flops / flops_rate, nbytes / bw) * 1e3,
                            "tflops": flops / t / 1e12 if flops else None,
                            "gbps": nbytes / t / 1e9}
  return summarize(res)


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, grid.PAPER_GRID)
  os.makedirs(FLAGS.out, exist_ok=True)
  with grid.interpret_mode(FLAGS.interpret):
    flops_rate, bw = ceilings()
    out = grid.run_record("kernel_bench", gate_up_layout=FLAGS.gate_up_layout, data=FLAGS.data,
                          dense_bf16_tflops=flops_rate / 1e12, copy_gbps=bw / 1e9, configs=[])
    path = os.path.join(FLAGS.out, grid.results_name(out, "kernels"))
    print(f"{out['device']}: dense bf16 GEMM {flops_rate / 1e12:.0f} TFLOP/s, copy "
          f"{bw / 1e9:.0f} GB/s", flush=True)
    for cfg in configs:
      res = run_config(cfg, flops_rate, bw)
      out["configs"].append(res)
      print(f"{grid.config_name(cfg)}: forward (sum) {res['forward_sum_tflops']:.0f} TFLOP/s, "
            f"backward (sum) {res['backward_sum_tflops']:.0f} TFLOP/s", flush=True)
      for name, r in res["kernels"].items():
        rate = f"{r['tflops']:.0f} TFLOP/s" if r["tflops"] else f"{r['gbps']:.0f} GB/s"
        print(f"   {name:<36}{r['ms']:8.3f} ms  (roofline {r['roofline_ms']:.3f} ms)  {rate}",
              flush=True)
      with open(path, "w") as f:
        json.dump(out, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
