r"""Each kernel's device time per call of the `mosaic_gpu` layer in three loads: a do_bench burst
(`timing.time_do_bench`: 200 ms of calls each after an L2 flush, from a cool GPU, as SonicMoE's
anchors are timed), a sustained load of the same flushed calls, and a sustained load of calls
without flushes; with nvidia-smi's SM clock during each.

  python -m benchmarks.burst_kernels [--thiek=T,d,n,E,K ...] [--step] [--load_s=1.5]
      [--keep=10] [--data=sonicmoe|unit] [--out=dir]

Why: in do_bench bursts our forward loses 1-5% to SonicMoE's at equal clocks while under a
sustained load without flushes its kernels run ahead (twenty-fourth session). Setting one kernel's
time in a burst next to its time under each load says which kernel the burst slows and whether the
flushes or the clocks do it. (Its first runs found neither: inside a burst each kernel takes its
time under the load, and the burst's median depends on which clock plateau the power controller
is on; benchmarks/NOTES.md, twenty-fifth session.) The sustained loads run inside the profiler trace (starting a trace
idles the GPU) and keep their last `keep` calls. `--step` times the training step (output and
gradients) instead of the forward. Prints per configuration the call's span and its kernels, us
per call (median over calls); writes everything to `out/burst_kernels.json`, with the burst's
span per call and its longest kernels' times per call (the clock plateaus it steps through).
nvidia-smi's clock for the burst also samples the idle GPU around it (the trace's start and
stop), so it reads high; the loads' clocks are their second halves'. Needs a GPU.
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
from benchmarks.clock_probe import SmiSampler

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_bool("step", False, "the training step (forward and backward) instead of the forward")
flags.DEFINE_float("load_s", 1.5, "seconds of each sustained load")
flags.DEFINE_integer("keep", 10, "calls kept from the end of each sustained load")
flags.DEFINE_float("idle_s", 2.0, "seconds idle before the burst (do_bench starts from a cool GPU)")
flags.DEFINE_enum("data", "sonicmoe", list(grid.DATA_SCALES), "input scales (grid.random_problem)")
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(32768, 4096, 1024, 64, 4), (32768, 4096, 1024, 128, 8)]
MODES = ("burst", "flushed load", "load")


def traced_load(compiled, args, seconds, keep, flush=None, buf=None):
  """(span seconds per call, {kernel: seconds per call}) over the last `keep` calls of `seconds`
  of back-to-back calls (each after `flush(buf)` when given) inside one profiler trace."""
  state = {"buf": buf}

  def flush_once():
    state["buf"] = flush(state["buf"])
    return state["buf"]

  def one_round():
    if flush is not None:
      flush_once()
    return compiled(*args), state["buf"]

  flush_events = 0 if flush is None else len(timing.traced_events(flush_once))
  call_events = len(timing.traced_events(lambda: compiled(*args)))
  loaded = []

  def load():
    loaded.append(timing.sustained_load(one_round, [()], seconds))
    return one_round()  # the last call, waited for

  events = timing.traced_events(load)
  try:
    tail = timing.last_calls(events, loaded[0] + 1, keep)
  except ValueError as e:
    raise SystemExit(f"burst_kernels: {e}")
  spans = timing.per_call_spans(tail, flush_events, call_events, keep)
  if spans is None:  # each call did not put flush_events + call_events on the stream
    raise SystemExit(f"burst_kernels: {len(tail)} events over {keep} calls of "
                     f"{flush_events + call_events}")
  return statistics.median(spans), timing.kernels_in_calls(tail, flush_events, call_events, keep)


def top_kernels(per_call, count=8):
  """The `count` longest kernels' entries of {name: [seconds in each call]}: how they drift over
  the burst as the clocks come down."""
  return dict(sorted(per_call.items(), key=lambda kv: -statistics.median(kv[1]))[:count])


def measure(compiled, args):
  flush, buf = timing.flush_fn(256 << 20)
  result = {}
  time.sleep(FLAGS.idle_s)
  with SmiSampler() as smi:
    span, info = timing.time_do_bench(compiled, args)
  result["burst"] = {"span_s": span, "kernels_s": info.get("kernels_s"), "calls": info["calls"],
                     "spans_s": info["samples_s"], **smi.summary(),
                     "kernels_per_call_s": top_kernels(info.get("kernels_per_call_s") or {})}
  for mode, f in (("flushed load", flush), ("load", None)):
    with SmiSampler() as smi:
      span, kernels = traced_load(compiled, args, FLAGS.load_s, FLAGS.keep, flush=f, buf=buf)
    smi.samples = smi.samples[len(smi.samples) // 2:]
    result[mode] = {"span_s": span, "kernels_s": kernels, **smi.summary()}
  return result


def short(name, width=58):
  return name if len(name) <= width else name[:width - 3] + "..."


def main(_):
  if jax.devices()[0].platform != "gpu":
    raise SystemExit("burst_kernels: needs a GPU (its figures are a profiler's device times)")
  os.makedirs(FLAGS.out, exist_ok=True)
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "data": FLAGS.data,
         "step": FLAGS.step, "load_s": FLAGS.load_s, "keep": FLAGS.keep, "configs": []}
  table = []
  for cfg in grid.parse_configs(FLAGS.thiek, DEFAULT_CONFIGS):
    x, rw, w1, w2, d_out = grid.random_problem(cfg, data=FLAGS.data)
    fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4],
                                              backend="mosaic_gpu")[0]
    if FLAGS.step:
      compiled, _ = timing.compile_fn(timing.forward_and_backward(fwd), x, rw, w1, w2, d_out)
      args = (x, rw, w1, w2, d_out)
    else:
      compiled, _ = timing.compile_fn(fwd, x, rw, w1, w2)
      args = (x, rw, w1, w2)
    r = measure(compiled, args)
    out["configs"].append({"config": list(cfg), **r})
    with open(os.path.join(FLAGS.out, "burst_kernels.json"), "w") as f:
      json.dump(out, f, indent=1)
    table.append((cfg, r))
  for cfg, r in table:
    head = " / ".join(f"{m} {r[m]['span_s'] * 1e6:.0f} us at {r[m]['clock_mhz']} MHz"
                      for m in MODES)
    print(f"\n{grid.config_name(cfg)} ({'step' if FLAGS.step else 'forward'}): {head}")
    names = sorted(r["load"]["kernels_s"], key=lambda n: -r["load"]["kernels_s"][n])
    print(f"  {'kernel':58s} " + " ".join(f"{m:>13s}" for m in MODES) + "   burst/load")
    for name in names[:12]:
      t = [(r[m]["kernels_s"] or {}).get(name) for m in MODES]
      cells = " ".join(f"{v * 1e6:13.1f}" if v else f"{'-':>13s}" for v in t)
      ratio = f"{t[0] / t[2]:.3f}" if t[0] and t[2] else "-"
      print(f"  {short(name):58s} {cells}   {ratio}")
    rest = [sum(v for n, v in (r[m]["kernels_s"] or {}).items() if n not in names[:12])
            for m in MODES]
    print(f"  {'(the rest)':58s} " + " ".join(f"{v * 1e6:13.1f}" for v in rest))


if __name__ == "__main__":
  app.run(main)
