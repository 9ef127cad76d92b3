r"""Per-kernel timings on the paper's grid, against rooflines measured on the same GPU.

  python -m benchmarks.kernel_bench [--thiek=T,d,n,E,K ...] [--out=dir]

For each configuration: the routing and layout, the up-projection with the fused gather, the same
kernel on a pre-gathered contiguous input (the cost of the gather), the XLA gather that the
pre-gathered input needs, the down-projection and the aggregation; then the backward kernels: the
dH role (with its activation-gradient, A_s and dS epilogue) and the two varlen-K weight gradients,
each with its fused row gather (dO, x, dO) and on pre-gathered rows, dH also storing the dO rows it
gathers (for dw2 to read), and the dX role. Each
kernel's roofline time is max(FLOPs / measured dense bf16 GEMM rate, bytes / measured device copy
bandwidth). Every kernel runs with the configuration the layer gives it (`mosaic_gpu.backend`'s
tuning-table lookup); the forward and backward sums count what the backend runs (`summarize`).
"""

from __future__ import annotations

import functools
import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks import grid, timing
from sonic_jax import activations as acts
from sonic_jax import xla_backend
from sonic_jax.mosaic_gpu import dh_projection as dh
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import down_projection as down
from sonic_jax.mosaic_gpu import dx_projection as dx
from sonic_jax.mosaic_gpu import up_projection as up
from sonic_jax.mosaic_gpu import weight_grad as wgrad

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_integer("repeats", 10, "timed samples per kernel")
flags.DEFINE_enum("gate_up_layout", "concat", list(acts.GATE_UP_LAYOUTS),
                  "gate/up layout of w1, H and dH in the up-projection and dH kernels")
FLAGS = flags.FLAGS


def _time(fn, *args):
  return timing.time_fn(fn, *args, repeats=FLAGS.repeats)


def ceilings():
  """(dense bf16 GEMM FLOP/s, device copy bytes/s) measured here."""
  k = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(k[0], (8192, 8192), jnp.bfloat16)
  b = jax.random.normal(k[1], (8192, 8192), jnp.bfloat16)
  t_mm = _time(lambda a, b: a @ b, a, b)
  big = jax.random.normal(k[0], (1 << 30,), jnp.bfloat16)  # 2 GiB
  t_cp = _time(lambda v: v * 2, big)
  return 2 * 8192**3 / t_mm, 2 * big.size * 2 / t_cp


def build_kernels(cfg, data="unit"):
  """({"config", "rows_used", "pairs"}, {name: (fn, args, FLOPs, bytes)}): every kernel of the
  layer for configuration `cfg` with the configuration the backend gives it, on its inputs
  (`grid.random_problem`'s `data` scales)."""
  t_count, d, n, e, k = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, d_out = grid.random_problem(cfg, data=data)

  route = grid.route_fn(cfg)
  r, layout = jax.jit(route)(x, rw)
  scores = r.scores
  rows = int(layout.num_tiles) * 128
  rows_of = jax.jit(lambda v, lay: v[lay.row_token])
  x_rows = rows_of(x, layout)
  # Every kernel with the configuration the layer gives it (the backend's tuning-table lookup).
  up_cfg, down_cfg = mosaic_backend.up_config(d, 2 * n, e), mosaic_backend.down_config(d, n, e)
  gate_up = FLAGS.gate_up_layout
  up_fn = lambda x, w1, lay: up.up_projection(x, w1, None, lay, act, gate_up, config=up_cfg)
  up_contig = lambda xr, w1, lay: up.up_projection(xr, w1, None, lay, act, gate_up, config=up_cfg,
                                                   gather=False)
  down_fn = lambda a, w2, lay: down.down_projection(a, w2, None, lay, config=down_cfg)
  h, a = jax.jit(up_contig)(x_rows, w1, layout)
  y_rows = jax.jit(down_fn)(a, w2, layout)

  pairs = t_count * k
  res = {"config": list(cfg), "rows_used": rows, "pairs": pairs}
  b16 = 2
  up_bytes = (e * d * 2 * n + rows * 3 * n) * b16  # weights, H and A; plus the A operand's rows
  kernels = {
      "route+layout": (lambda x, rw: route(x, rw), (x, rw), 0,
                       t_count * d * b16 + pairs * 4 * 6),
      "up (fused gather)": (up_fn, (x, w1, layout), 2 * rows * d * 2 * n,
                            up_bytes + t_count * d * b16),
      "up (contiguous input)": (up_contig, (x_rows, w1, layout), 2 * rows * d * 2 * n,
                                up_bytes + rows * d * b16),
      "xla gather x[rows]": (lambda x, lay: x[lay.row_token], (x, layout), 0, 2 * rows * d * b16),
      "down": (down_fn, (a, w2, layout), 2 * rows * n * d,
               (rows * n + e * n * d + rows * d) * b16),
      "aggregate (xla)": (lambda y, s, lay: xla_backend.gather_sum(y, lay, s, jnp.bfloat16),
                          (y_rows, scores, layout), 0, (pairs * d + t_count * d) * b16),
      # As the backend runs it (`mosaic_gpu.backend.AGGREGATION`: the Mosaic GPU gather-sum
      # kernel where it is faster, else the same XLA operation).
      "aggregate (backend)": (
          lambda y, s, lay: mosaic_backend.gather_sum(y, lay, s, jnp.bfloat16),
          (y_rows, scores, layout), 0, (pairs * d + t_count * d) * b16),
  }
  # Backward kernels on the same layout, as the backend runs them (dO and x rows gathered inside
  # the kernels), and on pre-gathered contiguous rows (what the fused gathers cost).
  d_out_rows = rows_of(d_out, layout)
  row_scores = jnp.where(layout.row_valid(), 0.5, 0.0).astype(jnp.float32)
  dh_cfg = mosaic_backend.dh_config(d, n, e, gate_up)
  dx_cfg = mosaic_backend.dx_config(d, 2 * n, e)
  wgrad_cfg = mosaic_backend.weight_grad_config(d, n, e)
  dh_fn = lambda g, h, s, w, lay, gather: dh.dh_projection(g, h, s, w, lay, act, config=dh_cfg,
                                                           gather=gather, gate_up_layout=gate_up)
  d_h, a_s, _ = jax.jit(functools.partial(dh_fn, gather=True))(d_out, h, row_scores, w2, layout)
  wgrad_fn = lambda a, b, lay, gathered: wgrad.weight_grad(a, b, lay, wgrad_cfg, gathered=gathered)
  # dw2 gathering its dO rows runs as the backend runs it: dO on the wgmma's M side.
  dw2_fn = lambda a, g, lay, gathered: (
      mosaic_backend.dw2_gathering_d_out(g, a, lay, wgrad_cfg) if gathered
      else wgrad.weight_grad(a, g, lay, wgrad_cfg))
  dh_flops, dh_bytes = 2 * rows * d * n, (e * n * d + 2 * rows * 2 * n + rows * n) * b16
  dw1_bytes, dw2_bytes = (rows * 2 * n + e * d * 2 * n) * b16, (rows * n + e * n * d) * b16
  for label, gathered in (("fused gather", True), ("contiguous input", False)):
    g_src, x_src = (d_out, x) if gathered else (d_out_rows, x_rows)
    src_rows = (t_count if gathered else rows) * d * b16  # bytes of the gathered operand read
    kernels.update({
        f"bwd dH ({label})": (functools.partial(dh_fn, gather=gathered),
                              (g_src, h, row_scores, w2, layout), dh_flops, dh_bytes + src_rows),
        f"bwd dw1 = x^T dH ({label})": (
            functools.partial(wgrad_fn, gathered="lhs" if gathered else None),
            (x_src, d_h, layout), 2 * rows * d * 2 * n, dw1_bytes + src_rows),
        f"bwd dw2 = A_s^T dO ({label})": (
            functools.partial(dw2_fn, gathered=gathered),
            (a_s, g_src, layout), 2 * rows * n * d, dw2_bytes + src_rows),
    })
  kernels["bwd dH (fused gather, writes dO rows)"] = (
      lambda g, h, s, w, lay: dh.dh_projection(g, h, s, w, lay, act, config=dh_cfg, gather=True,
                                               gate_up_layout=gate_up, write_d_out_rows=True),
      (d_out, h, row_scores, w2, layout), dh_flops, dh_bytes + (t_count + rows) * d * b16)
  kernels["bwd dX rows (dH w1^T)"] = (lambda g, w, lay: dx.dx_projection(g, w, lay, dx_cfg),
                                      (d_h, w1, layout), 2 * rows * 2 * n * d,
                                      (rows * 2 * n + e * d * 2 * n + rows * d) * b16)
  return res, kernels


def run_config(cfg, flops_rate, bw):
  res, kernels = build_kernels(cfg)
  res["kernels"] = {}
  for name, (fn, args, flops, nbytes) in kernels.items():
    t = _time(fn, *args)
    roof = max(flops / flops_rate, nbytes / bw)
    res["kernels"][name] = {"ms": t * 1e3, "roofline_ms": roof * 1e3,
                            "tflops": flops / t / 1e12 if flops else None,
                            "gbps": nbytes / t / 1e9}
  return summarize(res)


def summarize(res):
  """Adds the forward and backward sums as the backend runs them (`mosaic_gpu.backend.
  gather_source`): each gathered operand (x: up and dw1; dO: dH and dw2) either fused into its
  kernels, read contiguous after an XLA row gather (timed as 'xla gather x[rows]', one per
  operand), or (dO) gathered by dH, which stores the rows that dw2 reads contiguous. Pure
  arithmetic on the measured times."""
  t_count, d, n, _, k = res["config"]
  fwd_flops = 6 * t_count * k * d * n
  ms = {kname: r["ms"] for kname, r in res["kernels"].items()}
  x_source = mosaic_backend.gather_source("x")
  d_out_source = mosaic_backend.gather_source("d_out")
  gather_ms = ms["xla gather x[rows]"]
  up_ms = (ms["up (fused gather)"] if x_source == "fused"
           else gather_ms + ms["up (contiguous input)"])
  aggregate_ms = ms.get("aggregate (backend)", ms["aggregate (xla)"])  # older runs: XLA's
  t_fwd = ms["route+layout"] + up_ms + ms["down"] + aggregate_ms
  label = lambda source: "fused gather" if source == "fused" else "contiguous input"
  dh_ms = (ms["bwd dH (fused gather, writes dO rows)"] if d_out_source == "dh"
           else ms[f"bwd dH ({label(d_out_source)})"])
  res["backward_gathers"] = {"x": x_source, "d_out": d_out_source}
  res["backward_gemms_ms"] = (dh_ms + ms[f"bwd dw1 = x^T dH ({label(x_source)})"]
                              + ms[f"bwd dw2 = A_s^T dO ({label(d_out_source)})"]
                              + ms["bwd dX rows (dH w1^T)"])
  res["backward_sum_ms"] = res["backward_gemms_ms"] + gather_ms * ((x_source == "xla")
                                                                   + (d_out_source == "xla"))
  res["backward_sum_tflops"] = 2 * fwd_flops / (res["backward_sum_ms"] * 1e-3) / 1e12
  res["forward_sum_ms"] = t_fwd
  res["forward_sum_tflops"] = fwd_flops / (t_fwd * 1e-3) / 1e12
  res["gather_cost"] = {
      role: ms[f"{role} (fused gather)"] / ms[f"{role} (contiguous input)"] - 1
      for role in ("up", "bwd dH", "bwd dw1 = x^T dH", "bwd dw2 = A_s^T dO")}
  return res


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, grid.PAPER_GRID)
  os.makedirs(FLAGS.out, exist_ok=True)
  flops_rate, bw = ceilings()
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
         "gate_up_layout": FLAGS.gate_up_layout, "dense_bf16_tflops": flops_rate / 1e12,
         "copy_gbps": bw / 1e9, "configs": []}
  print(f"{out['device']}: dense bf16 GEMM {flops_rate / 1e12:.0f} TFLOP/s, copy {bw / 1e9:.0f} GB/s",
        flush=True)
  for cfg in configs:
    res = run_config(cfg, flops_rate, bw)
    out["configs"].append(res)
    gc = ", gather cost " + ", ".join(f"{r} {100 * c:+.1f}%" for r, c in res["gather_cost"].items())
    print(grid.config_name(cfg), f"fwd(sum) {res['forward_sum_tflops']:.0f} TFLOP/s{gc}, "
          f"backward (gathers {res['backward_gathers']}) {res['backward_sum_tflops']:.0f} TFLOP/s",
          flush=True)
    for name, r in res["kernels"].items():
      tf = f"{r['tflops']:.0f} TFLOP/s" if r["tflops"] else f"{r['gbps']:.0f} GB/s"
      print(f"   {name:<36}{r['ms']:8.3f} ms  (roofline {r['roofline_ms']:.3f} ms)  {tf}", flush=True)
    with open(os.path.join(FLAGS.out, "kernels.json"), "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
