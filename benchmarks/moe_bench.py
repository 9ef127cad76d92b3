r"""Benchmark sonic_jax's MoE layer against its baselines, per configuration, in one run.

  python -m benchmarks.moe_bench                                  # the paper's 12 configurations
  python -m benchmarks.moe_bench --thiek=32768,4096,512,128,8     # one configuration
  python -m benchmarks.moe_bench --grid=tiny --out=/tmp/bench     # CPU smoke run

Per configuration and row (sonic_jax backends, the tokamax-built layer, the uniform upper bound):
forward, backward (= forward+backward − forward) and forward+backward time and TFLOP/s with the
paper's FLOP counts, compile times, the bytes of residuals kept for backward, XLA's temp memory of
the training step, and per-kernel device times from a profiler trace. Writes results.json,
results.md and PNG plots to --out; --benchmarks_md also regenerates BENCHMARKS.md.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import traceback

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import sonic_jax
from benchmarks import baselines, grid, report, timing

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable); overrides --grid")
flags.DEFINE_enum("grid", "paper", ["paper", "tiny"], "configuration grid")
flags.DEFINE_list("backends", ["auto", "xla"], "sonic_jax backends to measure (duplicates that "
                  "resolve to the same backend are measured once)")
flags.DEFINE_list("baselines", ["tokamax", "upper_bound"], "baselines to measure (tokamax only "
                  "when importable)")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "compute dtype")
flags.DEFINE_enum("activation", "swiglu", sorted(sonic_jax.ACTIVATIONS), "expert activation")
flags.DEFINE_enum("gate_up_layout", "concat", list(sonic_jax.activations.GATE_UP_LAYOUTS),
                  "where a GLU's gate and up columns sit in w1 (interleaved: SonicMoE's order)")
flags.DEFINE_enum("routing", "softmax_topk", list(sonic_jax.ROUTINGS), "routing")
flags.DEFINE_enum("router_dtype", "bfloat16", ["bfloat16", "float32"], "router weight dtype (the "
                  "logits accumulate in float32 either way; SonicMoE's benchmark keeps it in bfloat16)")
flags.DEFINE_enum("data", "unit", list(grid.DATA_SCALES), "input scales: unit (x, dO ~ N(0, 1), "
                  "weights of std 1/sqrt(fan-in)) or sonicmoe (as SonicMoE's benchmark, "
                  "../shared/bench/sonic_ref.py: x, dO ~ 0.2 N(0, 1), every weight of std 0.02; "
                  "the GPU's power draw, so its clocks under load, depend on the data)")
flags.DEFINE_integer("repeats", 10, "timed samples per measurement (median reported)")
flags.DEFINE_integer("input_sets", 3, "input sets rotated between calls")
flags.DEFINE_integer("xla_max_pairs", 1 << 30, "skip the xla backend when T*K exceeds this")
flags.DEFINE_list("forward_only", [], "sonic_jax backends measured forward only (e.g. one whose "
                  "backward still runs the slow xla reference path)")
flags.DEFINE_list("token_rounding", [], "token-rounding modes (down, up, nearest) measured as "
                  "extra rows of every sonic_jax backend; their FLOPs count the pairs after rounding")
flags.DEFINE_bool("do_bench", False, "also time each row as SonicMoE's anchors were timed "
                  "(triton do_bench style: `timing.time_do_bench`), right after compiling it, "
                  "before the interleaved samples; recorded under the row's \"do_bench\"")
flags.DEFINE_bool("kernel_trace", True, "per-kernel device times from a profiler trace")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_bool("benchmarks_md", False, "regenerate BENCHMARKS.md from this run")
flags.DEFINE_string("sonicmoe_script", None, "path to sonic_ref.py: run SonicMoE (PyTorch) on the "
                    "same GPU after ours, when the sonicmoe package is importable there")
FLAGS = flags.FLAGS


def _inputs(cfg, dtype, seed, glu):
  t, d, n, e, _ = cfg
  ks = jax.random.split(jax.random.key(seed), 5)
  scale = grid.input_std(FLAGS.data)
  x = (scale * jax.random.normal(ks[0], (t, d), jnp.float32)).astype(dtype)
  d_y = (scale * jax.random.normal(ks[1], (t, d), jnp.float32)).astype(dtype)
  return x, d_y


def _weights(cfg, dtype, glu):
  t, d, n, e, _ = cfg
  ks = jax.random.split(jax.random.key(1234), 3)
  std = lambda fan_in: grid.weight_std(FLAGS.data, fan_in)
  router_weight = (jax.random.normal(ks[0], (d, e), jnp.float32) * std(d)).astype(
      FLAGS.router_dtype)
  w1 = (jax.random.normal(ks[1], (e, d, (2 if glu else 1) * n), jnp.float32) * std(d)).astype(dtype)
  w2 = (jax.random.normal(ks[2], (e, n, d), jnp.float32) * std(n)).astype(dtype)
  return router_weight, w1, w2


def _measure(name, fwd, fwdbwd, fwd_sets, fwdbwd_sets, flops, residual_fn=None):
  """Times fwd and fwd+bwd (fwdbwd=None: forward only) and collects memory figures; errors are
  recorded, not raised."""
  row = {"name": name}
  try:
    c_fwd, row["compile_fwd_s"] = timing.compile_fn(fwd, *fwd_sets[0])
    calls = {"fwd": (c_fwd, fwd_sets)}
    c_fb = c_fwd
    if fwdbwd is not None:
      c_fb, row["compile_fwdbwd_s"] = timing.compile_fn(fwdbwd, *fwdbwd_sets[0])
      calls["fwdbwd"] = (c_fb, fwdbwd_sets)
    if FLAGS.do_bench:  # first, on a GPU that sat idle while compiling, as sonic_ref.py's
      row["do_bench"] = _do_bench(c_fwd, fwd_sets[0], c_fb if fwdbwd is not None else None,
                                  fwdbwd_sets[0], flops)
    # In alternating rounds: backward = fwd+bwd - fwd must not take the clocks' drift between two
    # back-to-back timings with it.
    times = timing.time_interleaved(calls, repeats=FLAGS.repeats)
    t_fwd = times["fwd"][0]
    row.update(fwd_ms=t_fwd * 1e3, fwd_tflops=flops / t_fwd / 1e12,
               fwd_samples_ms=[v * 1e3 for v in times["fwd"][1]])
    if fwdbwd is not None:
      t_fb = times["fwdbwd"][0]
      row["fwdbwd_samples_ms"] = [v * 1e3 for v in times["fwdbwd"][1]]
      t_bwd = max(t_fb - t_fwd, 1e-9)
      row.update(fwdbwd_ms=t_fb * 1e3, bwd_ms=t_bwd * 1e3, bwd_tflops=2 * flops / t_bwd / 1e12,
                 fwdbwd_tflops=3 * flops / t_fb / 1e12, temp_bytes=timing.temp_bytes(c_fb))
    if residual_fn is not None:
      own, args_kept, listing = timing.residual_bytes(residual_fn, *fwd_sets[0])
      row.update(residual_bytes=own, residual_arg_bytes=args_kept,
                 residuals=[list(map(str, r)) for r in listing])
    if FLAGS.kernel_trace:
      row["kernels_fwdbwd_us" if fwdbwd is not None else "kernels_fwd_us"] = timing.kernel_times(
          c_fb, fwdbwd_sets[0] if fwdbwd is not None else fwd_sets[0])
  except Exception as e:  # out of memory, unsupported shape: record and go on
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    traceback.print_exc()
  return row


def _do_bench(c_fwd, fwd_args, c_fb, fb_args, flops):
  """The forward, then the forward+backward, each timed as `timing.time_do_bench` times (the
  method of SonicMoE's measured anchors; backward = fwd+bwd - fwd as there)."""
  t_fwd, info = timing.time_do_bench(c_fwd, fwd_args)
  idle_ms = lambda info: (statistics.median(info["idle_s"]) * 1e3 if info.get("idle_s")
                         else None)  # the device waiting inside a call (median)
  out = dict(fwd_ms=t_fwd * 1e3, fwd_tflops=flops / t_fwd / 1e12, fwd_calls=info["calls"],
             per_call=info["per_call"], fwd_samples_ms=[v * 1e3 for v in info["samples_s"]],
             fwd_idle_ms=idle_ms(info))
  if c_fb is not None:
    t_fb, info = timing.time_do_bench(c_fb, fb_args)
    t_bwd = max(t_fb - t_fwd, 1e-9)
    out.update(fwdbwd_ms=t_fb * 1e3, bwd_ms=t_bwd * 1e3, bwd_tflops=2 * flops / t_bwd / 1e12,
               fwdbwd_tflops=3 * flops / t_fb / 1e12, fwdbwd_calls=info["calls"],
               fwdbwd_samples_ms=[v * 1e3 for v in info["samples_s"]],
               fwdbwd_idle_ms=idle_ms(info))
  return out


def _routing_stats(cfg, sets, weights, backend, token_rounding):
  """Pairs after routing and padding rows of the grouped layout, for the first input set."""
  router_weight, w1, w2 = weights
  _, aux = jax.jit(lambda x, rw, w1, w2: sonic_jax.moe(
      x, rw, w1, w2, top_k=cfg[4], routing=FLAGS.routing, token_rounding=token_rounding,
      backend=backend))(sets[0][0], router_weight, w1, w2)
  pairs = int(np.sum(np.asarray(aux.expert_counts)))
  return {"pairs": pairs, "padded_rows": int(aux.padded_rows),
          "padding_fraction": int(aux.padded_rows) / max(pairs, 1)}


def _sonic_rows(cfg, dtype, glu, sets, weights):
  router_weight, w1, w2 = weights
  k = cfg[4]
  rows, seen = [], set()
  for b in FLAGS.backends:
    resolved = sonic_jax.backends.resolve_backend(b).name
    if resolved in seen:
      continue
    seen.add(resolved)
    if resolved == "xla" and cfg[0] * k > FLAGS.xla_max_pairs:
      rows.append({"name": f"sonic_jax[{resolved}]", "error": "skipped (--xla_max_pairs)"})
      continue
    for rounding in [None] + FLAGS.token_rounding:
      kw = dict(top_k=k, activation=FLAGS.activation, routing=FLAGS.routing, backend=resolved,
                token_rounding=rounding, gate_up_layout=FLAGS.gate_up_layout)

      def fwd(x, rw, w1, w2, kw=kw):
        return sonic_jax.moe(x, rw, w1, w2, **kw)[0]

      fwdbwd = timing.forward_and_backward(fwd)
      fwd_sets = [(x, router_weight, w1, w2) for x, _ in sets]
      fb_sets = [(x, router_weight, w1, w2, d_y) for x, d_y in sets]
      only_fwd = b in FLAGS.forward_only or resolved in FLAGS.forward_only
      stats = _routing_stats(cfg, sets, weights, resolved, rounding)
      # FLOPs of the pairs actually computed (SonicMoE's token-rounding benchmark does the same).
      flops = grid.forward_flops(cfg, glu) * stats["pairs"] / (cfg[0] * k)
      name = f"sonic_jax[{resolved}]" + (f"+tr_{rounding}" if rounding else "")
      if FLAGS.gate_up_layout == "interleaved" and glu:  # its own row next to concat's
        name += ", interleaved w1"
      row = _measure(name, fwd, None if only_fwd else fwdbwd, fwd_sets, fb_sets, flops,
                     residual_fn=fwd)
      row.update(stats)
      rows.append(row)
  return rows


def _tokamax_row(cfg, sets, weights):
  router_weight, w1, w2 = weights
  k = cfg[4]
  fwd = lambda x, rw, w1, w2: baselines.tokamax_moe(x, rw, w1, w2, top_k=k)

  return _measure("tokamax_layer", fwd, timing.forward_and_backward(fwd),
                  [(x, router_weight, w1, w2) for x, _ in sets],
                  [(x, router_weight, w1, w2, d_y) for x, d_y in sets], grid.forward_flops(cfg),
                  residual_fn=fwd)


def _upper_bound_row(cfg, dtype, weights):
  t, d, n, e, k = cfg
  _, w1, w2 = weights
  c = t * k // e
  sets = []
  for s in range(FLAGS.input_sets):
    ks = jax.random.split(jax.random.key(100 + s), 2)
    sets.append((jax.random.normal(ks[0], (e, c, d), dtype), jax.random.normal(ks[1], (e, c, d), dtype)))

  flops = 6 * e * c * d * n
  return _measure("uniform_upper_bound", baselines.uniform_upper_bound,
                  timing.forward_and_backward(baselines.uniform_upper_bound),
                  [(xe, w1, w2) for xe, _ in sets], [(xe, w1, w2, dy) for xe, dy in sets], flops,
                  residual_fn=baselines.uniform_upper_bound)


def run_config(cfg):
  dtype = jnp.dtype(FLAGS.dtype)
  glu = sonic_jax.ACTIVATIONS[FLAGS.activation].is_glu
  weights = _weights(cfg, dtype, glu)
  sets = [_inputs(cfg, dtype, s, glu) for s in range(FLAGS.input_sets)]
  # The routing these inputs produce: how uneven the experts' loads are.
  _, aux = jax.jit(lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4],
                                                      backend="xla"))(sets[0][0], *weights)
  counts = np.asarray(aux.expert_counts)
  result = {"config": list(cfg), "name": grid.config_name(cfg),
            "expert_counts": {"min": int(counts.min()), "max": int(counts.max()),
                              "mean": float(counts.mean()), "cv": float(counts.std() / counts.mean())},
            "rows": []}
  result["rows"] += _sonic_rows(cfg, dtype, glu, sets, weights)
  if "tokamax" in FLAGS.baselines and glu and baselines.tokamax_available():
    result["rows"].append(_tokamax_row(cfg, sets, weights))
  if "upper_bound" in FLAGS.baselines and glu:
    result["rows"].append(_upper_bound_row(cfg, dtype, weights))
  return result


def _environment():
  dev = jax.devices()[0]
  return {"device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
          "sonic_jax": sonic_jax.__version__, "python": platform.python_version(),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "command": "python -m benchmarks.moe_bench " + " ".join(sys.argv[1:]),
          "dtype": FLAGS.dtype, "activation": FLAGS.activation, "routing": FLAGS.routing,
          "gate_up_layout": FLAGS.gate_up_layout,
          "router_dtype": FLAGS.router_dtype, "data": FLAGS.data,
          "tokamax": baselines.tokamax_available()}


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, grid.PAPER_GRID if FLAGS.grid == "paper"
                               else grid.TINY_GRID)
  os.makedirs(FLAGS.out, exist_ok=True)
  env = _environment()
  print(json.dumps(env), flush=True)
  results = {"environment": env, "configs": []}
  path = os.path.join(FLAGS.out, "results.json")
  for cfg in configs:
    print(f"== {grid.config_name(cfg)}", flush=True)
    res = run_config(cfg)
    for row in res["rows"]:
      print("  ", report.row_summary(row), flush=True)
    results["configs"].append(res)
    with open(path, "w") as f:
      json.dump(results, f, indent=1)
  if FLAGS.sonicmoe_script:
    results["sonicmoe_same_run"] = _run_sonicmoe(configs)
    with open(path, "w") as f:
      json.dump(results, f, indent=1)
  report.write_all(results, FLAGS.out, benchmarks_md=FLAGS.benchmarks_md)
  print(open(os.path.join(FLAGS.out, "results.md")).read())


def _run_sonicmoe(configs):
  """SonicMoE itself (PyTorch, separate process) on the same GPU, when it is installed there."""
  idx = [grid.PAPER_GRID.index(c) for c in configs if c in grid.PAPER_GRID]
  if not idx:
    return {}
  env = dict(os.environ, OUT=FLAGS.out)
  proc = subprocess.run([sys.executable, FLAGS.sonicmoe_script, ",".join(map(str, idx))], env=env,
                        capture_output=True, text=True)
  print(proc.stdout[-3000:], proc.stderr[-3000:])
  try:
    with open(os.path.join(FLAGS.out, "sonic_ref.json")) as f:
      return json.load(f)
  except OSError:
    return {"error": "SonicMoE did not run: " + proc.stderr[-300:]}


if __name__ == "__main__":
  app.run(main)
