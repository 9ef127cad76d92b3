r"""SonicMoE's kernels one by one, on this GPU: device time per kernel of its forward and of its
training step (torch.profiler), to put next to `step_timeline`'s figures for sonic_jax's kernels.

Needs PyTorch and the SonicMoE bundle (`../shared/bench/sonic-wheels.sh`: carry `.sonic` and
install it as that script's header says). Usage:

  python benchmarks/sonic_profile.py [--thiek=T,d,n,E,K ...] [--calls=N] [--warm_ms=MS]
      [--burst] [--phases=forward,step] [--out=dir]

The layer is built as `../shared/bench/sonic_ref.py` builds it (softmax over the top-K, SwiGLU,
bfloat16, no bias). After two warm-up calls, `calls` back-to-back forwards and then `calls` training
steps (forward, backward from a fixed dO) are profiled (with --warm_ms, right after that many
milliseconds of back-to-back calls inside the same profile: the GPU at its power cap, as in a
sustained benchmark, rather than near boost clocks); per kernel name it prints the device time
per call and the number of launches per call, largest first, and writes everything to
`out/sonic_profile.json` (after each profiled phase: on a fresh machine the first training step of
a d = 4096 configuration compiles for minutes). With --burst, each phase is profiled as triton's
do_bench times it instead (SonicMoE's anchors; ours: `burst_kernels.py`): after 2 s idle, calls
sized from 5 flushed calls, 5 ms of warm-up, then 200 ms of calls each after a 256 MB L2 flush,
inside the profile; per kernel the median over those calls, and the calls' median span.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

DEFAULT_CONFIGS = ["32768,4096,1024,128,8", "32768,4096,2048,64,4"]


def _last_calls_events(prof, calls, warm_calls):
  """The device events (kernels and copies) of a torch.profiler run of `warm_calls` then `calls`
  calls, in start order, the last `calls` calls' only (every call launches the same)."""
  events = sorted((evt for evt in prof.events() if evt.device_type.name == "CUDA"),
                  key=lambda evt: evt.time_range.start)
  if warm_calls:
    total_calls = warm_calls + calls
    if len(events) % total_calls:
      raise SystemExit(f"sonic_profile: {len(events)} events over {total_calls} calls")
    events = events[-calls * (len(events) // total_calls):]
  return events


def kernel_times(prof, calls, warm_calls=0):
  """{kernel name: (us per call, launches per call)} of the last `calls` calls of a profile."""
  total, count = collections.Counter(), collections.Counter()
  for evt in _last_calls_events(prof, calls, warm_calls):
    total[evt.name] += evt.time_range.elapsed_us()
    count[evt.name] += 1
  return {name: (total[name] / calls, count[name] / calls) for name, _ in total.most_common()}


def device_span_us(prof, calls, warm_calls=0):
  """(span, idle) in us per call of the last `calls` calls' device events: first start to last
  end, and the time in it with no kernel or copy running."""
  events = [(evt.time_range.start, evt.time_range.end)
            for evt in _last_calls_events(prof, calls, warm_calls)]
  if not events:
    return 0.0, 0.0
  idle, end = 0.0, events[0][1]
  for start, stop in events[1:]:
    idle += max(0.0, start - end)
    end = max(end, stop)
  return (end - events[0][0]) / calls, idle / calls


def burst_times(fn, rep_ms=200.0, idle_s=2.0):
  """({kernel: us per call (median over calls)}, [span us of each call], {kernel: [us in each
  call]} of the 8 longest kernels): `fn` timed in a do_bench
  burst (triton.testing.do_bench(warmup=5, rep=rep_ms)'s rounds of L2 flush then call) inside a
  torch.profiler run. A call's events are those between two flushes."""
  import time
  import torch
  cache = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
  time.sleep(idle_s)
  torch.cuda.synchronize()
  t0 = time.perf_counter()
  for _ in range(5):
    cache.zero_()
    fn()
  torch.cuda.synchronize()
  estimate_ms = (time.perf_counter() - t0) * 1e3 / 5
  for _ in range(max(1, int(5 / estimate_ms))):
    fn()
  calls = max(1, int(rep_ms / estimate_ms))
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    cache.zero_()
    torch.cuda.synchronize()
    for _ in range(calls):
      cache.zero_()
      fn()
    torch.cuda.synchronize()
  return burst_summary(prof, calls)


def burst_summary(prof, calls):
  """`burst_times`' result from a profile that starts with a flush alone, then `calls` rounds of
  (flush, call): a call's device events are those between two flushes (the flush kernel is the
  profile's first event)."""
  import statistics
  events = sorted((evt for evt in prof.events() if evt.device_type.name == "CUDA"),
                  key=lambda evt: evt.time_range.start)
  flush_name = events[0].name
  rounds = []
  for evt in events:
    if evt.name == flush_name:
      rounds.append([])
    else:
      rounds[-1].append(evt)
  rounds = [r for r in rounds if r]
  if len(rounds) != calls:
    raise SystemExit(f"sonic_profile: {len(rounds)} flushed calls in the burst, {calls} made")
  per_name = collections.defaultdict(list)
  for r in rounds:
    totals = collections.Counter()
    for evt in r:
      totals[evt.name] += evt.time_range.elapsed_us()
    for name, us in totals.items():
      per_name[name].append(us)
  spans = [max(e.time_range.end for e in r) - r[0].time_range.start for r in rounds]
  kernels = {name: statistics.median(v) for name, v in per_name.items()}
  top = sorted(kernels, key=lambda name: -kernels[name])[:8]
  return (dict(sorted(kernels.items(), key=lambda kv: -kv[1])), spans,
          {name: per_name[name] for name in top})


def sonicmoe_layer(cfg):
  """(forward, step) of SonicMoE's layer for configuration `cfg`, built as sonic_ref.py builds it:
  forward() returns the output, step() runs forward and backward from a fixed dO."""
  import torch
  from sonicmoe import MoE
  from sonicmoe.enums import ActivationType
  from sonicmoe.functional import moe_TC_softmax_topk_layer

  t, d, n, e, k = cfg
  torch.manual_seed(0)
  moe = MoE(num_experts=e, num_experts_per_tok=k, hidden_size=d, intermediate_size=n,
            activation_function=ActivationType.SWIGLU, add_bias=False,
            std=0.02).to(torch.bfloat16).cuda()
  x = (0.2 * torch.randn(t, d, device="cuda", dtype=torch.bfloat16)).requires_grad_()
  d_out = 0.2 * torch.randn_like(x)
  w1, w2, rw = moe.c_fc.weight, moe.c_proj.weight, moe.router.weight

  def forward():
    return moe_TC_softmax_topk_layer(x, rw, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None,
                                     k, moe.stream_id, ActivationType.SWIGLU, False)[0]

  def step():
    forward().backward(d_out)
    x.grad = w1.grad = w2.grad = rw.grad = None

  return forward, step


def profile_config(cfg, calls, save, warm_ms=0.0, burst=False, phases=("forward", "step")):
  import statistics
  import time
  import torch
  forward, step = sonicmoe_layer(cfg)
  result = {}
  for name, fn in (("forward", forward), ("step", step)):
    if name not in phases:
      continue
    for _ in range(2):
      fn()
    torch.cuda.synchronize()
    print(f"  {cfg} {name}: warm", flush=True)
    if burst:
      times, spans, per_call = burst_times(fn)
      result[name] = {"kernels": {k_: {"us": us, "launches": None} for k_, us in times.items()},
                      "total_us": sum(times.values()), "span_us": statistics.median(spans),
                      "idle_us": None, "spans_us": spans, "kernels_per_call_us": per_call}
      save(result)
      continue
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
      # A sustained load first, inside the profile (starting one idles the GPU, which would let
      # it cool); only the last `calls` calls are counted.
      end, warm_calls = time.perf_counter() + warm_ms / 1e3, 0
      while time.perf_counter() < end:
        fn()
        warm_calls += 1
        if warm_calls % 8 == 0:
          torch.cuda.synchronize()
      for _ in range(calls):
        fn()
      torch.cuda.synchronize()
    times = kernel_times(prof, calls, warm_calls)
    span, idle = device_span_us(prof, calls, warm_calls)
    result[name] = {"kernels": {k_: {"us": us, "launches": c} for k_, (us, c) in times.items()},
                    "total_us": sum(us for us, _ in times.values()), "span_us": span,
                    "idle_us": idle, "warm_calls": warm_calls}
    save(result)  # the first compile of a training step can take minutes: keep what is done
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--thiek", action="append", help="configuration T,d,n,E,K (repeatable)")
  parser.add_argument("--calls", type=int, default=5)
  parser.add_argument("--warm_ms", type=float, default=0.0,
                      help="back-to-back calls for this long right before the profiled calls, "
                      "inside the profile (dropped from the figures)")
  parser.add_argument("--burst", action="store_true",
                      help="profile do_bench bursts of flushed calls instead (per kernel medians)")
  parser.add_argument("--phases", default="forward,step",
                      help="the phases to profile, of forward,step")
  parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
  args = parser.parse_args()
  if not args.phases or not set(args.phases.split(",")) <= {"forward", "step"}:
    parser.error(f"--phases must name some of forward,step, got {args.phases!r}")
  import torch
  out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
         "warm_ms": args.warm_ms, "burst": args.burst, "configs": {}}
  os.makedirs(args.out, exist_ok=True)

  def save(spec, partial):
    out["configs"][spec] = partial
    with open(os.path.join(args.out, "sonic_profile.json"), "w") as f:
      json.dump(out, f, indent=1)

  for spec in args.thiek or DEFAULT_CONFIGS:
    cfg = tuple(int(v) for v in spec.split(","))
    res = profile_config(cfg, args.calls, lambda r, spec=spec: save(spec, r), args.warm_ms,
                         args.burst, tuple(args.phases.split(",")))
    for name, r in res.items():
      idle = "" if r["idle_us"] is None else f", idle {r['idle_us'] / 1000:.3f} ms"
      print(f"\n{spec} {name}: {r['total_us'] / 1000:.3f} ms of kernels per call, span "
            f"{r['span_us'] / 1000:.3f} ms{idle}")
      for kname, v in r["kernels"].items():
        launches = "" if v["launches"] is None else f"x{v['launches']:<4g} "
        print(f"  {v['us']:9.1f} us  {launches}{kname[:110]}")
    torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
