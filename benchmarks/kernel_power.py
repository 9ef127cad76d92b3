r"""Which of the layer's kernels draw the most power: each kernel run alone under a sustained load,
its time per call near boost clocks and under that load, with the SM clock and board power that
nvidia-smi samples during the load.

  python -m benchmarks.kernel_power [--thiek=T,d,n,E,K ...] [--kernels=NAME ...] [--load_s=2]
      [--data=unit|sonicmoe] [--out=dir]

Why: under an H100's power cap a bf16 GEMM's time per call is its energy per call over the cap,
so a kernel that loses more of its boost-clock speed under its own load (and holds a lower clock)
spends more energy per unit of work, and in a training step it lowers the clocks of every kernel
around it. Kernels are `kernel_bench`'s (the configuration the backend gives each; --kernels picks
some by name). Per kernel: 2 s idle, 2 calls (the clocks come up), the median of 5 host-timed
calls (near boost clocks; each synchronised, so a few us of launch each); then `load_s` seconds
of back-to-back calls and the median of 10 timed calls right after (under load), nvidia-smi
sampling the SM clock and power from the load's second half to the end. nvidia-smi's power
reading averages over about a second: trust the clock and the loaded time first, and compare
kernels within one run (H100s of the kind run at different clocks under the cap). Writes
`out/kernel_power.json`. Needs a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from absl import app, flags
import jax

from benchmarks import grid, kernel_bench, timing
from benchmarks.clock_probe import SmiSampler

flags.DEFINE_multi_string("kernels", None, "kernel_bench kernel names to probe (default: all)")
flags.DEFINE_float("load_s", 2.0, "seconds of back-to-back calls before the loaded timing")
flags.DEFINE_float("idle_s", 2.0, "seconds idle before the boost-clock timing")
flags.DEFINE_enum("data", "unit", list(grid.DATA_SCALES), "input scales (grid.random_problem)")
FLAGS = flags.FLAGS

DEFAULT_KERNELS = ["up (fused gather)", "down", "bwd dH (fused gather)",
                   "bwd dw1 = x^T dH (fused gather)", "bwd dw2 = A_s^T dO (fused gather)",
                   "bwd dX rows (dH w1^T)"]


def timed_calls(compiled, args, calls):
  """Median seconds per call of `calls` calls, each synchronised (host-timed)."""
  samples = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    samples.append(time.perf_counter() - t0)
  return statistics.median(samples)


def probe(compiled, args, load_s, idle_s):
  time.sleep(idle_s)
  timed_calls(compiled, args, 2)  # an idle GPU idles its clocks too: let them come up first
  cool = timed_calls(compiled, args, 5)
  with SmiSampler() as smi:
    calls = timing.sustained_load(compiled, [args], load_s)
    loaded = timed_calls(compiled, args, 10)
  smi.samples = smi.samples[len(smi.samples) // 2:]  # the load's second half and after
  return {"cool_ms": cool * 1e3, "loaded_ms": loaded * 1e3, "load_calls": calls,
          "loaded_over_cool": loaded / cool, **smi.summary()}


def main(_):
  os.makedirs(FLAGS.out, exist_ok=True)
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "data": FLAGS.data,
         "load_s": FLAGS.load_s, "configs": []}
  for cfg in grid.parse_configs(FLAGS.thiek, [(32768, 4096, 512, 256, 16)]):
    _, kernels = kernel_bench.build_kernels(cfg, FLAGS.data)
    names = FLAGS.kernels or DEFAULT_KERNELS
    result = {"config": list(cfg), "kernels": {}}
    for name in names:
      fn, args, flops, _ = kernels[name]
      compiled, _ = timing.compile_fn(fn, *args)
      r = probe(compiled, args, FLAGS.load_s, FLAGS.idle_s)
      r["loaded_tflops"] = flops / (r["loaded_ms"] * 1e-3) / 1e12 if flops else None
      result["kernels"][name] = r
      print(f"{grid.config_name(cfg)} {name:<36} cool {r['cool_ms']:8.3f} ms  loaded "
            f"{r['loaded_ms']:8.3f} ms ({r['loaded_over_cool']:.3f})  SM clock "
            f"{r['clock_mhz']} MHz (min {r.get('clock_min_mhz')})  power {r['power_w']} W",
            flush=True)
    out["configs"].append(result)
    with open(os.path.join(FLAGS.out, "kernel_power.json"), "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
