r"""How a layer's time per call moves as the GPU's clocks drop under load, for sonic_jax or for
SonicMoE, timed as SonicMoE's anchors were (triton do_bench style), with the SM clock and the
board power sampled by nvidia-smi during each measurement.

  python -m benchmarks.clock_probe [--impl=sonic_jax|sonicmoe] [--data=ours|sonicmoe]
      [--thiek=T,d,n,E,K ...] [--rep_ms=200] [--out=dir]

Why: an H100 under a long bf16 GEMM load runs into its power cap and lowers its clocks within
~100 ms, so a call's time depends on how much power the kernels draw, not only on their
instructions. `--data` picks the inputs: "ours" as `moe_bench` (x and dO ~ N(0, 1), weights of
std 1/sqrt(fan-in)), "sonicmoe" as `../shared/bench/sonic_ref.py` (x and dO ~ 0.2 N(0, 1), every
weight of std 0.02). `--impl=sonicmoe` needs PyTorch and the SonicMoE bundle (see
`sonic_profile.py`) and always uses SonicMoE's data. Prints per configuration and phase (forward,
forward+backward): the median, first and last call, and the median SM clock and power while it
ran; writes every sample to `out/clock_probe_<impl>.json`. nvidia-smi's power reading is an
average over about a second, so over a 200 ms burst it reads low: the clock is the column to
trust. With `--impl=sonicmoe`, restore SonicMoE's compile caches first (on a fresh machine its
kernels compile for minutes): from the repository root,
`source benchmarks/sonic_env.sh; sonic_python -m benchmarks.clock_probe --impl=sonicmoe ...`
(as the twenty-first session ran it, results/h100_clock_probe_sonicmoe_twentyfirst.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

DEFAULT_CONFIGS = ["32768,4096,1024,128,8", "32768,4096,2048,64,4"]


class SmiSampler:
  """nvidia-smi's SM clock (MHz) and board power (W) every `period_ms` while in a `with` block."""

  def __init__(self, period_ms=20):
    self.period_ms = period_ms
    self.samples = []

  def __enter__(self):
    try:
      self._proc = subprocess.Popen(
          ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
           f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
      self._proc = None
    time.sleep(0.05)
    return self

  def __exit__(self, *exc):
    if self._proc is None:
      return
    time.sleep(0.05)
    self._proc.terminate()
    out, _ = self._proc.communicate()
    for line in out.splitlines():
      try:
        clock, power = (float(v) for v in line.split(","))
      except ValueError:
        continue
      self.samples.append((clock, power))

  def summary(self):
    if not self.samples:
      return {"clock_mhz": None, "power_w": None, "samples": 0}
    clocks, powers = zip(*self.samples)
    return {"clock_mhz": statistics.median(clocks), "power_w": statistics.median(powers),
            "clock_min_mhz": min(clocks), "samples": len(clocks)}


def sonic_jax_phases(cfg, datas):
  """{(data, phase): (compiled, args)} for sonic_jax's layer (mosaic_gpu backend), compiled once."""
  import sonic_jax
  from benchmarks import grid, timing
  fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4],
                                            backend="mosaic_gpu")[0]
  ours = grid.random_problem(cfg)
  c_fwd = timing.compile_fn(fwd, *ours[:4])[0]
  c_step = timing.compile_fn(timing.forward_and_backward(fwd), *ours)[0]
  phases = {}
  for data in datas:
    args = ours if data == "ours" else grid.random_problem(cfg, seed=7, data=data)
    phases[(data, "forward")] = (c_fwd, args[:4])
    phases[(data, "forward+backward")] = (c_step, args)
  return phases


def time_sonic_jax(phase, rep_ms):
  from benchmarks import timing
  compiled, args = phase
  _, info = timing.time_do_bench(compiled, args, rep_ms=rep_ms)
  return [s * 1e3 for s in info["samples_s"]]


def sonicmoe_phases(cfg, datas):
  """{phase: fn} for SonicMoE's layer, built as sonic_ref.py builds it (its data always)."""
  import torch
  try:
    from benchmarks.sonic_profile import sonicmoe_layer
  except ImportError:  # run as a script, without the repository on the path
    from sonic_profile import sonicmoe_layer
  forward, step = sonicmoe_layer(cfg)
  forward(), step()
  torch.cuda.synchronize()
  return {("sonicmoe", "forward"): forward, ("sonicmoe", "forward+backward"): step}


def time_sonicmoe(fn, rep_ms):
  from triton.testing import do_bench
  return list(do_bench(fn, warmup=5, rep=rep_ms, return_mode="all"))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--impl", choices=["sonic_jax", "sonicmoe"], default="sonic_jax")
  parser.add_argument("--data", default="ours",
                      help="comma-separated: ours, sonicmoe (sonic_jax only; SonicMoE's own runs "
                           "use its data)")
  parser.add_argument("--thiek", action="append", help="configuration T,d,n,E,K (repeatable)")
  parser.add_argument("--rep_ms", type=float, default=200.0)
  parser.add_argument("--idle_s", type=float, default=2.0,
                      help="idle seconds before each measurement (do_bench's callers compile "
                           "between measurements; the GPU cools meanwhile)")
  parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
  args = parser.parse_args()
  datas = ["sonicmoe"] if args.impl == "sonicmoe" else args.data.split(",")
  build, timer = ((sonic_jax_phases, time_sonic_jax) if args.impl == "sonic_jax"
                  else (sonicmoe_phases, time_sonicmoe))
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"clock_probe_{args.impl}.json")
  out, rows = {"impl": args.impl, "rep_ms": args.rep_ms, "configs": {}}, []
  for spec in args.thiek or DEFAULT_CONFIGS:
    cfg = tuple(int(v) for v in spec.split(","))
    out["configs"][spec] = {}
    for (data, phase), fn in build(cfg, datas).items():
      time.sleep(args.idle_s)
      with SmiSampler() as smi:
        samples = timer(fn, args.rep_ms)
      rec = {"median_ms": statistics.median(samples), "first_ms": samples[0],
             "last_ms": samples[-1], "calls": len(samples), "samples_ms": samples, **smi.summary()}
      out["configs"][spec][f"{data} data, {phase}"] = rec
      rows.append((spec, data, phase, rec))
      with open(path, "w") as f:
        json.dump(out, f, indent=1)
  print(f"\n{args.impl}: ms per call (median, first, last), SM MHz and W (median)")
  for spec, data, phase, r in rows:
    print(f"{spec:>24} {data:<9} {phase:<17} {r['median_ms']:8.3f} {r['first_ms']:8.3f} "
          f"{r['last_ms']:8.3f}  x{r['calls']:<4} {r['clock_mhz']} MHz {r['power_w']} W")


if __name__ == "__main__":
  main()
