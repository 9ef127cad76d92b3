r"""Where a layer's training step spends its device time: one profiled fwd+bwd step of the
`mosaic_gpu` layer (as `moe_bench` times it: output and gradients), or its forward alone
(`--forward_only`), per kernel in launch order, with the device's idle gaps between them.

  python -m tools.step_timeline [--thiek=T,d,n,E,K ...] [--out=dir] [--forward_only]
      [--calls=N] [--data=sonicmoe|unit]

On a GPU machine: `PYTHONPATH=$PWD python3 -m tools.step_timeline --out=$OUT`.

Prints per configuration: the step's device span (earliest kernel start to latest kernel end), the
sum of kernel times, the idle time, the largest gaps (with the kernels around them) and the kernels
by total time; writes the whole timeline to
`out/timeline_[fwd_]<data>_data_<config>_<calls>.json`. Needs a GPU.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

from absl import app, flags
import jax
import jax.numpy as jnp

import sonic_jax
from benchmarks import grid, timing

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_string("backend", "mosaic_gpu", "sonic_jax backend")
flags.DEFINE_integer("calls", 1, "back-to-back calls profiled (per-call figures are the "
                     "span, kernel and idle times divided by this)")
flags.DEFINE_bool("forward_only", False, "profile the layer's forward alone (as moe_bench's "
                  "forward samples: output only) instead of the training step")
flags.DEFINE_enum("data", "sonicmoe", list(grid.DATA_SCALES), "input scales "
                  "(grid.random_problem)")
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(40960, 768, 256, 128, 8), (32768, 4096, 2048, 64, 4)]


def profile_step(cfg):
  x, rw, w1, w2, d_out = grid.random_problem(cfg, data=FLAGS.data)
  fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4],
                                            backend=FLAGS.backend)[0]
  if FLAGS.forward_only:
    step, args = jax.jit(fwd), (x, rw, w1, w2)
  else:
    step, args = jax.jit(timing.forward_and_backward(fwd)), (x, rw, w1, w2, d_out)
  # Back-to-back calls alternate between two input sets (new buffers each call, as moe_bench's
  # rotating inputs), so that what XLA redoes per call when its buffers move is in the profile.
  arg_sets = [args, tuple(jnp.copy(a) for a in args)]
  for i in range(4):  # compile and warm up
    jax.block_until_ready(step(*arg_sets[i % 2]))
  # One step alone: its gaps are the step's own; several: the host may run ahead of the GPU.
  events = [(start, start + duration, name) for start, duration, name in timing.traced_events(
      lambda: [step(*arg_sets[i % 2]) for i in range(FLAGS.calls)])]
  if not events:
    raise SystemExit("step_timeline: the trace has no GPU kernels (it needs a GPU)")
  t0 = events[0][0]
  span = max(e for _, e, _ in events) - t0
  busy = sum(e - s for s, e, _ in events)
  gaps, end = [], events[0][1]
  for (s, e, name), (_, _, prev) in zip(events[1:], events[:-1]):
    if s > end:
      gaps.append((s - end, prev, name))
    end = max(end, e)
  totals = defaultdict(float)
  for s, e, name in events:
    totals[name] += e - s
  return {
      "config": grid.config_name(cfg), "span_us": span / 1e3, "kernels_us": busy / 1e3,
      "idle_us": sum(g for g, _, _ in gaps) / 1e3, "num_events": len(events),
      "largest_gaps": [(g / 1e3, a[:60], b[:60]) for g, a, b in sorted(gaps, reverse=True)[:8]],
      "by_kernel_us": sorted(((n[:80], t / 1e3) for n, t in totals.items()),
                             key=lambda kv: -kv[1])[:14],
      "timeline": [((s - t0) / 1e3, (e - s) / 1e3, n[:80]) for s, e, n in events],
  }


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, DEFAULT_CONFIGS)
  os.makedirs(FLAGS.out, exist_ok=True)
  for cfg in configs:
    r = profile_step(cfg)
    r["calls"] = FLAGS.calls
    kind = ("fwd_" if FLAGS.forward_only else "") + f"{FLAGS.data}_data_"
    with open(os.path.join(FLAGS.out, f"timeline_{kind}{r['config']}_{FLAGS.calls}.json"),
              "w") as f:
      json.dump(r, f, indent=1)
    print(f"{r['config']}: span {r['span_us']:.0f} us, kernels {r['kernels_us']:.0f} us, "
          f"idle {r['idle_us']:.0f} us over {r['num_events']} events"
          + (f" ({FLAGS.calls} calls: per call span {r['span_us'] / FLAGS.calls:.0f} us, kernels "
             f"{r['kernels_us'] / FLAGS.calls:.0f} us, idle {r['idle_us'] / FLAGS.calls:.0f} us)"
             if FLAGS.calls > 1 else ""))
    for g, a, b in r["largest_gaps"]:
      print(f"  gap {g:8.1f} us  after {a}  before {b}")
    for name, t in r["by_kernel_us"]:
      print(f"  {t:9.1f} us  {name}")


if __name__ == "__main__":
  app.run(main)
