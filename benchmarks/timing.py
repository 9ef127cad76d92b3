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
  with tempfile.TemporaryDirectory() as logdir:
    jax.profiler.start_trace(logdir)
    for _ in range(calls):
      out = compiled(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    totals = defaultdict(float)
    for _, duration_ns, name in device_events(logdir, memcpy=False):
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


def check_variants(variants, compared):
  """Runs each variant once ({name: (fn, args)}), checks `compared(outputs)` bit for bit against
  the first variant's and compiles it; returns ({name: record}, {name: (compiled, args)}) where a
  record holds "exact", or "error" for a variant that failed (left out of the compiled ones)."""
  records, calls, reference = {}, {}, None
  for name, (fn, args) in variants.items():
    try:
      compiled = compile_fn(fn, *args)[0]
      got = compared(jax.block_until_ready(compiled(*args)))
      reference = got if reference is None else reference
      records[name] = {"exact": all(np.array_equal(g, w) for g, w in zip(got, reference))}
      calls[name] = (compiled, args)
    except Exception as err:
      records[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
  return records, calls


def measure_variants(variants, compared, flops, repeats):
  """Kernel variants of a variant script, {name: (fn, args)}: each one's outputs checked bit for
  bit against the first's (`check_variants`), then all timed in interleaved rounds
  (`time_interleaved`). Returns {name: record}: "exact", "ms", "tflops", "samples_ms", or "error"
  for a variant that failed (e.g. does not compile)."""
  records, calls = check_variants(variants, compared)
  for name, (t, samples) in time_interleaved(calls, repeats=repeats).items():
    records[name].update(ms=t * 1e3, tflops=flops / t / 1e12,
                         samples_ms=[v * 1e3 for v in samples])
  return records
