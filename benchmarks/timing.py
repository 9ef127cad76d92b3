"""Timing and memory measurement of jitted JAX functions.

- Compile time is measured separately (`compile_fn`), never inside a timing.
- `time_do_bench` times as triton's `do_bench(warmup=5, rep=200, return_mode="median")` does, the
  method of SonicMoE's own benchmark: warm-up calls, then a 200 ms burst of calls each after an L2
  flush, each call timed alone (its device span in a profiler trace), the median.
- `time_interleaved` times several functions in alternating rounds: each sample is a batch of
  back-to-back calls ended by one device synchronisation, rotating through input sets, and every
  round takes one sample of each function, so that a drift of the GPU's clocks within a run spreads
  over all of them. The median sample is reported. Kernel variants and tuning candidates are
  compared this way.
- `kernel_times` reads per-kernel device times from a profiler trace.
"""

from __future__ import annotations

import glob
import math
import os
import re
import statistics
import tempfile
import time
from collections import defaultdict

import jax


def compile_fn(fn, *args, compiler_options=None):
  """(compiled, seconds to lower and compile)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn, compiler_options=compiler_options).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def time_interleaved(calls, *, repeats=10, min_sample_s=0.025, max_inner=200):
  """{name: (median seconds per call, samples)} of the compiled functions `calls`, {name:
  (compiled, arg_sets)} (a list of argument tuples rotated through, or one tuple), sampled in
  alternating rounds (see the module doc). A sample is at least `min_sample_s` of calls."""
  calls = {name: (c, sets if isinstance(sets, list) else [sets])
           for name, (c, sets) in calls.items()}
  inner = {}
  for name, (compiled, arg_sets) in calls.items():
    for args in arg_sets:  # warm-up
      jax.block_until_ready(compiled(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*arg_sets[0]))
    once = max(time.perf_counter() - t0, 1e-6)
    inner[name] = max(1, min(max_inner, math.ceil(min_sample_s / once)))
  samples = {name: [] for name in calls}
  turn = dict.fromkeys(calls, 0)  # each function rotates through its own input sets
  for _ in range(repeats):
    for name, (compiled, arg_sets) in calls.items():
      t0 = time.perf_counter()
      out = None
      for _ in range(inner[name]):
        out = compiled(*arg_sets[turn[name] % len(arg_sets)])
        turn[name] += 1
      jax.block_until_ready(out)
      samples[name].append((time.perf_counter() - t0) / inner[name])
  return {name: (statistics.median(v), v) for name, v in samples.items()}


def time_fn(fn, *args, repeats=10, max_inner=200):
  """Compiles fn for args (not timed) and returns its median seconds per call."""
  compiled, _ = compile_fn(fn, *args)
  return time_interleaved({"": (compiled, args)}, repeats=repeats, max_inner=max_inner)[""][0]


def forward_and_backward(fn):
  """fn's training-step work: its output and the gradients for the cotangent d_y (last argument).
  The output is returned: a forward output nobody uses is dead code to XLA, which would then drop
  the layer's down-projection and aggregation from the step."""
  def step(*args):
    *primals, d_y = args
    y, vjp = jax.vjp(fn, *primals)
    return y, vjp(d_y)
  return step


def residual_bytes(fn, *args):
  """Bytes that reverse-mode autodiff keeps from the forward of `fn` for its backward, not
  counting fn's own arguments."""
  from jax._src.ad_checkpoint import saved_residuals  # the list behind print_saved_residuals
  return sum(aval.size * aval.dtype.itemsize for aval, why in saved_residuals(fn, *args)
             if "from the argument" not in why)


def temp_bytes(compiled):
  """XLA's temporary buffer size for a compiled program, or None where not reported."""
  try:
    stats = compiled.memory_analysis()
    return int(stats.temp_size_in_bytes) if stats is not None else None
  except Exception:  # some backends do not implement memory_analysis
    return None


def device_events(logdir, gpu=None, with_stream=False):
  """[(start_ns, duration_ns, name)] of the GPU stream events (kernels, memsets, memcpys) of the
  profiler trace in `logdir`, in start order: of GPU `gpu` (its index), or of every GPU (None);
  [] without a trace or a GPU. with_stream: (start_ns, duration_ns, name, stream line's name)."""
  paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    return []
  events = []
  for plane in jax.profiler.ProfileData.from_file(paths[0]).planes:
    if not plane.name.startswith("/device:GPU") or (
        gpu is not None and re.match(rf"/device:GPU:{gpu}\b", plane.name) is None):
      continue
    for line in plane.lines:  # kernels live on the stream lines, not XLA's op/module summaries
      if "stream" in line.name.lower():
        events.extend((ev.start_ns, ev.duration_ns, ev.name) + ((line.name,) if with_stream else ())
                      for ev in line.events)
  return sorted(events)


def traced_events(run):
  """`device_events` of a profiler trace of run() (its result waited for)."""
  with tempfile.TemporaryDirectory() as logdir:
    jax.profiler.start_trace(logdir)
    jax.block_until_ready(run())
    jax.profiler.stop_trace()
    return device_events(logdir)


def kernel_times(compiled, args, calls=3, top=12):
  """[(kernel name, device us per call)] of `compiled`, the `top` longest, from a profiler trace of
  `calls` calls; empty where the platform reports no device kernels (a CPU)."""
  jax.block_until_ready(compiled(*args))
  totals = defaultdict(float)
  for _, duration_ns, name in traced_events(lambda: [compiled(*args) for _ in range(calls)]):
    totals[name] += duration_ns / 1e3 / calls
  return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


def per_call_spans(events, flush_events, call_events, calls):
  """Device seconds of each call in a trace of `calls` rounds of (flush, call): `events`
  [(start_ns, duration_ns, name)] in start order, `flush_events` and `call_events` the number of
  events one flush and one call put on the stream. A call's time runs from its earliest event's
  start to its latest event's end (what CUDA events around it measure; the flush is not counted).
  None where the events do not come in that pattern."""
  per_round = flush_events + call_events
  if call_events < 1 or len(events) != calls * per_round:
    return None
  rounds = [events[r * per_round + flush_events:(r + 1) * per_round] for r in range(calls)]
  return [(max(s + d for s, d, _ in mine) - mine[0][0]) / 1e9 for mine in rounds]


def time_do_bench(compiled, args, *, warmup_ms=5.0, rep_ms=200.0):
  """(median seconds per call, {"calls", "samples_s", "per_call"}) of `compiled(*args)` timed as
  triton's do_bench times: the number of calls sized from 5 flushed calls, `warmup_ms` of warm-up,
  then `rep_ms` of calls each after an L2 flush (zeroing 256 MB on a GPU as do_bench, 4 MB
  elsewhere). Each call's time is its device span in a profiler trace ("per_call": "device");
  where the trace has no device events (a CPU) or another pattern, the mean host time per call
  with the flushes' time taken out ("host"), or with it left in where the flushes alone took as
  long (a host clock's noise: an upper bound rather than a near-zero difference)."""
  import jax.numpy as jnp
  on_gpu = jax.devices()[0].platform == "gpu"
  flush_bytes = (256 if on_gpu else 4) << 20
  flush = jax.jit(lambda b: jnp.zeros_like(b), donate_argnums=0)
  holder = [jax.block_until_ready(flush(jnp.ones((flush_bytes // 4,), jnp.int32)))]

  def burst(calls, with_call=True):
    out = None
    for _ in range(calls):
      holder[0] = flush(holder[0])
      out = compiled(*args) if with_call else None
    return out, holder[0]

  jax.block_until_ready(compiled(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(burst(5))
  estimate = (time.perf_counter() - t0) / 5
  for _ in range(max(1, int(warmup_ms * 1e-3 / estimate))):
    out = compiled(*args)
  jax.block_until_ready(out)
  calls = max(1, int(rep_ms * 1e-3 / estimate))
  if on_gpu:  # a CPU trace has no device events
    flush_events = len(traced_events(lambda: burst(1, with_call=False)))
    call_events = len(traced_events(lambda: compiled(*args)))
    spans = per_call_spans(traced_events(lambda: burst(calls)), flush_events, call_events, calls)
    if spans is not None:
      return statistics.median(spans), {"calls": calls, "samples_s": spans, "per_call": "device"}
  t0 = time.perf_counter()
  jax.block_until_ready(burst(calls))
  both_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  jax.block_until_ready(burst(calls, with_call=False))
  flush_s = time.perf_counter() - t0
  mean = (both_s - flush_s if both_s > flush_s else both_s) / calls
  return mean, {"calls": calls, "samples_s": [mean], "per_call": "host"}
