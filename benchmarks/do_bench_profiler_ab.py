r"""Does timing under the profiler move our do_bench figures? The layer's forward and training step
timed as SonicMoE's anchors were (`timing.time_do_bench`: a burst of calls, an L2 flush before
each) two ways in alternating rounds: each call's device span from a profiler trace of the burst
(how `moe_bench --do_bench` times ours), and the burst's host time without any profiler, the
flushes' own time (a flush-only burst right after) taken out, per call (how CUDA events time
SonicMoE's, with no tracing). SonicMoE's anchors are never traced.

  python -m benchmarks.do_bench_profiler_ab [--thiek=T,d,n,E,K ...] [--rounds=4] [--rep_ms=200]
      [--out=dir]
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags
import jax

import sonic_jax
from benchmarks import grid, timing

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_integer("rounds", 4, "rounds of the two timings (their order alternating)")
flags.DEFINE_float("rep_ms", 200.0, "burst length (do_bench's rep)")
flags.DEFINE_string("out", "bench_out", "output folder")
FLAGS = flags.FLAGS


def main(_):
  os.makedirs(FLAGS.out, exist_ok=True)
  results = []
  for cfg in grid.parse_configs(FLAGS.thiek, [(32768, 4096, 1024, 64, 4)]):
    x, rw, w1, w2, d_out = grid.random_problem(cfg, data="sonicmoe")
    fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4],
                                              backend="mosaic_gpu")[0]
    phases = {"forward": (timing.compile_fn(fwd, x, rw, w1, w2)[0], (x, rw, w1, w2)),
              "forward+backward": (timing.compile_fn(timing.forward_and_backward(fwd), x, rw,
                                                     w1, w2, d_out)[0], (x, rw, w1, w2, d_out))}
    flush, buf = timing.flush_fn(256 << 20)
    for phase, (compiled, args) in phases.items():
      rec = {"config": list(cfg), "phase": phase, "traced_ms": [], "untraced_ms": []}
      calls = timing.time_do_bench(compiled, args, rep_ms=FLAGS.rep_ms)[1]["calls"]
      for r in range(FLAGS.rounds):  # each timing after 2 s idle, in alternating order
        for kind in (("traced", "untraced") if r % 2 == 0 else ("untraced", "traced")):
          time.sleep(2.0)
          if kind == "traced":
            rec["traced_ms"].append(timing.time_do_bench(compiled, args,
                                                         rep_ms=FLAGS.rep_ms)[0] * 1e3)
          else:
            for _ in range(5):  # do_bench's warm-up
              jax.block_until_ready(compiled(*args))
            t, buf = timing.untraced_burst(compiled, args, calls, flush, buf)
            rec["untraced_ms"].append(t * 1e3)
      results.append(rec)
      print(f"{grid.config_name(cfg)} {phase:<17} traced median "
            f"{statistics.median(rec['traced_ms']):8.3f} ms  untraced mean "
            f"{statistics.median(rec['untraced_ms']):8.3f} ms  rounds "
            f"{[round(v, 3) for v in rec['traced_ms']]} / "
            f"{[round(v, 3) for v in rec['untraced_ms']]}", flush=True)
      with open(os.path.join(FLAGS.out, "do_bench_profiler_ab.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
  app.run(main)
