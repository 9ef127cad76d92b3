r"""How a layer's time per call moves as the GPU's clocks drop under load, for sonic_jax or for
SonicMoE, timed as SonicMoE's anchors were (triton do_bench style), with the SM clock and the
board power sampled by nvidia-smi during each measurement.

  python -m benchmarks.clock_probe [--impl=sonic_jax|sonicmoe|both] [--data=ours|sonicmoe]
      [--thiek=T,d,n,E,K ...] [--rep_ms=200] [--rounds=1] [--phases=forward,forward+backward]
      [--layouts=concat,interleaved] [--energy] [--out=dir]

Why: an H100 under a long bf16 GEMM load runs into its power cap and lowers its clocks within
~100 ms, so a call's time depends on how much power the kernels draw, not only on their
instructions. `--data` picks the inputs: "ours" as `moe_bench` (x and dO ~ N(0, 1), weights of
std 1/sqrt(fan-in)), "sonicmoe" as `../shared/bench/sonic_ref.py` (x and dO ~ 0.2 N(0, 1), every
weight of std 0.02). `--impl=sonicmoe` needs PyTorch and the SonicMoE bundle (see
`sonic_profile.py`) and always uses SonicMoE's data. Prints per configuration and phase (forward,
forward+backward): the median, first and last call, and the median SM clock and power while it
ran; writes every sample to `out/clock_probe_<impl>.json`. nvidia-smi's power reading is an
average over about a second, so over a 200 ms burst it reads low: the clock is the column to
trust. NVML's energy counter, read at the start and end of each sampled block, is kept too
("mean_power_w"; for sonic_jax the block also holds the profiler's start and stop, idle time).
`--energy` adds, after each timed burst and the same idle, a burst of the same length that
neither implementation times per call (no profiler, no events): (L2 flush, call) rounds back to
back, NVML's counter read around them, so that joules per call and mean watts compare the two
for the same work. With `--impl=sonicmoe`, restore SonicMoE's compile caches first (on a fresh
machine its kernels compile for minutes): from the repository root,
`source benchmarks/sonic_env.sh; sonic_python -m benchmarks.clock_probe --impl=sonicmoe ...`
(as the twenty-first session ran it, results/h100_clock_probe_sonicmoe_twentyfirst.json).
`--impl=both` builds SonicMoE's layer and sonic_jax's (one entry per `--layouts` layout, SonicMoE's
data) in one process (run it as `sonic_python` too) and times each phase `--rounds` times, the
entries alternating (the order reversed every other round, each after `--idle_s` idle), then
prints sonic_jax's time over SonicMoE's per round. Why: a 200 ms burst's median falls on one of a
few clock plateaus that the power controller steps through at times that differ between bursts
(twenty-fifth session), so one burst each is a coin toss of a few percent.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import time

DEFAULT_CONFIGS = ["32768,4096,1024,128,8", "32768,4096,2048,64,4"]
PHASES = ("forward", "forward+backward")


def _energy_counter():
  """A function returning the GPU's total energy in joules (NVML's counter, updated far more often
  than nvidia-smi's one-second power average), or None where NVML is not available."""
  try:
    import pynvml
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
  except Exception:  # no NVML, no GPU, or a GPU without the counter
    return None
  return lambda: pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3


class SmiSampler:
  """nvidia-smi's SM clock (MHz) and board power (W) every `period_ms` while in a `with` block,
  and NVML's energy counter read at its start and end: the mean power over exactly the block."""

  def __init__(self, period_ms=20):
    self.period_ms = period_ms
    self.samples = []
    self._energy = _energy_counter()
    self.energy_j = self.seconds = None

  def __enter__(self):
    try:
      self._proc = subprocess.Popen(
          ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
           f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:
      self._proc = None
    time.sleep(0.05)
    if self._energy is not None:
      self._start = (self._energy(), time.perf_counter())
    return self

  def __exit__(self, *exc):
    if self._energy is not None:
      self.energy_j = self._energy() - self._start[0]
      self.seconds = time.perf_counter() - self._start[1]
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
    energy = ({"energy_j": self.energy_j, "mean_power_w": self.energy_j / self.seconds}
              if self.energy_j is not None and self.seconds else {"mean_power_w": None})
    if not self.samples:
      return {"clock_mhz": None, "power_w": None, "samples": 0, **energy}
    clocks, powers = zip(*self.samples)
    return {"clock_mhz": statistics.median(clocks), "power_w": statistics.median(powers),
            "clock_min_mhz": min(clocks), "samples": len(clocks), **energy}


def sonic_jax_phases(cfg, datas, phases=PHASES, gate_up_layout="concat"):
  """{(data, phase): (compiled, args)} for sonic_jax's layer (mosaic_gpu backend), compiled once
  (random weights: either gate/up layout reads them as its own)."""
  import sonic_jax
  from benchmarks import grid, timing
  fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4], backend="mosaic_gpu",
                                            gate_up_layout=gate_up_layout)[0]
  ours = grid.random_problem(cfg)
  compiled = {}
  if "forward" in phases:
    compiled["forward"] = timing.compile_fn(fwd, *ours[:4])[0]
  if "forward+backward" in phases:
    compiled["forward+backward"] = timing.compile_fn(timing.forward_and_backward(fwd), *ours)[0]
  result = {}
  for data in datas:
    args = ours if data == "ours" else grid.random_problem(cfg, seed=7, data=data)
    for phase, c in compiled.items():
      result[(data, phase)] = (c, args[:4] if phase == "forward" else args)
  return result


def time_sonic_jax(phase, rep_ms):
  from benchmarks import timing
  compiled, args = phase
  _, info = timing.time_do_bench(compiled, args, rep_ms=rep_ms)
  return [s * 1e3 for s in info["samples_s"]]


def sonicmoe_phases(cfg, datas, phases=PHASES):
  """{phase: fn} for SonicMoE's layer, built as sonic_ref.py builds it (its data always)."""
  import torch
  try:
    from benchmarks.sonic_profile import sonicmoe_layer
  except ImportError:  # run as a script, without the repository on the path
    from sonic_profile import sonicmoe_layer
  forward, step = sonicmoe_layer(cfg)
  fns = {("sonicmoe", "forward"): forward, ("sonicmoe", "forward+backward"): step}
  fns = {key: fn for key, fn in fns.items() if key[1] in phases}
  for fn in fns.values():  # a cold training step compiles for minutes: only what is timed
    fn()
  torch.cuda.synchronize()
  return fns


def time_sonicmoe(fn, rep_ms):
  from triton.testing import do_bench
  return list(do_bench(fn, warmup=5, rep=rep_ms, return_mode="all"))


def energy_burst(call, flush, sync, rep_ms, energy):
  """(calls, seconds, joules) of a do_bench-like burst without a profiler or per-call events:
  one untimed (flush, call) round (a fresh flush compiles), calls sized from 3 timed rounds to
  last `rep_ms`, then that many rounds back to back, NVML's energy counter read after a
  synchronisation on each side. Both implementations take the same kind of burst, so joules per
  call compare their energy for the same work (the flushes' alike). The counter moves in steps
  (on the H100s here it read 0 J over some 45 ms bursts and over 1 kW mean over others): use
  bursts of a second or more, or many rounds."""
  flush()
  call()
  sync()
  t0 = time.perf_counter()
  for _ in range(3):
    flush()
    call()
  sync()
  calls = max(1, round(rep_ms / 1e3 / ((time.perf_counter() - t0) / 3)))
  e0, t0 = energy(), time.perf_counter()
  for _ in range(calls):
    flush()
    call()
  sync()
  return calls, time.perf_counter() - t0, energy() - e0


def sonic_jax_energy(phase, rep_ms, energy):
  import jax
  from benchmarks import timing
  compiled, args = phase
  flush, buf = timing.flush_fn(256 << 20)
  state = {"buf": buf, "out": None}

  def do_flush():
    state["buf"] = flush(state["buf"])

  def call():
    state["out"] = compiled(*args)
  return energy_burst(call, do_flush, lambda: jax.block_until_ready((state["out"], state["buf"])),
                      rep_ms, energy)


def sonicmoe_energy(fn, rep_ms, energy):
  import torch
  cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
  return energy_burst(fn, cache.zero_, torch.cuda.synchronize, rep_ms, energy)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--impl", choices=["sonic_jax", "sonicmoe", "both"], default="sonic_jax",
                      help="both: SonicMoE's layer and sonic_jax's (its data) in one process, "
                      "their bursts alternating over --rounds rounds")
  parser.add_argument("--rounds", type=int, default=1,
                      help="measurements of each phase (with --impl=both, alternating the order)")
  parser.add_argument("--data", default="ours",
                      help="comma-separated: ours, sonicmoe (sonic_jax only; SonicMoE's own runs "
                           "use its data)")
  parser.add_argument("--thiek", action="append", help="configuration T,d,n,E,K (repeatable)")
  parser.add_argument("--rep_ms", type=float, default=200.0)
  parser.add_argument("--idle_s", type=float, default=2.0,
                      help="idle seconds before each measurement (do_bench's callers compile "
                           "between measurements; the GPU cools meanwhile)")
  parser.add_argument("--layouts", default="concat",
                      help="sonic_jax's gate/up layouts to time, comma-separated (concat, "
                      "interleaved): each a sonic_jax entry of its own")
  parser.add_argument("--phases", default=",".join(PHASES),
                      help=f"comma-separated, of {','.join(PHASES)}")
  parser.add_argument("--energy", action="store_true",
                      help="after each timed burst (and the same idle), an untimed burst of the "
                      "same length without a profiler, its energy per call from NVML's counter")
  parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
  args = parser.parse_args()
  phases_wanted = tuple(args.phases.split(","))
  if not set(phases_wanted) <= set(PHASES):
    parser.error(f"--phases must name some of {PHASES}, got {args.phases!r}")
  ours = [f"sonic_jax:{layout}" for layout in args.layouts.split(",")]
  impls = ["sonicmoe"] + ours if args.impl == "both" else (
      ours if args.impl == "sonic_jax" else ["sonicmoe"])
  if args.impl == "both":  # two frameworks on one GPU: neither may take most of its memory first
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  builders = {"sonicmoe": (sonicmoe_phases, time_sonicmoe, sonicmoe_energy)}
  for impl in ours:
    builders[impl] = (functools.partial(sonic_jax_phases, gate_up_layout=impl.split(":")[1]),
                      time_sonic_jax, sonic_jax_energy)
  energy = _energy_counter() if args.energy else None
  if args.energy and energy is None:
    parser.error("--energy needs NVML's energy counter (pynvml and a GPU that has it)")
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, f"clock_probe_{args.impl}.json")
  out, rows = {"impl": args.impl, "rep_ms": args.rep_ms, "rounds": args.rounds,
               "configs": {}}, []
  for spec in args.thiek or DEFAULT_CONFIGS:
    cfg = tuple(int(v) for v in spec.split(","))
    out["configs"][spec] = {}
    phases = {}
    for impl in impls:
      build, timer, energy_timer = builders[impl]
      datas = (["sonicmoe"] if impl == "sonicmoe" or args.impl == "both"
               else args.data.split(","))
      for (data, phase), fn in build(cfg, datas, phases_wanted).items():
        phases.setdefault(phase, []).append((impl, data, fn, timer, energy_timer))
    for phase, entries in phases.items():
      for r in range(args.rounds):
        # Alternate which implementation goes first: the GPU's state drifts over a run.
        for impl, data, fn, timer, energy_timer in (entries if r % 2 == 0 else entries[::-1]):
          time.sleep(args.idle_s)
          with SmiSampler() as smi:
            samples = timer(fn, args.rep_ms)
          rec = {"round": r, "median_ms": statistics.median(samples), "first_ms": samples[0],
                 "last_ms": samples[-1], "calls": len(samples), "samples_ms": samples,
                 **smi.summary()}
          if energy is not None:
            time.sleep(args.idle_s)
            calls, seconds, joules = energy_timer(fn, args.rep_ms, energy)
            rec["energy_burst"] = {"calls": calls, "seconds": seconds, "joules": joules,
                                   "mj_per_call": joules / calls * 1e3,
                                   "ms_per_call": seconds / calls * 1e3,
                                   "mean_power_w": joules / seconds}
          key = f"{impl}, {phase}" if args.impl == "both" else f"{impl}, {data} data, {phase}"
          out["configs"][spec].setdefault(key, []).append(rec)
          rows.append((spec, impl, data, phase, rec))
          with open(path, "w") as f:
            json.dump(out, f, indent=1)
  print(f"\n{args.impl}: ms per call (median, first, last), SM MHz and W (nvidia-smi's median)")
  for spec, impl, data, phase, r in rows:
    print(f"{spec:>24} {impl:<21} {data:<9} {phase:<17} r{r['round']} {r['median_ms']:8.3f} "
          f"{r['first_ms']:8.3f} {r['last_ms']:8.3f}  x{r['calls']:<4} {r['clock_mhz']} MHz "
          f"{r['power_w']} W")
    if "energy_burst" in r:
      e = r["energy_burst"]
      print(f"{'':>24} {'':<21} {'':<9} {'(energy burst)':<17}    {e['ms_per_call']:8.3f} ms per "
            f"flush+call, {e['mj_per_call']:.0f} mJ per call, {e['mean_power_w']:.0f} W mean, "
            f"x{e['calls']}")
  if args.impl == "both":
    print("\nsonic_jax / SonicMoE time per call, per round (median of the ratios)")
    for spec, recs in out["configs"].items():
      for phase in PHASES:
        theirs = recs.get(f"sonicmoe, {phase}", [])
        for impl in ours:
          ratios = [a["median_ms"] / b["median_ms"]
                    for a, b in zip(recs.get(f"{impl}, {phase}", []), theirs)]
          if ratios:
            print(f"{spec:>24} {phase:<17} {impl:<21} " + " ".join(f"{v:.3f}" for v in ratios)
                  + f"  (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
  main()
