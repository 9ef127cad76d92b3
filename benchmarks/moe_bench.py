r"""The MoE layer's forward, backward and forward+backward against its baselines, per configuration.

  python -m benchmarks.moe_bench                                  # the paper's 12 configurations
  python -m benchmarks.moe_bench --thiek=32768,4096,512,128,8     # one configuration
  python -m benchmarks.moe_bench --grid=tiny --backends=xla --out=/tmp/bench   # a CPU run
  python -m benchmarks.moe_bench --thiek=32768,4096,1024,128,8 --backends=mosaic_gpu \
      --timing=interleaved --options=deepseek_v3_router,gpt_oss_router_and_activation,...
                                  # model-family options against plain softmax top-K

On a GPU machine (no network there; the tokamax baseline needs its wheels, which travel in the
ignored folder .whl: run `bash benchmarks/wheels.sh tokamax` on a CPU machine beforehand and carry
.whl with the call):

  bash benchmarks/gpu_bench.sh --backends=mosaic_gpu --baselines=

re-measures sonic_jax's rows of BENCHMARKS.md's layer table (the 12 configurations in 4.5 minutes on
one H100); `--baselines=tokamax,upper_bound` (the default) adds the tokamax-built layer and the
uniform upper bound. The run writes $OUT/bench/<device>_<date>_layer.json; copy it into
benchmarks/results/ and run `python -m benchmarks.report`: a row of a more recent run replaces the
row of the same name and configuration from an older one.

Per configuration and row (sonic_jax's layer on each backend of --backends, then the baselines):
forward, backward (= forward+backward - forward) and forward+backward time and TFLOP/s with the
paper's FLOP counts, compile times, the bytes of residuals that autodiff keeps for the backward,
XLA's temporary memory of the training step, and with --kernel_trace per-kernel device times.
--timing=do_bench (default) times each program as SonicMoE's benchmark does (`timing.
time_do_bench`); --timing=interleaved takes --repeats samples of sustained back-to-back calls,
the forward and the forward+backward in alternating rounds (`timing.time_interleaved`).
"""

from __future__ import annotations

import json
import os
import traceback

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import sonic_jax
from benchmarks import baselines, grid, report, timing
from sonic_jax.mosaic_gpu.tuning import TuningTable

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: the tests call main in their process
  flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable); overrides --grid")
  flags.DEFINE_enum("grid", "paper", ["paper", "tiny"], "configuration grid")
  flags.DEFINE_list("backends", ["auto"], "sonic_jax backends to measure (names that resolve to "
                    "the same backend are measured once)")
  flags.DEFINE_list("baselines", ["tokamax", "upper_bound"], "baselines to measure (tokamax only "
                    "where it is importable)")
  flags.DEFINE_enum("gate_up_layout", "concat", list(sonic_jax.GATE_UP_LAYOUTS),
                    "where the gate and up columns sit in w1 (interleaved: SonicMoE's order)")
  flags.DEFINE_enum("router_dtype", "bfloat16", ["bfloat16", "float32"], "router weight dtype (the "
                    "logits accumulate in float32 either way; SonicMoE keeps it in bfloat16)")
  flags.DEFINE_enum("data", "sonicmoe", list(grid.DATA_SCALES), "input scales (grid.random_inputs "
                    "and random_weights); the GPU's power draw, so its clocks, depend on them")
  flags.DEFINE_enum("timing", "do_bench", ["do_bench", "interleaved"], "timing method (see above)")
  flags.DEFINE_integer("repeats", 10, "--timing=interleaved: timed samples (median reported)")
  flags.DEFINE_integer("input_sets", 3, "--timing=interleaved: input sets rotated between calls")
  flags.DEFINE_integer("xla_max_pairs", 1 << 18, "skip the xla backend when T*K exceeds this "
                       "(its grouped GEMMs are a scan: a correctness path, minutes per call on the "
                       "grid)")
  flags.DEFINE_bool("kernel_trace", False, "per-kernel device times from a profiler trace")
  flags.DEFINE_string("tuning", None, "a tuning table JSON (benchmarks.autotune --out) for the "
                      "mosaic_gpu kernels; default: the packaged table")
  flags.DEFINE_list("options", [], "model-family options (names of OPTIONS) measured as rows "
                    "beside plain softmax top-K on the first backend; the run is written with "
                    "kind 'options' instead of 'layer' and without baselines")
  flags.DEFINE_string("out", "bench_out", "output folder")


# Model-family options, each the moe keyword arguments for a configuration (T, d, n, E, K); the
# weights stay those of the plain SwiGLU layer (every option keeps w1's 2n columns).
OPTIONS = {
    # DeepSeek-V3's router: sigmoid, 8 groups (top-2 sums), 4 kept, a selection bias, scaling 2.5
    "deepseek_v3_router": lambda cfg: dict(
        routing=sonic_jax.Router("sigmoid", renorm_epsilon=1e-20, n_group=8, topk_group=4,
                                 group_score="top2_sum", routed_scaling_factor=2.5),
        selection_bias=jnp.linspace(-0.01, 0.01, cfg[3], dtype=jnp.float32)),
    # gpt-oss's trainable router bias and clamped SwiGLU (expert biases are their own option)
    "gpt_oss_router_and_activation": lambda cfg: dict(
        router_bias=jnp.zeros((cfg[3],), jnp.bfloat16), activation="clamped_swiglu"),
    "geglu_tanh": lambda cfg: dict(activation="geglu_tanh"),
    "sigmoid_without_renormalisation": lambda cfg: dict(routing="sigmoid_topk_raw"),
    "capacity_factor_1.25": lambda cfg: dict(capacity_factor=1.25),
}


def _measure(name, fwd, fwd_sets, fb_sets, flops):
  """Times fwd and its forward+backward, with memory figures; errors are recorded, not raised."""
  row = {"name": name}
  try:
    fwdbwd = timing.forward_and_backward(fwd)
    c_fwd, row["compile_fwd_s"] = timing.compile_fn(fwd, *fwd_sets[0])
    c_fb, row["compile_fwdbwd_s"] = timing.compile_fn(fwdbwd, *fb_sets[0])
    if FLAGS.timing == "do_bench":  # the forward, then the forward+backward, as SonicMoE's
      t_fwd, info_fwd = timing.time_do_bench(c_fwd, fwd_sets[0])
      t_fb, info_fb = timing.time_do_bench(c_fb, fb_sets[0])
      row.update(fwd_calls=info_fwd["calls"], fwdbwd_calls=info_fb["calls"],
                 per_call=info_fwd["per_call"], fwdbwd_per_call=info_fb["per_call"])
      samples = info_fwd["samples_s"], info_fb["samples_s"]
    else:  # alternating rounds: backward = fwd+bwd - fwd without the clocks' drift between them
      times = timing.time_interleaved({"fwd": (c_fwd, fwd_sets), "fwdbwd": (c_fb, fb_sets)},
                                      repeats=FLAGS.repeats)
      (t_fwd, s_fwd), (t_fb, s_fb) = times["fwd"], times["fwdbwd"]
      samples = s_fwd, s_fb
    # A forward+backward no longer than the forward (a CPU's clock, or noise) leaves the backward
    # no measurable time: None, not a rate from a near-zero difference.
    t_bwd = t_fb - t_fwd if t_fb > t_fwd else None
    row.update(fwd_ms=t_fwd * 1e3, fwdbwd_ms=t_fb * 1e3,
               bwd_ms=None if t_bwd is None else t_bwd * 1e3, fwd_tflops=flops / t_fwd / 1e12,
               bwd_tflops=None if t_bwd is None else 2 * flops / t_bwd / 1e12,
               fwdbwd_tflops=3 * flops / t_fb / 1e12,
               fwd_samples_ms=[v * 1e3 for v in samples[0]],
               fwdbwd_samples_ms=[v * 1e3 for v in samples[1]],
               residual_bytes=timing.residual_bytes(fwd, *fwd_sets[0]),
               temp_bytes=timing.temp_bytes(c_fb))
    if FLAGS.kernel_trace:
      row["kernels_fwdbwd_us"] = timing.kernel_times(c_fb, fb_sets[0])
  except Exception as e:  # out of memory, unsupported shape: record and go on
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    traceback.print_exc()
  return row


def _sonic_rows(cfg, sets, weights, config):
  router_weight, w1, w2 = weights
  fwd_sets = [(x, router_weight, w1, w2) for x, _ in sets]
  fb_sets = [(x, router_weight, w1, w2, d_y) for x, d_y in sets]
  rows, seen = [], set()
  for b in FLAGS.backends:
    resolved = sonic_jax.backends.resolve_backend(b, config).name
    if resolved in seen:
      continue
    seen.add(resolved)
    name = f"sonic_jax[{resolved}]" + (", interleaved w1" if FLAGS.gate_up_layout == "interleaved"
                                       else "")
    if resolved == "xla" and cfg[0] * cfg[4] > FLAGS.xla_max_pairs:
      rows.append({"name": name, "error": "skipped (--xla_max_pairs)"})
      continue

    def fwd(x, rw, w1, w2, backend=resolved):
      return sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4], backend=backend, config=config,
                           gate_up_layout=FLAGS.gate_up_layout)[0]

    rows.append(_measure(name, fwd, fwd_sets, fb_sets, grid.forward_flops(cfg)))
    for option in FLAGS.options if len(rows) == 1 else ():

      def fwd_option(x, rw, w1, w2, backend=resolved, kw=OPTIONS[option](cfg)):
        return sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4], backend=backend, config=config,
                             gate_up_layout=FLAGS.gate_up_layout, **kw)[0]

      rows.append(_measure(f"{name} {option}", fwd_option, fwd_sets, fb_sets,
                           grid.forward_flops(cfg)))
  return rows


def _baseline_rows(cfg, sets, weights):
  router_weight, w1, w2 = weights
  t, d, _, e, k = cfg
  rows = []
  if "tokamax" in FLAGS.baselines and baselines.tokamax_available():
    fwd = lambda x, rw, w1, w2: baselines.tokamax_moe(x, rw, w1, w2, top_k=k)
    rows.append(_measure("tokamax_layer", fwd, [(x, router_weight, w1, w2) for x, _ in sets],
                         [(x, router_weight, w1, w2, d_y) for x, d_y in sets],
                         grid.forward_flops(cfg)))
  if "upper_bound" in FLAGS.baselines:
    c = t * k // e  # rows per expert of a perfectly balanced routing
    per_expert = lambda v: jnp.resize(v, (e, c, d))  # x's rows, repeated
    rows.append(_measure("uniform_upper_bound", baselines.uniform_upper_bound,
                         [(per_expert(x), w1, w2) for x, _ in sets],
                         [(per_expert(x), w1, w2, per_expert(d_y)) for x, d_y in sets],
                         6 * e * c * d * cfg[2]))
  return rows


def run_config(cfg, config):
  sets = [grid.random_inputs(cfg, s, FLAGS.data)
          for s in range(FLAGS.input_sets if FLAGS.timing == "interleaved" else 1)]
  weights = grid.random_weights(cfg, data=FLAGS.data, router_dtype=jnp.dtype(FLAGS.router_dtype))
  # How unevenly these inputs load the experts, and the padding rows of the grouped layout.
  _, layout = jax.jit(grid.route_fn(cfg, config=config))(sets[0][0], weights[0])
  counts = np.asarray(layout.expert_counts)
  result = {"config": list(cfg), "name": grid.config_name(cfg),
            "expert_counts": {"min": int(counts.min()), "max": int(counts.max()),
                              "mean": float(counts.mean())},
            "padded_rows": int(np.sum(np.asarray(layout.group_sizes)) - counts.sum()),
            "rows": _sonic_rows(cfg, sets, weights, config)
                    + ([] if FLAGS.options else _baseline_rows(cfg, sets, weights))}
  return result


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, grid.PAPER_GRID if FLAGS.grid == "paper"
                               else grid.TINY_GRID)
  config = sonic_jax.Config(tuning=TuningTable.load(FLAGS.tuning) if FLAGS.tuning else None)
  os.makedirs(FLAGS.out, exist_ok=True)
  unknown = set(FLAGS.options) - set(OPTIONS)
  if unknown:
    raise app.UsageError(f"--options: unknown {sorted(unknown)}; known: {sorted(OPTIONS)}")
  record = grid.run_record("moe_bench", timing=FLAGS.timing, data=FLAGS.data,
                           router_dtype=FLAGS.router_dtype, gate_up_layout=FLAGS.gate_up_layout,
                           tuning=FLAGS.tuning or "packaged",
                           tokamax=baselines.tokamax_version())
  print(json.dumps(record), flush=True)
  results = {"environment": record, "configs": []}
  path = os.path.join(FLAGS.out, grid.results_name(record,
                                                   "options" if FLAGS.options else "layer"))
  for cfg in configs:
    print(f"== {grid.config_name(cfg)}", flush=True)
    res = run_config(cfg, config)
    for row in res["rows"]:
      print("  ", report.row_summary(row), flush=True)
    results["configs"].append(res)
    with open(path, "w") as f:
      json.dump(results, f, indent=1)
  table = (report.options_table(results) if FLAGS.options
           else report.layer_table([results], with_published=False, hidden=()))
  print(f"wrote {path}\n\n{table}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
