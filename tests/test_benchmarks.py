"""CPU smoke run of the benchmark harness on one tiny configuration."""

import json
import os
import subprocess
import sys
import time
from unittest import mock

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_harness_smoke_run(tmp_path):
  cmd = [sys.executable, "-m", "benchmarks.moe_bench", "--thiek=128,32,16,4,2", "--repeats=2",
         "--input_sets=2", "--do_bench", f"--out={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  res = json.load(open(tmp_path / "results.json"))
  (cfg,) = res["configs"]
  rows = {r["name"]: r for r in cfg["rows"]}
  assert set(rows) == {"sonic_jax[xla]", "uniform_upper_bound"}, rows
  for row in rows.values():
    assert "error" not in row, row
    assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > row["fwd_ms"] * 0.5
    expected = 6 * 128 * 2 * 32 * 16 / (row["fwd_ms"] * 1e-3) / 1e12
    assert abs(row["fwd_tflops"] - expected) < 1e-6 * max(1.0, expected)
  ours = rows["sonic_jax[xla]"]
  db = ours["do_bench"]  # timed again as SonicMoE's anchors were
  assert db["fwd_ms"] > 0 and db["fwdbwd_ms"] > 0 and db["fwd_calls"] >= 1, db
  assert abs(db["fwd_tflops"] - 6 * 128 * 2 * 32 * 16 / (db["fwd_ms"] * 1e-3) / 1e12) < 1e-9
  # Residuals: H is the only activation-sized tensor kept (rows x 2n bf16), plus O(T*K) metadata.
  assert 0 < ours["residual_bytes"] < 128 * 2 * 2 * 16 * 2 * 3 + 64 * 1024, ours["residuals"]
  assert cfg["expert_counts"]["mean"] == 128 * 2 / 4
  for f in ("results.md", "tflops_fwd.png", "tflops_fwdbwd.png", "activation_memory.png"):
    assert (tmp_path / f).stat().st_size > 0, f


def test_token_rounding_bench_smoke_run(tmp_path):
  cmd = [sys.executable, "-m", "benchmarks.token_rounding_bench", "--thiek=512,32,16,8,2",
         "--backend=xla", "--repeats=2", "--modes=up,down", f"--out={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (cfg,) = json.load(open(tmp_path / "token_rounding.json"))["configs"]
  plain, up, down = cfg["routings"]
  assert plain["routing"] == "top-K" and plain["pairs"] == 512 * 2
  assert plain["rows"] >= plain["pairs"] and up["rows"] == up["pairs"] and down["rows"] == down["pairs"]
  assert down["pairs"] <= plain["pairs"] <= up["pairs"]
  assert plain["gemm_speedup"] == 1.0 and all(r["gemm_ms"] > 0 for r in cfg["routings"])
  assert "token rounding (up)" in (tmp_path / "token_rounding.md").read_text()


def test_router_backward_smoke_run(tmp_path):
  cmd = [sys.executable, "-m", "benchmarks.router_backward", "--thiek=256,64,16,16,2",
         "--repeats=2", f"--out={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  run = json.load(open(tmp_path / "router_backward.json"))
  (cfg,) = run["configs"]
  for name in ("16-bit backward", "float32 backward (autodiff)"):
    assert cfg[name]["us"] > 0 and cfg[name]["rel_err_dx"] < 1e-2 and cfg[name]["rel_err_dw"] < 1e-2
  sys.path.insert(0, ROOT)
  from benchmarks.report import router_backward_section
  section = router_backward_section(run)
  assert "| 256,64,16,16,2 |" in section and run["jax"] in section and "--thiek=256,64" in section


def test_layout_bench_smoke_run(tmp_path):
  cmd = [sys.executable, "-m", "benchmarks.layout_bench", "--thiek=256,64,32,8,2",
         "--layer_backend=xla", "--repeats=2", f"--out={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  run = json.load(open(tmp_path / "layout.json"))
  (cfg,) = run["results"]
  # On a CPU only the sort applies ("block_ranks" is a GPU kernel; its tests interpret it).
  assert set(cfg["methods_ms"]) == {"layout sort", "forward sort"} and cfg["same_layout"]
  assert all(ms > 0 for ms in cfg["methods_ms"].values()) and "--thiek=256" in run["command"]


def test_ep_bench_smoke_run(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
  cmd = [sys.executable, "-m", "benchmarks.ep_bench", "--thiek=128,32,16,4,2", "--backend=xla",
         "--repeats=2", f"--out={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.load(open(tmp_path / "ep.json"))
  assert max(out["check_max_rel_err"].values()) < 1e-5  # both schemes equal one device
  (res,) = out["results"]
  assert res["devices"] == 2 and res["single_fwdbwd_ms"] > 0
  for scheme in ("all_to_all", "all_to_all c=1.25", "all_to_all ragged", "all_gather"):
    assert res[scheme]["fwdbwd_ms"] > 0 and res[scheme]["communication_ms"] > 0, scheme
  assert res["all_to_all"]["dropped_pairs"] == 0 and res["all_to_all"]["exchange_gbps"] > 0
  assert res["all_gather"]["all_gather_gbps"] > 0 and res["all_gather"]["reduce_scatter_gbps"] > 0
  md = (tmp_path / "ep.md").read_text()
  assert "| 128,32,16,4,2 | 2 |" in md and "all_to_all" in md and "all_gather" in md


def test_kernel_bench_sums_follow_the_backends_gather_policy():
  """kernel_bench's forward/backward sums count the kernels the backend runs: the x rows gathered
  inside dw1, the dO rows inside dH and dw2; with GATHER="dh" gathered by dH, which stores them
  for dw2 to read contiguous; with GATHER="xla" one XLA row gather per operand."""
  sys.argv = sys.argv[:1]
  from benchmarks import kernel_bench
  from sonic_jax.mosaic_gpu import backend
  roles = ("bwd dH", "bwd dw1 = x^T dH", "bwd dw2 = A_s^T dO")
  ms = {"route+layout": 1.0, "up (fused gather)": 2.0, "up (contiguous input)": 1.5,
        "xla gather x[rows]": 0.5, "down": 1.0, "aggregate (xla)": 0.25,
        **{f"{r} (fused gather)": 3.0 for r in roles},
        **{f"{r} (contiguous input)": 2.0 for r in roles},
        "bwd dH (fused gather, writes dO rows)": 3.25, "bwd dX rows (dH w1^T)": 4.0}
  cases = [("fused", "fused", 3 * 3.0 + 4.0), ("dh", "dh", 3.25 + 3.0 + 2.0 + 4.0),
           ("xla", "xla", 3 * 2.0 + 4.0 + 2 * 0.5)]
  for policy, d_out_rows, bwd_ms in cases:
    backend.GATHER = policy
    try:
      res = kernel_bench.summarize({"config": [1024, 512, 1024, 8, 2],
                                    "kernels": {k: {"ms": v} for k, v in ms.items()}})
    finally:
      backend.GATHER = "fused"
    x_rows = "xla" if policy == "xla" else "fused"
    assert res["backward_gathers"] == {"x": x_rows, "d_out": d_out_rows}
    assert res["backward_sum_ms"] == bwd_ms
    assert res["forward_sum_ms"] == 1.0 + (2.0 if x_rows == "fused" else 1.5 + 0.5) + 1.0 + 0.25
    assert abs(res["gather_cost"]["up"] - (2.0 / 1.5 - 1)) < 1e-12
  # The forward's aggregation as the backend runs it, where the run timed it.
  res = kernel_bench.summarize({"config": [1024, 512, 1024, 8, 2], "kernels": {
      k: {"ms": v} for k, v in {**ms, "aggregate (backend)": 0.125}.items()}})
  assert res["forward_sum_ms"] == 1.0 + 2.0 + 1.0 + 0.125


def test_sonic_profile_keeps_the_last_calls_of_a_sustained_profile():
  """sonic_profile's per-call figures after a warm-up inside the profile: only the last `calls`
  calls' device events count (kernel times, launches, span and idle per call); host events are
  ignored; a trace whose events do not split evenly over the calls is refused."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import sonic_profile
  from types import SimpleNamespace as NS

  def event(name, start, end, device="CUDA"):
    return NS(name=name, device_type=NS(name=device), time_range=NS(
        start=start, end=end, elapsed_us=lambda: end - start))

  # 3 warm-up calls of 10 us kernels, then 2 calls of 20 + 30 us with a 5 us gap each.
  events = [event(n, t, t + 10) for t0 in (0, 100, 200) for n, t in (("a", t0), ("b", t0 + 20))]
  events += [event(n, t0 + s, t0 + e) for t0 in (300, 400)
             for n, s, e in (("a", 0, 20), ("b", 25, 55))]
  events.append(event("host op", 0, 500, device="CPU"))
  prof = NS(events=lambda: list(reversed(events)))
  times = sonic_profile.kernel_times(prof, calls=2, warm_calls=3)
  assert times == {"b": (30.0, 1.0), "a": (20.0, 1.0)}
  span, idle = sonic_profile.device_span_us(prof, calls=2, warm_calls=3)
  assert (span, idle) == ((455 - 300) / 2, (5 + 5 + 45) / 2)
  with pytest.raises(SystemExit, match="events over"):
    sonic_profile.kernel_times(NS(events=lambda: events[:-2]), calls=2, warm_calls=3)


def test_sonic_profile_splits_a_flushed_burst_into_calls():
  """sonic_profile --burst: each call's events are those between two flushes (the profile's first
  event is a flush alone); per kernel the median over calls of its time in a call (a kernel
  launched twice in a call counts its sum); spans from a call's first event to its last end; a
  burst with another number of calls than made is refused."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import sonic_profile
  from types import SimpleNamespace as NS

  def event(name, start, end):
    return NS(name=name, device_type=NS(name="CUDA"), time_range=NS(
        start=start, end=end, elapsed_us=lambda: end - start))

  events = [event("fill", 0, 5)]
  for c, t0 in enumerate((10, 200, 400)):  # flush, then a (10 + c) us "a", "b" twice (20 + 30)
    events += [event("fill", t0, t0 + 5), event("a", t0 + 10, t0 + 20 + c),
               event("b", t0 + 30, t0 + 50), event("b", t0 + 60, t0 + 90)]
  events.append(NS(name="host", device_type=NS(name="CPU"), time_range=None))
  prof = NS(events=lambda: list(reversed(events)))
  kernels, spans, per_call = sonic_profile.burst_summary(prof, calls=3)
  assert kernels == {"b": 50, "a": 11}
  assert list(kernels) == ["b", "a"]  # longest first
  assert spans == [80, 80, 80]
  assert per_call == {"b": [50, 50, 50], "a": [10, 11, 12]}
  with pytest.raises(SystemExit, match="flushed calls"):
    sonic_profile.burst_summary(prof, calls=2)


def test_forward_and_backward_keeps_the_forward_output():
  """The timed training step returns the layer's output with its gradients: were the output
  dropped, XLA would remove the down-projection and aggregation from the step as dead code, and
  the harness's backward (fwd+bwd - fwd) would come out too fast."""
  import jax
  import jax.numpy as jnp
  from benchmarks.timing import forward_and_backward
  fn = lambda x, w: jnp.tanh(x @ w)
  x, w, d_y = jnp.ones((4, 3)), jnp.full((3, 2), 0.5), jnp.ones((4, 2))
  y, (d_x, d_w) = jax.jit(forward_and_backward(fn))(x, w, d_y)
  _, vjp = jax.vjp(fn, x, w)
  want_dx, want_dw = vjp(d_y)
  assert jnp.allclose(y, fn(x, w)) and jnp.allclose(d_x, want_dx) and jnp.allclose(d_w, want_dw)


def test_time_interleaved_rounds_and_rotation():
  """Every function gets one sample per round, and each call takes the next input set in turn."""
  sys.path.insert(0, ROOT)
  from benchmarks import timing
  seen = []

  def fn(tag):
    seen.append(tag)
    return tag

  times = timing.time_interleaved({"a": (fn, [("a0",), ("a1",)]), "b": (fn, ("b0",))},
                                  repeats=3, min_sample_s=0.0, max_inner=1)
  assert set(times) == {"a", "b"} and all(len(s) == 3 and t > 0 for t, s in times.values())
  warm_up, timed = seen[:5], seen[5:]
  # Per function: a warm-up call on every input set, then one call that sizes a sample.
  assert warm_up == ["a0", "a1", "a0", "b0", "b0"]
  assert timed == ["a0", "b0", "a1", "b0", "a0", "b0"]


def test_table_ab_smoke_run(tmp_path):
  """The table A/B script end to end on CPU (the xla backend reads no table: both agree), each
  table also with the epilogues' old store rule (--wait_all_first), do_bench in two rounds."""
  table = tmp_path / "t.json"
  table.write_text(json.dumps({"entries": [{"role": "up", "device": "x", "d": 64, "n": 64,
                                            "E": 4, "config": {"num_stages": 3}}]}))
  cmd = [sys.executable, "-m", "benchmarks.table_ab", f"--tables=packaged,{table}",
         "--thiek=128,32,16,4,2", "--repeats=2", "--backend=xla", "--wait_all_first", "--do_bench",
         "--do_bench_rounds=2", "--do_bench_idle_s=0", f"--out={tmp_path}"]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  (res,) = json.load(open(tmp_path / "table_ab.json"))["configs"]
  names = [t + r for t in ("packaged", "t.json") for r in ("", " (wait for all first)")]
  assert res["agree"] == {name: True for name in names}
  assert set(res["ms"]) == {f"{name} {phase}" for name in names for phase in ("forward", "step")}
  assert all(v > 0 for v in res["ms"].values())
  assert set(res["do_bench_ms"]) == set(res["ms"]) and all(v > 0 for v in res["do_bench_ms"].values())
  assert all(len(v) == 2 for v in res["do_bench_rounds_ms"].values())  # one burst per round


def test_per_call_spans_splits_flush_and_call_rounds():
  """do_bench-style timing: each call's span starts at its own first event (not the flush's) and
  ends at its last event's end; an unexpected event count gives None (host-time fallback)."""
  sys.path.insert(0, ROOT)
  from benchmarks import timing
  events = []
  for r in range(3):  # a round: one flush event, then a call of two events, the second longer
    base = r * 1000
    events += [(base, 100, "flush"), (base + 120, 200, "a"), (base + 330, 300 + 10 * r, "b")]
  spans = timing.per_call_spans(events, 1, 2, 3)
  assert spans == [(330 + 300 + 10 * r - 120) / 1e9 for r in range(3)]
  assert timing.per_call_spans(events[:-1], 1, 2, 3) is None
  assert timing.per_call_spans(events, 1, 0, 3) is None
  # Idle inside a call: the gap between its two events (330 - (120 + 200) = 10 ns), not the flush's.
  assert timing.idle_in_calls(events, 1, 2, 3) == [10 / 1e9] * 3
  assert timing.idle_in_calls(events[:-1], 1, 2, 3) is None
  # Per kernel: the median over calls of each name's time in a call (b: 310 of 300, 310, 320), a
  # name launched twice in a call counted as its sum; the flush's events are no call's.
  assert timing.kernels_in_calls(events, 1, 2, 3) == {"a": 200 / 1e9, "b": 310 / 1e9}
  twice = [(s, d, "a" if n == "b" else n) for s, d, n in events]
  assert timing.kernels_in_calls(twice, 1, 2, 3) == {"a": 510 / 1e9}
  assert timing.kernels_in_calls(events[:-1], 1, 2, 3) is None
  # A sustained load's trace: its last calls only; uneven calls are refused.
  assert timing.last_calls(events, 3, 2) == events[3:]
  with pytest.raises(ValueError, match="calls differ"):
    timing.last_calls(events[:-1], 3, 2)
  assert timing.kernels_in_calls(events, 1, 2, 3, reduce=list)["b"] == [
      (300 + 10 * r) / 1e9 for r in range(3)]  # each call's, in order


def test_random_problem_draws_both_data_scales():
  """unit: x and dO ~ N(0, 1), weights of std 1/sqrt(fan-in); sonicmoe: SonicMoE's benchmark's
  0.2 and 0.02; anything else is refused."""
  sys.path.insert(0, ROOT)
  from benchmarks import grid
  cfg = (256, 128, 64, 8, 2)
  std = lambda v: float(np.std(np.asarray(v, np.float32)))
  unit, sonic = grid.random_problem(cfg), grid.random_problem(cfg, data="sonicmoe")
  assert [a.shape for a in unit] == [a.shape for a in sonic]
  for got, want in zip(map(std, unit), (1, 128 ** -0.5, 128 ** -0.5, 64 ** -0.5, 1)):
    assert abs(got / want - 1) < 0.1
  for got, want in zip(map(std, sonic), (0.2, 0.02, 0.02, 0.02, 0.2)):
    assert abs(got / want - 1) < 0.1
  with pytest.raises(ValueError, match="data must be one of"):
    grid.random_problem(cfg, data="ones")


def test_measure_variants_checks_outputs_and_adds_cool_device_times():
  """Variants are checked bit for bit against the first; with cool_calls each also gets a device
  time from a profiler trace (no device kernels on CPU: 0)."""
  sys.path.insert(0, ROOT)
  import jax.numpy as jnp
  from benchmarks import timing
  x = jnp.arange(8.0)
  out = timing.measure_variants({"a": (lambda v: v * 2, (x,)), "b": (lambda v: v + v, (x,)),
                                 "c": (lambda v: v * 3, (x,))}, lambda o: (o,), 8, 2,
                                cool_calls=2, idle_s=0.0)
  assert [out[n]["exact"] for n in "abc"] == [True, True, False]
  assert all(out[n]["cool_device_us"] == 0 and out[n]["ms"] > 0 for n in "abc")


def test_check_variants_poisons_the_next_outputs():
  """Before a later variant runs, buffers of the first variant's output shapes are filled with NaN
  (integers: their minimum) and freed, and the first variant's outputs stay alive; a mixed pytree
  of outputs keeps its structure, shapes and dtypes."""
  sys.path.insert(0, ROOT)
  import jax.numpy as jnp
  from benchmarks import timing
  outputs = (jnp.ones((3, 4), jnp.bfloat16), {"ids": jnp.zeros((5,), jnp.int32)})
  poison = timing.poison_like(outputs)
  assert jax.tree.structure(poison) == jax.tree.structure(outputs)
  assert poison[0].dtype == jnp.bfloat16 and bool(jnp.all(jnp.isnan(poison[0])))
  assert poison[1]["ids"].dtype == jnp.int32 and bool(jnp.all(poison[1]["ids"] == -2**31))
  made, poisons = [], []
  real = timing.poison_like
  with mock.patch.object(timing, "poison_like",
                         lambda o: made.append(o) or poisons.append(real(o)) or poisons[-1]):
    records, _ = timing.check_variants({"a": (lambda v: v * 2, (outputs[0],)),
                                        "b": (lambda v: v + v, (outputs[0],))},
                                       lambda o: (np.asarray(o, np.float32),))
  assert [r["exact"] for r in records.values()] == [True, True]
  assert len(made) == 1 and not made[0].is_deleted()  # poisoned once, for b; a's output alive
  assert all(p.is_deleted() for p in jax.tree.leaves(poisons))  # freed for b's outputs to take


def test_autotune_searches_only_tunable_fields():
  """Every candidate the autotuner tries passes the tuning table's validation for its role (a
  field the table refuses would make the candidate fail as if it did not compile, unnoticed).
  In a subprocess: the benchmark modules define absl flags of the same names."""
  check = """
from benchmarks import autotune
from sonic_jax.mosaic_gpu import tuning
assert set(autotune.SEARCH) == set(tuning.ROLES)
for role, steps in autotune.SEARCH.items():
  for field, values in steps:
    for value in values:
      step = dict(zip(field, value)) if isinstance(field, tuple) else {field: value}
      tuning.validate([{"role": role, "device": "any", "d": 64, "n": 64, "E": 2, "config": step}])
print("checked")
"""
  proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0 and "checked" in proc.stdout, proc.stderr[-3000:]


def test_report_merges_kernel_bench_runs():
  """A kernel grid split over device calls: report takes each run's kernels.json, keeps their
  configurations in order and names each run's ceilings; runs of different devices are refused."""
  sys.path.insert(0, ROOT)
  from benchmarks.report import merge_kernel_runs
  run = lambda d, rate, device="H100": {
      "device": device, "jax": "0.11.2", "gate_up_layout": "concat", "dense_bf16_tflops": rate,
      "copy_gbps": 2900.0, "configs": [{"config": [1024, d, 256, 8, 2]}]}
  merged = merge_kernel_runs([run(768, 681.0), run(4096, 715.0)])
  assert [c["config"][1] for c in merged["configs"]] == [768, 4096]
  assert "681 TFLOP/s" in merged["ceilings"] and "d = 768 rows" in merged["ceilings"]
  assert "715 TFLOP/s" in merged["ceilings"] and "d = 4096 rows" in merged["ceilings"]
  assert merge_kernel_runs([run(768, 681.0)])["ceilings"] == "681 TFLOP/s and 2900 GB/s"
  with pytest.raises(ValueError, match="different devices"):
    merge_kernel_runs([run(768, 681.0), run(4096, 715.0, device="H200")])


def test_sustained_load_cycles_argument_sets_and_untraced_burst_takes_out_the_flushes():
  """timing.sustained_load calls for the time asked, cycling its argument sets; an empty load
  makes no call. timing.untraced_burst times (flush, call) rounds with the flushes' time taken
  out: positive, and the flush buffer comes back for the next burst."""
  from benchmarks import timing
  seen, done = [], jax.numpy.ones(())
  calls = timing.sustained_load(lambda v: seen.append(v) or done, [(0,), (1,)], 0.05)
  assert calls == len(seen) > 2 and seen[:4] == [0, 1, 0, 1]
  assert timing.sustained_load(lambda v: 1 / 0, [(0,)], 0.0) == 0
  flush, buf = timing.flush_fn(1 << 16)
  compiled = jax.jit(lambda a: a @ a)
  per_call, buf = timing.untraced_burst(compiled, (np.ones((64, 64), np.float32),), 5, flush, buf)
  assert per_call > 0 and buf.shape == (1 << 14,)


def test_ncu_summary_reads_raw_reports(tmp_path, capsys):
  """ncu_forward --summarize: `ncu --import --csv --page raw` files (plain or gzipped; section-
  prefixed columns keyed by their metric), one line per kernel, roles named from our kernels'
  names and SonicMoE's (its plain GEMMs numbered in call order), thousands separators parsed."""
  import gzip
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import ncu_forward
  header = '"ID","Kernel Name","gpu__time_duration.sum","TPC.TriageCompute.sm__pipe_tensor_' \
           'cycles_active_realtime.avg.pct_of_peak_sustained_elapsed","dram__bytes_read.sum"\n'
  units = '"","","ns","%","byte"\n'
  ours = tmp_path / "ncu_concat_step_x.csv"
  ours.write_text(header + units + '"0","up_projection_mosaic_gpu_kernel","3,500,000","70.5","4,000"\n'
                  '"1","dx_projection_mosaic_gpu_kernel","3000000","80","2000"\n')
  theirs = tmp_path / "ncu_sonicmoe_step_x.csv.gz"
  with gzip.open(theirs, "wt") as f:
    f.write(header + units + '"0","kernel_quackgemm_actGemmGatedSm90_x","3400000","75","4500"\n'
            '"1","kernel_quackgemm_default_epiGemmDefaultSm90_x","1600000","73","900"\n'
            '"2","kernel_quackgemm_dgated_GemmDGatedSm90_x","2000000","55","2500"\n'
            '"3","kernel_quackgemm_default_epiGemmDefaultSm90_x","1500000","66","1400"\n')
  table = ncu_forward.summarize([str(ours), str(theirs)])
  assert set(table) == {"up", "dX", "gemm", "dH", "gemm#2"}
  assert table["up"]["concat_step_x"]["gpu__time_duration.sum"] == 3.5e6
  assert table["up"]["sonicmoe_step_x"]["dram__bytes_read.sum"] == 4500
  assert table["dX"]["concat_step_x"][
      "sm__pipe_tensor_cycles_active_realtime.avg.pct_of_peak_sustained_elapsed"] == 80
  assert table["gemm#2"]["sonicmoe_step_x"]["gpu__time_duration.sum"] == 1.5e6
  out = capsys.readouterr().out
  assert "concat_step_x" in out and "sonicmoe_step_x" in out and "3.500" in out


def test_ncu_stalls_read_source_pages(tmp_path, capsys):
  """ncu_forward --stalls: `ncu --import --csv --page source --print-source sass` files, one block
  per kernel (a kernel launched twice as name#2); the share of stall samples per opcode (a
  predicate guard is not the opcode) and the most-sampled instructions with their main reasons."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import ncu_forward
  header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
            '"stall_long_sb","stall_wait","stall_long_sb (Not Issued)"\n')
  page = tmp_path / "ncu_concat_forward_x_sass.csv"
  page.write_text(
      '"Kernel Name","up_projection_mosaic_gpu_kernel",\n' + header
      + '"0x0","      SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R12","10","100","0","10","0"\n'
      '"0x10","@!P1  BRA 0x20","60","100","55","5","55"\n'
      '"0x20","HGMMA.64x128x16.F32.BF16 R88, gdesc[UR12].tnspB, R88","1,030","100","0","30","0"\n'
      '"Kernel Name","down_projection_mosaic_gpu_kernel",\n' + header
      + '"0x0","NOP","5","1","0","5","0"\n'
      '"Kernel Name","down_projection_mosaic_gpu_kernel",\n' + header  # a second launch
      + '"0x0","BAR","2","1","0","2","0"\n')
  out = ncu_forward.summarize_stalls([str(page)], top=2)
  up = out["concat_forward_x"]["up_projection_mosaic_gpu_kernel"]
  assert up == pytest.approx({"SYNCS": 10 / 1100, "BRA": 60 / 1100, "HGMMA": 1030 / 1100})
  assert out["concat_forward_x"]["down_projection_mosaic_gpu_kernel"] == {"NOP": 1.0}
  assert out["concat_forward_x"]["down_projection_mosaic_gpu_kernel#2"] == {"BAR": 1.0}
  printed = capsys.readouterr().out
  assert "long_sb 55" in printed and "(1100 samples)" in printed
  assert "TRYWAIT" not in printed  # top=2: the least-sampled instruction is left out


def test_clock_probe_mean_power_from_the_energy_counter(monkeypatch):
  """clock_probe's sampler: NVML's energy counter read at the block's start and end gives the mean
  power over the block; without NVML the summary says None rather than failing."""
  from benchmarks import clock_probe
  readings = iter([100.0, 101.5])
  monkeypatch.setattr(clock_probe, "_energy_counter", lambda: lambda: next(readings))
  monkeypatch.setattr(clock_probe.subprocess, "Popen", mock_popen_missing)
  with clock_probe.SmiSampler() as smi:
    time.sleep(0.01)
  summary = smi.summary()
  assert summary["energy_j"] == 1.5 and 0 < summary["mean_power_w"] < 1.5 / 0.01
  monkeypatch.setattr(clock_probe, "_energy_counter", lambda: None)
  with clock_probe.SmiSampler() as smi:
    pass
  assert smi.summary()["mean_power_w"] is None and smi.summary()["samples"] == 0


def mock_popen_missing(*args, **kwargs):
  raise OSError("no nvidia-smi here")


def test_clock_probe_energy_burst_sizes_the_burst_and_counts_joules():
  """clock_probe --energy: after one untimed round, the burst's calls are sized from 3 timed rounds
  to last rep_ms, every round flushes then calls, and the joules are the counter's difference
  around those calls only."""
  from benchmarks import clock_probe
  log, counter = [], iter([10.0, 12.5])
  calls, seconds, joules = clock_probe.energy_burst(
      lambda: (log.append("call"), time.sleep(0.002)), lambda: log.append("flush"), lambda: None,
      20.0, lambda: next(counter))
  assert 3 <= calls <= 12 and joules == 2.5 and seconds > 0
  assert log == ["flush", "call"] * (1 + 3 + calls)


def test_ncu_layer_call_builds_the_phase_asked_for(monkeypatch):
  """ncu_forward's layer: clock_probe's builder of the implementation asked for, the training
  step ("forward+backward") with --step, our gate/up layout passed on."""
  sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
  import ncu_forward
  from benchmarks import clock_probe
  seen = {}

  def ours(cfg, datas, phases, gate_up_layout):
    seen.update(cfg=cfg, datas=datas, phases=phases, layout=gate_up_layout)
    return {(datas[0], phases[0]): (lambda a: a + 1, (jax.numpy.ones(()),))}
  monkeypatch.setattr(clock_probe, "sonic_jax_phases", ours)
  call = ncu_forward.layer_call("sonic_jax", (8, 4, 2, 2, 1), "interleaved", step=True)
  assert float(call()) == 2.0
  assert seen == {"cfg": (8, 4, 2, 2, 1), "datas": ["sonicmoe"], "phases": ("forward+backward",),
                  "layout": "interleaved"}
  ncu_forward.layer_call("sonic_jax", (8, 4, 2, 2, 1), "concat", step=False)
  assert seen["phases"] == ("forward",) and seen["layout"] == "concat"
