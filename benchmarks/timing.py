"""Timing and memory measurement for jitted JAX functions, the way a GPU performance engineer would.

- Compile time is measured separately (`jit(...).lower(...).compile()`), never inside a timing.
- Warm-up calls on every input set before timing.
- Each sample times a batch of back-to-back calls (long enough to hide the host's dispatch gaps)
  ending in one device synchronisation, rotating through several input sets so that small cases do
  not run out of a warm L2 cache; the reported time is the median sample.
- Functions that are compared (kernel variants, a forward against its forward+backward) are
  sampled in interleaved rounds (`time_interleaved`): the GPU's clocks drift by several percent
  within a run, which timing them one after the other would put into the comparison.
- Per-kernel device times come from a `jax.profiler` trace of a few calls.
- `time_do_bench` measures the way SonicMoE's anchors were measured (triton's `do_bench`: a short
  burst of calls, each after an L2 flush, timed one by one, the median), so that our figures and
  theirs come from the same method; the interleaved samples above are a harsher, sustained load.
"""

from __future__ import annotations

import glob
import math
import os
import statistics
import tempfile
import time
from collections import defaultdict

import jax
import numpy as np


def compile_fn(fn, *args):
  """Returns (compiled, seconds to lower and compile)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*args).compile()
  return compiled, time.perf_counter() - t0


def time_compiled(compiled, arg_sets, *, repeats=10, min_sample_s=0.025, max_inner=200):
  """Median seconds per call of `compiled` over rotated `arg_sets` (see module doc)."""
  t, samples = time_interleaved({"": (compiled, arg_sets)}, repeats=repeats,
                                min_sample_s=min_sample_s, max_inner=max_inner)[""]
  return t, {"samples_s": samples}


def time_fn(fn, *args, repeats=10, max_inner=200):
  """Compiles fn for args (not timed) and returns its median seconds per call (`time_compiled`)."""
  compiled, _ = compile_fn(fn, *args)
  t, _ = time_compiled(compiled, [args], repeats=repeats, max_inner=max_inner)
  return t


def residual_bytes(fn, *args):
  """Bytes that reverse-mode AD keeps from the forward of `fn` for its backward.

  Returns (bytes not counting fn's own arguments, bytes of arguments kept, [(shape, dtype, why)]).
  """
  from jax._src.ad_checkpoint import saved_residuals  # the list behind print_saved_residuals
  own = args_kept = 0
  listing = []
  for aval, why in saved_residuals(fn, *args):
    nbytes = aval.size * aval.dtype.itemsize
    if "from the argument" in why:
      args_kept += nbytes
    else:
      own += nbytes
    listing.append((tuple(aval.shape), str(aval.dtype), why.split(" from ")[0][:60]))
  return own, args_kept, listing


def temp_bytes(compiled):
  """XLA's temporary buffer size for a compiled program, or None where not reported."""
  try:
    stats = compiled.memory_analysis()
    return int(stats.temp_size_in_bytes) if stats is not None else None
  except Exception:  # some backends do not implement memory_analysis
    return None


def kernel_times(compiled, args, calls=3, top=12):
  """Device time per call of each kernel in `compiled`, from a profiler trace: [(name, us)],
  the `top` longest (all with top=None).

  Empty where the platform reports no device kernels (e.g. on CPU).
  """
  jax.block_until_ready(compiled(*args))
  totals = defaultdict(float)
  for _, duration_ns, name in traced_events(lambda: [compiled(*args) for _ in range(calls)],
                                             memcpy=False):
    totals[name] += duration_ns / 1e3 / calls
  return sorted(totals.items(), key=lambda kv: -kv[1])[:top]


def device_events(logdir, memcpy=True):
  """[(start_ns, duration_ns, name)] of the GPU stream events of the profiler trace in `logdir`
  (kernels, memsets, and memcpys unless memcpy=False), in start order; [] without a trace or GPU."""
  paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
  if not paths:
    return []
  events = []
  for plane in jax.profiler.ProfileData.from_file(paths[0]).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      # Kernel activity lives on the stream lines; skip XLA's op/module summary lines.
      name = line.name.lower()
      if "stream" not in name or (not memcpy and "memcpy" in name):
        continue
      events.extend((ev.start_ns, ev.duration_ns, ev.name) for ev in line.events)
  return sorted(events)


def forward_and_backward(fn):
  """fn's training-step work: its output and the gradients for the cotangent d_y (last argument).
  The output is returned: a forward output nobody uses is dead code to XLA, which would then drop
  the layer's down-projection and aggregation from the step (fwd+bwd would time a forward without
  them, and 'backward' = fwd+bwd - fwd would come out too fast)."""
  def step(*args):
    *primals, d_y = args
    y, vjp = jax.vjp(fn, *primals)
    return y, vjp(d_y)
  return step


def time_interleaved(calls, *, repeats=10, min_sample_s=0.025, max_inner=200):
  """Median seconds per call of each compiled function in `calls`, {name: (compiled, arg_sets)}
  (arg_sets: a list of argument tuples, rotated through; a bare tuple is one set), sampled in
  rounds: every round takes one sample of each function in turn, so that a drift of the GPU's
  clocks (power, temperature: on the H100s here one kernel's samples span +-15% within a minute,
  every few rounds slow for all alike) spreads over all of them instead of favouring whichever
  ran first. A sample is a batch of back-to-back calls (at least `min_sample_s` long) ended by one
  device synchronisation. Returns {name: (median seconds, samples)}."""
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


def flush_fn(flush_bytes):
  """(flush, buffer): flush(buffer) overwrites `flush_bytes` of device memory in place, as triton's
  do_bench zeroes a 256 MB buffer before each call so that no call finds its data in L2."""
  import jax.numpy as jnp
  flush = jax.jit(lambda b: jnp.zeros_like(b), donate_argnums=0)
  return flush, jnp.ones((flush_bytes // 4,), jnp.int32)


def _call_rounds(events, flush_events, call_events, calls):
  """Each call's events in a trace of `calls` rounds of (flush, call), or None where the events do
  not come in that pattern."""
  per_round = flush_events + call_events
  if call_events < 1 or len(events) != calls * per_round:
    return None
  return [events[r * per_round + flush_events:(r + 1) * per_round] for r in range(calls)]


def per_call_spans(events, flush_events, call_events, calls):
  """Device time of each call in a trace of `calls` rounds of (flush, call): `events`
  [(start_ns, duration_ns, name)] in start order, `flush_events` and `call_events` the number of
  events that one flush and one call put on the stream (from traces of each alone). A call's time
  runs from its first event's start to its last event's end (what CUDA events recorded around it
  on the stream measure; the flush before it is not counted). None where the events do not come in
  that pattern (then the caller falls back to host timing)."""
  rounds = _call_rounds(events, flush_events, call_events, calls)
  if rounds is None:
    return None
  return [(max(s + d for s, d, _ in mine) - mine[0][0]) / 1e9 for mine in rounds]


def idle_in_calls(events, flush_events, call_events, calls):
  """Seconds of each call's span (as `per_call_spans`) in which none of its events ran: the
  device waiting inside a call (e.g. for the host to launch its next kernel); None as there."""
  rounds = _call_rounds(events, flush_events, call_events, calls)
  if rounds is None:
    return None
  idle = []
  for mine in rounds:
    gaps, end = 0, mine[0][0]
    for s, d, _ in sorted(mine):
      gaps += max(0, s - end)
      end = max(end, s + d)
    idle.append(gaps / 1e9)
  return idle


def kernels_in_calls(events, flush_events, call_events, calls, reduce=statistics.median):
  """{kernel name: reduce(seconds in each call)} (the median by default; `reduce=list` for the
  calls' times in order) over the calls of a trace of `calls` rounds of (flush, call), as
  `per_call_spans` splits it (a name launched several times in a call counts its sum); None where
  the events do not come in that pattern."""
  rounds = _call_rounds(events, flush_events, call_events, calls)
  if rounds is None:
    return None
  per_name = defaultdict(list)
  for mine in rounds:
    totals = defaultdict(float)
    for _, d, name in mine:
      totals[name] += d / 1e9
    for name, t in totals.items():
      per_name[name].append(t)
  return {name: reduce(v) for name, v in per_name.items()}


def last_calls(events, total_calls, keep):
  """The events of the last `keep` of `total_calls` calls that each put the same number of events
  on the stream (a sustained load's trace, of which only the end is wanted); ValueError where the
  events do not split evenly over the calls."""
  if len(events) % total_calls:
    raise ValueError(f"{len(events)} events over {total_calls} calls: the calls differ")
  return events[len(events) - keep * (len(events) // total_calls):]


def traced_events(run, memcpy=True):
  """`device_events` of a profiler trace of run() (its result waited for)."""
  with tempfile.TemporaryDirectory() as logdir:
    jax.profiler.start_trace(logdir)
    jax.block_until_ready(run())
    jax.profiler.stop_trace()
    return device_events(logdir, memcpy=memcpy)


def time_do_bench(compiled, args, *, warmup_ms=5.0, rep_ms=200.0, flush_bytes=None):
  """Seconds per call of `compiled(*args)` measured as triton.testing.do_bench(warmup=5, rep=200,
  return_mode="median") measures (SonicMoE's anchors, `../shared/bench/sonic_ref.py`): the number
  of calls sized from 5 flushed calls, `warmup_ms` of warm-up calls, then `rep_ms` of calls each
  after an L2 flush, each timed alone, the median. Each call's time is its device span in a
  profiler trace (as CUDA events around it on the stream); where the trace has no device events
  (CPU) or an unexpected pattern, the mean host time per call with the flushes' time taken out.
  `flush_bytes`: 256 MB (do_bench's) on a GPU, 4 MB elsewhere (a CPU run is a smoke test).
  Returns (median seconds, {"calls", "samples_s", "per_call": "device" | "host"}, and with
  device spans "idle_s": the time within each span in which none of the call's events ran, and
  "kernels_s": each kernel's median seconds per call, as `kernels_in_calls`, and
  "kernels_per_call_s": its seconds in each call, in order)."""
  on_gpu = jax.devices()[0].platform == "gpu"
  if flush_bytes is None:
    flush_bytes = (256 if on_gpu else 4) << 20
  flush, buf = flush_fn(flush_bytes)
  buf = jax.block_until_ready(flush(buf))
  jax.block_until_ready(compiled(*args))
  t0 = time.perf_counter()
  out = None
  for _ in range(5):
    buf = flush(buf)
    out = compiled(*args)
  jax.block_until_ready((out, buf))
  estimate = (time.perf_counter() - t0) / 5
  warmup = max(1, int(warmup_ms * 1e-3 / estimate))
  calls = max(1, int(rep_ms * 1e-3 / estimate))
  for _ in range(warmup):
    out = compiled(*args)
  jax.block_until_ready(out)
  holder = [buf]
  if on_gpu:  # a CPU trace has no device events: host time, without three traces' cost
    spans, info = _traced_do_bench(compiled, args, calls, flush, holder)
    if spans is not None:
      return statistics.median(spans), info
  mean, holder[0] = untraced_burst(compiled, args, calls, flush, holder[0])
  return mean, {"calls": calls, "samples_s": [mean], "per_call": "host"}


def _traced_do_bench(compiled, args, calls, flush, holder):
  """`time_do_bench`'s traced burst: (each call's device span, the record), or (None, None) where
  the trace's events do not split into the calls."""

  def flush_once():
    holder[0] = flush(holder[0])
    return holder[0]

  flush_events = len(traced_events(flush_once))
  call_events = len(traced_events(lambda: compiled(*args)))

  def rounds():
    result = None
    for _ in range(calls):
      holder[0] = flush(holder[0])
      result = compiled(*args)
    return result, holder[0]

  events = traced_events(rounds)
  spans = per_call_spans(events, flush_events, call_events, calls)
  if spans is None:
    return None, None
  in_calls = kernels_in_calls(events, flush_events, call_events, calls, reduce=list)
  return spans, {
      "calls": calls, "samples_s": spans, "per_call": "device",
      "idle_s": idle_in_calls(events, flush_events, call_events, calls),
      "kernels_s": {name: statistics.median(v) for name, v in in_calls.items()},
      "kernels_per_call_s": in_calls}


def untraced_burst(compiled, args, calls, flush, buf):
  """(seconds per call, buf) of `calls` rounds of (flush, call) timed on the host without a
  profiler, less a flush-only burst's time right after: `time_do_bench`'s bursts untraced."""
  jax.block_until_ready(buf)
  t0 = time.perf_counter()
  out = None
  for _ in range(calls):
    buf = flush(buf)
    out = compiled(*args)
  jax.block_until_ready((out, buf))
  both_s = time.perf_counter() - t0
  t0 = time.perf_counter()
  for _ in range(calls):
    buf = flush(buf)
  jax.block_until_ready(buf)
  return max(both_s - (time.perf_counter() - t0), 1e-9) / calls, buf


def sustained_load(compiled, arg_sets, seconds):
  """Back-to-back calls of `compiled` for `seconds` (cycling through `arg_sets`), waiting every 8
  calls so the queue stays short and the GPU never idles: a GPU at its power cap, as in a
  sustained benchmark. Returns the number of calls; the last ones may still be running (calls made
  right after follow them without a gap)."""
  end, calls, out = time.perf_counter() + seconds, 0, None
  while time.perf_counter() < end:
    out = compiled(*arg_sets[calls % len(arg_sets)])
    calls += 1
    if calls % 8 == 0:
      jax.block_until_ready(out)
  return calls


def poison_like(outputs):
  """Arrays shaped like `outputs` (a pytree of arrays), filled with NaN (floats) or the dtype's
  minimum (integers), on the device."""
  jnp = jax.numpy

  def fill(x):
    value = jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else (
        False if x.dtype == jnp.bool_ else jnp.iinfo(x.dtype).min)
    return jnp.full(x.shape, value, x.dtype)
  return jax.tree.map(fill, outputs)


def check_variants(variants, compared):
  """Runs each variant once ({name: (fn, args)}), checks `compared(outputs)` bit for bit against
  the first variant's and compiles it; returns ({name: record}, {name: (compiled, args)}) where a
  record holds "exact", or "error" for a variant that failed (left out of the compiled ones).

  A kernel that leaves part of its output unwritten must not pass on a buffer that still holds an
  earlier variant's equal result: the first variant's outputs stay alive (so no later output lands
  in them), and before each later run buffers of the outputs' shapes are filled with NaN (integer
  minimum) and freed, the blocks the allocator most likely hands to that run's outputs."""
  records, calls, reference, first_outputs = {}, {}, None, None
  for name, (fn, args) in variants.items():
    try:
      compiled = compile_fn(fn, *args)[0]
      if first_outputs is not None:
        for poison in jax.tree.leaves(jax.block_until_ready(poison_like(first_outputs))):
          poison.delete()
      outputs = jax.block_until_ready(compiled(*args))
      got = compared(outputs)
      if reference is None:
        reference, first_outputs = got, outputs
      records[name] = {"exact": all(np.array_equal(g, w) for g, w in zip(got, reference))}
      calls[name] = (compiled, args)
    except Exception as err:
      records[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
  return records, calls


def measure_variants(variants, compared, flops, repeats, cool_calls=0, idle_s=2.0):
  """Kernel variants of a variant script, {name: (fn, args)}: each one's outputs checked bit for
  bit against the first's (`check_variants`), then all timed in interleaved rounds
  (`time_interleaved`). Returns {name: record}: "exact", "ms", "tflops", "samples_ms", or "error"
  for a variant that failed (e.g. does not compile). cool_calls > 0: then, variant by variant,
  `idle_s` seconds idle and a profiler trace of `cool_calls` calls: "cool_device_us", the device
  time per call of a GPU that has not yet reached its power cap (the interleaved samples are a
  sustained load, at lower clocks)."""
  records, calls = check_variants(variants, compared)
  for name, (t, samples) in time_interleaved(calls, repeats=repeats).items():
    records[name].update(ms=t * 1e3, tflops=flops / t / 1e12,
                         samples_ms=[v * 1e3 for v in samples])
  for name, (compiled, args) in calls.items() if cool_calls else ():
    time.sleep(idle_s)
    kernels = kernel_times(compiled, args, calls=cool_calls, top=None)
    records[name]["cool_device_us"] = sum(us for _, us in kernels)
  return records
