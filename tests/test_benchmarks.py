"""The benchmark harness (benchmarks/, tools/) on a CPU: each script end to end on tiny shapes
(the xla backend, or the kernels in Mosaic GPU interpret mode), the report from small results
files, and the helpers. Assertions are on structure and arithmetic, never on speed."""

import contextlib
import functools
import glob
import importlib
import json
import os
import re
import shutil
import subprocess
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import grid, report, timing  # noqa: E402


def _results(tmp_path):
  """The one results file in tmp_path: (its name, its contents)."""
  (path,) = glob.glob(str(tmp_path / "*.json"))
  assert re.fullmatch(r"cpu(x2)?_\d{4}-\d{2}-\d{2}_[a-z_]+\.json", os.path.basename(path))
  with open(path) as f:
    return os.path.basename(path), json.load(f)


# Runs each [module, *args] of a JSON list as `python -m module args` would (its __main__ block,
# absl's app.run), one after another in this one process: a script's absl flags are removed before
# the next defines flags of the same names (`_own_flags`, in that process).
_SCRIPTS = """
import json, runpy, sys
from absl import app, flags  # app's own flags stay
for argv in json.loads(sys.argv[1]):
  before = set(flags.FLAGS)
  sys.argv = argv
  try:
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
  except SystemExit as e:
    if e.code:
      raise
  for name in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, name)
"""


def _run(runs, env=None):
  """Runs the scripts `runs` ([module, *args] each) in one fresh process from the repository root,
  as `python -m` runs each: one process pays the imports once."""
  proc = subprocess.run([sys.executable, "-c", _SCRIPTS, json.dumps(runs)], cwd=ROOT,
                        capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, **(env or {})))
  assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(autouse=True)
def _unoptimized(monkeypatch):
  """The processes a test starts compile with most XLA optimizations off, as this one does
  (tests/conftest.py): the harnesses run tiny shapes, where compiling is most of a test's time
  and the speed of the compiled code is not checked."""
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


@contextlib.contextmanager
def _own_flags():
  """The absl flags defined inside the block are removed after it: the scripts and tools define
  flags of the same names, and absl refuses a second definition."""
  before = set(flags.FLAGS)
  try:
    yield
  finally:
    for name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, name)


def _main(module, args, monkeypatch):
  """Calls the script `module`'s main in this process as `python -m <module> <args>` would: its
  absl flags defined for the call only (`_own_flags`), sys.argv as the results file's command
  reads it. Scripts that need no other device count or environment run this way: a fresh process
  would import and compile everything again."""
  script = importlib.import_module(module)
  argv = [script.__file__, *args]
  with _own_flags():
    script._define_flags()
    flags.FLAGS(argv)
    monkeypatch.setattr(sys, "argv", argv)
    script.main(argv[:1])


def _flops_match(tflops, flops, ms):
  return abs(tflops - flops / (ms * 1e-3) / 1e12) <= 1e-9 * max(1.0, tflops)


@pytest.mark.parametrize("timing_flags", [["--timing=do_bench"],
                                          ["--timing=interleaved", "--repeats=2",
                                           "--input_sets=2"]], ids=["do_bench", "interleaved"])
def test_moe_bench(tmp_path, monkeypatch, timing_flags):
  _main("benchmarks.moe_bench", ["--thiek=128,32,16,4,2", "--backends=xla,auto", *timing_flags,
                                 f"--out={tmp_path}"], monkeypatch)
  name, res = _results(tmp_path)
  assert name.endswith("_layer.json") and res["environment"]["timing"] == timing_flags[0][9:]
  assert "--thiek=128,32,16,4,2" in res["environment"]["command"]
  (cfg,) = res["configs"]
  rows = {r["name"]: r for r in cfg["rows"]}
  # "auto" resolves to xla on a CPU: measured once; tokamax is not installed here.
  assert set(rows) == {"sonic_jax[xla]", "uniform_upper_bound"}, rows
  flops = 6 * 128 * 2 * 32 * 16
  for row in rows.values():
    assert "error" not in row, row
    assert _flops_match(row["fwd_tflops"], flops, row["fwd_ms"])
    assert _flops_match(row["fwdbwd_tflops"], 3 * flops, row["fwdbwd_ms"])
    # The backward's time is the difference; none where a CPU's clock reads no difference.
    if row["fwdbwd_ms"] > row["fwd_ms"]:
      assert abs(row["bwd_ms"] - (row["fwdbwd_ms"] - row["fwd_ms"])) < 1e-9
      assert _flops_match(row["bwd_tflops"], 2 * flops, row["bwd_ms"])
    else:
      assert row["bwd_ms"] is None and row["bwd_tflops"] is None, row
    assert row["compile_fwd_s"] > 0 and row["fwd_samples_ms"] and row["fwdbwd_samples_ms"]
  # The residuals: H (rows x 2n) and O(T*K) routing metadata, a few KiB here.
  assert 0 < rows["sonic_jax[xla]"]["residual_bytes"] < 64 * 1024
  assert cfg["expert_counts"]["mean"] == 128 * 2 / 4 and cfg["padded_rows"] >= 0


@pytest.mark.slow
def test_kernel_bench_interpreted(tmp_path, monkeypatch):
  # The interpreter's threads: PJRT_NPROC, which conftest.py sets before JAX starts.
  _main("benchmarks.kernel_bench", ["--interpret", "--thiek=128,256,128,2,1", "--repeats=1",
                                    f"--out={tmp_path}"], monkeypatch)
  name, res = _results(tmp_path)
  assert name.endswith("_kernels.json") and res["dense_bf16_tflops"] > 0 and res["copy_gbps"] > 0
  (cfg,) = res["configs"]
  assert list(cfg["kernels"]) == list(report.FWD_KERNELS) + list(report.BWD_KERNELS)
  for k in cfg["kernels"].values():
    assert k["ms"] > 0 and k["roofline_ms"] > 0 and k["gbps"] > 0
  ms = {n: k["ms"] for n, k in cfg["kernels"].items()}
  fwd = ms["route+layout"] + ms["up (fused gather)"] + ms["down"] + ms["aggregate (backend)"]
  assert abs(cfg["forward_sum_ms"] - fwd) < 1e-9
  assert abs(cfg["backward_sum_ms"] - sum(ms[n] for n in report.BWD_KERNELS)) < 1e-9


def test_gather_sum_bench_cases_and_table():
  """The gather-sum sweep's configurations fit SMEM and include the default; the table ranks each
  case's variants against XLA's."""
  from benchmarks import gather_sum_bench as bench
  from sonic_jax.mosaic_gpu import gather_sum as gs
  for s in (8, 16):
    found = bench.configs(4096, s)
    assert gs.default_config(4096, s) in found
    assert all(4096 % c.block_columns == 0 and c.num_stages % 2 == 0 for c in found)
  rows, pair_row, weights = bench.problem(512, 256, 16)
  assert rows.shape == (512 * 16, 256) and pair_row.shape == weights.shape == (512, 16)
  assert sorted(np.asarray(pair_row).ravel().tolist()) == list(range(512 * 16))
  results = [{"T": 8, "d": 256, "S": 16, "variant": v, "us": us, "gbps": 1.0}
             for v, us in (("xla", 10.0), ("256 columns, 2 stages (default)", 5.0))]
  text = bench.table(results)
  assert "| 8,256,16 | 256 columns, 2 stages (default) | 5.0 | 1 | 2.00 |" in text


def test_rounding_select_bench_checks_and_ranks_variants():
  """The selection bench checks each variant against XLA's selection before timing it (here the
  kernel interpreted at two warp counts, a tiny case), and ranks them against XLA's; a variant
  that selects otherwise is refused."""
  import functools
  from benchmarks import rounding_select_bench as bench
  variants = {f"warps={w}": functools.partial(bench.selection_fn, interpret=True, warps=w)
              for w in (4, 8)}
  results = bench.run_case(300, 8, 2, "nearest", 32, 1, variants)
  assert [r["variant"] for r in results] == ["xla", "warps=4", "warps=8"]
  assert all(r["us"] > 0 for r in results)
  lines = bench.table(results).splitlines()
  assert len(lines) == 2 + 3 and all(line.startswith("| 300,8,2 | ") for line in lines[2:])
  assert set(bench.default_variants(["16"], ["8192"])) == {"kernel", "warps=16", "chunk=8192"}

  def wrong(*args):  # the kernel's selection with every kept pair dropped: refused untimed
    select = bench.selection_fn(*args, interpret=True, warps=4)
    return lambda *a: (lambda keep, added: (~keep, added))(*select(*a))
  with pytest.raises(AssertionError, match="wrong: keep differs from XLA's selection"):
    bench.run_case(300, 8, 2, "nearest", 32, 1, {"wrong": wrong})


@pytest.mark.slow
def test_token_rounding_bench(tmp_path, monkeypatch):
  _main("benchmarks.token_rounding_bench", [
      "--thiek=512,32,16,8,2", "--backend=xla", "--repeats=2", "--modes=up", "--role_times",
      "--sample_ms=5", f"--out={tmp_path}"], monkeypatch)
  name, res = _results(tmp_path)
  assert name.endswith("_token_rounding.json") and res["backend"] == "xla"
  (cfg,) = res["configs"]
  plain, up = cfg["routings"]
  assert [r["routing"] for r in cfg["routings"]] == ["top-K", "token rounding (up)"]
  assert plain["pairs"] == 512 * 2 and plain["rows"] >= plain["pairs"]
  assert up["rows"] == up["pairs"] and plain["pairs"] <= up["pairs"]
  assert plain["gemm_speedup"] == 1.0
  assert "token rounding (up)" in report.token_rounding_table(res)
  assert all(set(r["role_ms"]) == {"up", "down", "dh", "dx", "weight_grads"}
             for r in cfg["routings"])
  roles = report.token_rounding_roles_table(res).splitlines()
  assert len(roles) == 2 + 2 and roles[3].startswith("| 512,32,16,8,2 | token rounding (up) |")


@pytest.mark.slow
def test_ep_bench_and_ep_options_bench(tmp_path):
  """ep_bench, every scheme ("all_to_all" and "all_gather" pick each dropless and with a
  capacity; each scheme's own correctness: test_parallel.py): the dropless ones checked against
  one device, all timed, tabulated. Then ep_options_bench, two option sets beside the
  single-device step, two sample lengths: timed, tabulated; each set's optimized HLO written."""
  from benchmarks import ep_bench, ep_options_bench
  # Both scripts in one process, so that the persistent compilation cache gives ep_options_bench
  # ep_bench's single-device step and, compiled with the same option (--memcpy_p2p's default at
  # P = 2, idle on CPU devices), its memcpy step.
  devices = "--xla_force_host_platform_device_count=2"
  out = tmp_path / "ep_options"
  _run([["benchmarks.ep_bench", "--thiek=128,32,16,4,2", "--backend=xla", "--repeats=2",
         "--sample_ms=5", "--schemes=all_to_all,all_gather", f"--out={tmp_path / 'ep'}"],
        ["benchmarks.ep_options_bench", "--thiek=128,32,16,4,2", "--backend=xla", "--repeats=2",
         "--sample_ms=1,2", "--hlo", "--option_set=nccl:",
         "--option_set=memcpy:xla_gpu_use_memcpy_local_p2p=true", f"--out={out}"]],
       env={"XLA_FLAGS": devices})
  name, res = _results(tmp_path / "ep")
  assert name.startswith("cpux2_") and name.endswith("_ep.json") and res["devices"] == 2
  assert set(res["check_max_rel_err"]) == {"all_to_all", "all_gather"}
  assert max(res["check_max_rel_err"].values()) < 1e-5  # every scheme equals one device
  (r,) = res["results"]
  for scheme in ("all_to_all", "all_to_all c=1.25", "all_gather", "all_gather c=1.25"):
    assert r[scheme]["fwdbwd_ms"] > 0 and r[scheme]["communication_ms"] > 0, scheme
  assert r["all_to_all"]["dropped_pairs"] == 0
  assert r["all_gather"]["combine_ms"] > 0 and r["all_gather"]["profile"] is None  # no GPU trace
  assert "| 128,32,16,4,2 | 2 |" in ep_bench.table(res["results"], res["inter_node_gbps_assumed"])
  assert res["xla_flags"] == devices and res["compiler_options"] == ep_bench.MEMCPY_P2P
  assert "alternating rounds" in res["timing"]

  name, res = _results(out)
  assert res["xla_flags"] == devices
  assert name.startswith("cpux2_") and name.endswith("_ep_options.json")
  assert res["option_sets"] == {"nccl": {}, "memcpy": {"xla_gpu_use_memcpy_local_p2p": True}}
  (r,) = res["results"]
  assert [t["sample_ms"] for t in r["timings"]] == [1, 2]
  assert all(t[k] > 0 for t in r["timings"] for k in ("single", "nccl", "memcpy"))
  assert r["profiles"] == {"nccl": None, "memcpy": None}  # no GPU trace
  for option_set in ("nccl", "memcpy"):
    assert "all-to-all" in (out / f"128_32_16_4_2_{option_set}.hlo.txt").read_text()
  assert ep_options_bench.table(res["results"], ["nccl", "memcpy"]).count(
      "| 128,32,16,4,2 | 2 |") == 2
  assert ep_options_bench.parse_option_set("a:x=true,y=-3,z=s") == (
      "a", {"x": True, "y": -3, "z": "s"})
  with pytest.raises(Exception, match="option=value"):
    ep_options_bench.parse_option_set("a:x")


@pytest.mark.slow
def test_pretrain_bench(tmp_path, monkeypatch):
  """One run of the example (one device): its medians, profile split and table. --append adds a
  run that fails, recorded with its error, to that file (every run of that call failed: exit
  status 1); a run name the file has is refused."""
  from benchmarks import pretrain_bench as bench
  # The devices are asked of a child process once: --append compares them with the file's.
  monkeypatch.setattr(bench, "_devices", functools.cache(bench._devices))
  # CHILD_ENV was made when the module was first imported, perhaps before _unoptimized ran.
  monkeypatch.setitem(bench.CHILD_ENV, "JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  _main("benchmarks.pretrain_bench", [
      "--config=tiny", "--common=--backend=xla", "--steps=6", "--log_every=2",
      "--run=one=--warmup=2", "--baseline=one", f"--out={tmp_path}"], monkeypatch)
  name, res = _results(tmp_path)
  assert name.startswith("cpu_") and name.endswith("_pretrain.json"), name
  (ok,) = res["runs"]
  assert ok["tokens_per_s_per_device"] > 0 and ok["heldout_loss"] > 0 and ok["rows"] == 3
  assert ok["profile"]["parts_ms"]["moe"] > 0 and ok["profile"]["parts_ms"]["attention"] > 0
  assert "| one |" in bench.table(res) and "| 1.00 |" in bench.table(res)
  rows = [{"step": str(2 * i + 2), "tokens_per_s_per_device": v, "mfu": "0.1", "moe_tflops": "1",
           "heldout_loss": "" if i % 2 else str(5 - i)}
          for i, v in enumerate(("1", "nan", "4", "6"))]
  summary = bench.summarize(rows, 1)
  assert summary["tokens_per_s_per_device"] == 5.0  # first row and nan left out
  assert summary["heldout_curve"] == [[2, 5.0], [6, 3.0]] and summary["steps"] == 8

  # --append continues the file under its own name (results/ holds renamed ones): its runs,
  # baseline and command stay, this command is added.
  later = tmp_path / "later"
  renamed = name.replace("_pretrain", "_pretrain_memory")
  shutil.copy(tmp_path / name, tmp_path / renamed)
  with pytest.raises(SystemExit, match="every run failed"):  # this call's one run: exit status 1
    _main("benchmarks.pretrain_bench", ["--config=tiny", "--run=broken=--top_k=99",
                                        f"--append={tmp_path / renamed}", f"--out={later}"],
          monkeypatch)
  written, more = _results(later)
  assert written == renamed
  assert [r["name"] for r in more["runs"]] == ["one", "broken"]
  assert "error" in more["runs"][1]  # a failing run is recorded
  text = bench.table(more)
  assert "| one |" in text and "| 1.00 |" in text and "failed" in text
  assert more["baseline"] == "one" and more["command"] == res["command"]
  assert len(more["appended_commands"]) == 1 and "--append=" in more["appended_commands"][0]
  with pytest.raises(app.UsageError, match=r"already has runs \['one'\]"):
    _main("benchmarks.pretrain_bench", ["--config=tiny", "--run=one=",
                                        f"--append={tmp_path / name}", f"--out={later}"],
          monkeypatch)


def test_pretrain_bench_rendering():
  from benchmarks.pretrain_bench import (curve_table, error_line, peak_gib_per_device,
                                         shown_flags, table)
  stderr = ("Traceback (most recent call last):\n  ...\njax.errors.JaxRuntimeError: "
            "RESOURCE_EXHAUSTED: Out of memory\n-----\nFor simplicity, JAX has removed its "
            "internal frames\n")
  assert error_line(stderr) == "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory"
  assert error_line("just a line\n") == "just a line" and error_line("") is None
  assert shown_flags("--data_cache=/tmp/c --corpus_dir=/a/b/site-packages/ --fsdp") == (
      "--corpus_dir=.../b/site-packages --fsdp")
  run = lambda name, flags, curve: {"name": name, "flags": flags, "tokens_per_s_per_device": 2.0,
                                    "mfu": None, "moe_tflops": None, "heldout_loss": None,
                                    "heldout_curve": curve, "state_mb_per_device": None}
  result = {"baseline": "a", "runs": [run("a", "--corpus_bytes=9 --x=1", [[1, 3.0]]),
                                      run("b", "--corpus_bytes=9 --x=2", [[1, 3.0], [2, 2.5],
                                                                           [4, 2.0]])]}
  text = table(result)
  assert text.startswith("Flags of every run: `--corpus_bytes=9`.")  # stated once
  assert "| a | `--x=1` |" in text and "| b | `--x=2` |" in text
  assert all(line.count("|") == 11 for line in text.splitlines()[2:])  # no peak memory: 10 cells
  result["runs"][1]["peak_gib_per_device"] = 71.25
  with_peak = table(result).splitlines()[2:]
  assert "peak GiB per device" in with_peak[0] and "| 71.2 |" in with_peak[-1]
  assert all(line.count("|") == 12 for line in with_peak)
  assert peak_gib_per_device("x\npeak device memory: 71.25 GiB (the most ...)\n") == 71.25
  assert peak_gib_per_device("no statistic on a CPU\n") is None
  assert curve_table(result).splitlines() == [
      "| step | b: held-out loss (nats/token) |", "|---|---|", "| 1 | 3.000 |", "| 2 | 2.500 |",
      "| 4 | 2.000 |"]
  assert curve_table({"runs": [result["runs"][0]]}) == ""  # one evaluation is not a curve


def test_ep_bench_overlap_split():
  from benchmarks.ep_bench import overlap_split
  ms = 1_000_000  # ns
  events = [(0, 4 * ms, "gemm"), (3 * ms, 2 * ms, "ncclDevKernel_AllGather"),
            (6 * ms, 1 * ms, "ncclDevKernel_AllToAll"), (6 * ms, 3 * ms, "gemm"),
            (10 * ms, 1 * ms, "ncclDevKernel_AllToAll")]
  split = overlap_split(events, lambda name: "nccl" in name)
  assert split == {"span_ms": 11.0, "communication_ms": 4.0, "computation_ms": 7.0,
                   "hidden_ms": 2.0}


@pytest.mark.slow
def test_autotune_writes_a_table_that_loads(tmp_path, monkeypatch):
  from sonic_jax.mosaic_gpu import tuning
  out = tmp_path / "table.json"
  _main("benchmarks.autotune", ["--interpret", "--thiek=128,256,128,2,1", "--roles=dx",
                                "--fields=cluster_m", "--repeats=1", f"--out={out}"], monkeypatch)
  data = json.loads(out.read_text())
  assert {"device", "jax", "date", "entries"} <= set(data)
  table = tuning.TuningTable.load(str(out))
  (mine,) = [e for e in table.entries if (e.role, e.d, e.n, e.E) == ("dx", 256, 256, 2)]
  assert dict(mine.fields).keys() <= {"cluster_m"}
  # The packaged table's entries are kept beside the new one (--merge), as written there; each
  # entry says where it came from.
  assert len(table.entries) == len(tuning.packaged().entries) + 1
  with open(tuning.PACKAGED) as f:
    packaged = json.load(f)["entries"]
  assert data["entries"][:-1] == packaged
  assert all(e["date"] and (e.get("commit") or e.get("command")) for e in data["entries"])
  assert data["entries"][-1]["command"].startswith("python -m benchmarks.autotune --interpret")
  assert table.fields("dx", d=256, n=256, num_experts=2, device_kind=mine.device) == dict(
      mine.fields)
  (trials,) = data["trials"]
  # One field of one candidate value: the search skips the others.
  assert [t["config"] for t in trials["trials"]] == [{}, {"cluster_m": 2}]
  assert all(t["same_outputs"] for t in trials["trials"][1:])


def test_autotune_candidates_make_valid_kernel_configs():
  """Every candidate of the search is a field its role's tuning entry takes, with a value its
  kernel configuration takes (a refused one would be skipped as if it did not compile)."""
  from benchmarks import autotune
  import sonic_jax
  from sonic_jax.mosaic_gpu import backend, tuning
  assert set(autotune.SEARCH) == set(tuning.ROLES)
  for role, steps in autotune.SEARCH.items():
    for field, values in steps:
      for value in values:
        fields = dict(zip(field, value)) if isinstance(field, tuple) else {field: value}
        n = 512 if role in ("up", "dx") else 256  # the table's n of the role: 2n for w1
        table = tuning.TuningTable.from_entries([{"role": role, "device": "any", "d": 256,
                                                  "n": n, "E": 2, "config": fields}])
        configs = backend.role_configs(256, 256, 2, True, config=sonic_jax.Config(tuning=table))
        assert table.fields(role, d=256, n=n, num_experts=2) == fields
        assert configs is not None


def _layer_run(date, rows, timing_method="do_bench", **env):
  """A layer results dict of one configuration of the paper's grid."""
  return {"environment": {"device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "date": date,
                          "command": f"python -m benchmarks.moe_bench  # {date}",
                          "timing": timing_method, "data": "sonicmoe", "router_dtype": "bfloat16",
                          **env},
          "configs": [{"config": [32768, 4096, 1024, 64, 4], "rows": rows}]}


def _row(name, fwd, bwd, residual=2**20):
  return {"name": name, "fwd_tflops": fwd, "bwd_tflops": bwd, "fwdbwd_tflops": 1.0,
          "fwd_ms": 1.0, "fwdbwd_ms": 3.0, "residual_bytes": residual}


def _write(folder, name, data):
  (folder / name).write_text(json.dumps(data))


def test_report_renders_the_tables_from_results_files(tmp_path):
  results = tmp_path / "results"
  results.mkdir()
  cfg = [32768, 4096, 1024, 64, 4]
  _write(results, "h100_2026-01-01_layer_baselines.json", _layer_run(
      "2026-01-01 10:00 UTC", [_row("sonic_jax[mosaic_gpu]", 100.0, 100.0),
                               _row("sonic_jax[xla]", 1.0, 1.0), _row("tokamax_layer", 50.0, 25.0),
                               # no measurable backward (moe_bench on a CPU's clock): None
                               _row("uniform_upper_bound", 2.0, None)],
      timing_method="interleaved"))
  _write(results, "h100_2026-01-02_layer_sonicmoe.json", _layer_run(
      "2026-01-02", [_row("sonicmoe", 400.0, 500.0)], sonicmoe="0.1.2.post1", torch="2.11"))
  _write(results, "h100_2026-01-03_layer.json", _layer_run(
      "2026-01-03 10:00 UTC", [_row("sonic_jax[mosaic_gpu]", 440.0, 550.0)]))
  kernels = {name: {"ms": 1.0, "roofline_ms": 0.5, "tflops": 100.0, "gbps": 1.0}
             for name in report.FWD_KERNELS + report.BWD_KERNELS}
  _write(results, "h100_2026-01-04_kernels.json", {
      "device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "date": "2026-01-04",
      "command": "python -m benchmarks.kernel_bench", "dense_bf16_tflops": 700.0,
      "copy_gbps": 2900.0, "configs": [{"config": cfg, "kernels": kernels,
                                        "forward_sum_tflops": 400.0,
                                        "backward_sum_tflops": 500.0}]})
  routing = lambda padding, **extra: {
      "routing": "top-K", "pairs": 10, "rows": 20, "padding_fraction": padding, "gemm_ms": 1.0,
      "gemm_tflops": 2.0, "gemm_speedup": 1.0, "route_layout_ms": 0.1, "forward_ms": 2.0,
      "forward_tflops": 1.0, "forward_speedup": 1.0, **extra}
  rounding_run = lambda date, configs: {
      "device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "date": date,
      "command": "python -m benchmarks.token_rounding_bench", "backend": "mosaic_gpu",
      "configs": configs}
  _write(results, "h100_2026-01-05_token_rounding.json", rounding_run("2026-01-05", [
      {"config": cfg, "routings": [routing(0.5)]},
      {"config": [8192, 4096, 1024, 64, 4], "routings": [routing(0.5)]}]))
  # A later run of fewer configurations gives the role times, not the table.
  roles = {role: 2.0 for role in report.ROLES}
  _write(results, "h100_2026-01-06_token_rounding_roles.json", rounding_run("2026-01-06", [
      {"config": cfg, "routings": [
          routing(0.25, role_ms=roles, step_ms=10.0, step_tflops=1.0, step_speedup=1.0),
          routing(0.0, role_ms={**roles, "dx": 1.0}, step_ms=9.5, step_tflops=1.0,
                  step_speedup=10.0 / 9.5)]}]))
  nvlink_row = lambda group, variant, ms: {"rows": 8192, "d": 4096, "group": group,
                                            "variant": variant, "ms": ms, "gbps": 1.0}
  _write(results, "h100x2_2026-01-07_nvlink.json", {
      "device": "NVIDIA H100 80GB HBM3", "devices": 2, "jax": "0.11.2", "date": "2026-01-07",
      "command": "python -m benchmarks.nvlink_bench", "results": [
          nvlink_row("all-gather", "nccl", 1.0), nvlink_row("all-gather", "push 64 CTAs", 0.8),
          {"rows": 8192, "d": 4096, "group": "all-gather", "variant": "push 8 CTAs",
           "error": "output differs"}]})
  out = tmp_path / "BENCHMARKS.md"
  report.main(["--results", str(results), "--out", str(out)])
  md = out.read_text()
  assert md.count("## Method") == 1 and "## Expert parallelism" not in md
  # The NVLink table: each variant's time against its group's NCCL row; a failed one says why.
  assert "| 8192 | 4096 | all-gather: push 64 CTAs | 0.800 | 1 | 1.25 |" in md
  assert "| all-gather: push 8 CTAs | – | output differs | – |" in md
  layer = md[md.index("## MoE layer"):md.index("## Kernels")]
  # The more recent run's sonic_jax row replaces the older one's; the legend names each run.
  assert "| 32768,4096,1024,64,4 | sonic_jax[mosaic_gpu] | 440 | 550 |" in layer
  assert "| 1.10 | 1.10 | c |" in layer  # 440 / 400 and 550 / 500, from run c
  assert "| uniform upper bound | 2 | – |" in layer
  with pytest.raises(SystemExit):  # a folder that is not there, named
    report.main(["--results", str(tmp_path / "missing"), "--out", str(out)])
  assert "| tokamax layer | 50 | 25 |" in layer and "sonic_jax[xla]" not in layer
  assert "| SonicMoE (paper) | 552 | 554 |" in layer
  assert "- **a**: NVIDIA H100 80GB HBM3, jax 0.11.2, 2026-01-01" in layer
  assert "timing interleaved" in layer and "sonic-moe 0.1.2.post1, torch 2.11" in layer
  assert "(`h100_2026-01-03_layer.json`)" in layer and "timing do_bench" in layer
  assert "| 32768,4096,1024,64,4 | 1.000 (0.500) 100 TF/s |" in md and "| 400 | a |" in md
  assert "| top-K | 50.0% |" in md and "| top-K | 25.0% |" not in md
  assert "- **roles**: NVIDIA H100 80GB HBM3, jax 0.11.2, 2026-01-06" in md
  assert "| 2.000 (1.00×) | 1.000 (2.00×) |" in md
  # The roles save 1 ms of top-K's 10 ms step: at most 10 / 9 with rounding free.
  assert "| 9.000 | 1.111× | 1.053× |" in md and "| 10.000 | – | – |" in md
  readme = report.readme_table(report.load(str(results))["layer"])
  # One row a configuration: fwd / bwd / fwd+bwd of sonic_jax, SonicMoE, the tokamax layer.
  assert "| 32768,4096,1024,64,4 | 440 / 550 / " in readme and " | 400 / 500 / " in readme
  assert " | 50 / 25 / " in readme
  assert "tokamax layer: NVIDIA H100 80GB HBM3, interleaved" in readme
  _write(results, "h100_latest_layer.json", {})
  with pytest.raises(ValueError, match="results files are named"):
    report.load(str(results))
  os.remove(results / "h100_latest_layer.json")
  _write(results, "h200x2_2026-11-29_ep_options.json", {})  # not an "ep" table's
  with pytest.raises(ValueError, match="ep_options_bench's results back a decision"):
    report.load(str(results))


def test_benchmarks_md_is_generated_from_the_results_files(tmp_path):
  """BENCHMARKS.md is what `python -m benchmarks.report` makes of benchmarks/results/, whose files
  are named by device, date and kind (at most 40 of them)."""
  files = os.listdir(report.RESULTS)
  assert 0 < len(files) <= 40 and all(report._NAME.match(f) for f in files), files
  out = tmp_path / "BENCHMARKS.md"
  report.main(["--out", str(out)])
  with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
    assert out.read_text() == f.read(), "run `python -m benchmarks.report`"
  with open(os.path.join(ROOT, "README.md")) as f:
    assert report.readme_table(report.load()["layer"]) in f.read(), (
        "paste `python -m benchmarks.report --readme` into README.md")


def test_ab_trees_runs_a_command_in_both_trees(tmp_path):
  """tools/ab_trees.sh: `prepare` puts a commit's files in the base folder, `run` executes the
  command in each tree (its own sonic_jax first on the path), alternating over rounds, after a
  warm-up run of the new tree that writes apart from the rounds."""
  env = {**os.environ, "AB_BASE": str(tmp_path / "base"), "OUT": str(tmp_path / "out")}
  script = os.path.join(ROOT, "tools", "ab_trees.sh")
  subprocess.run(["bash", script, "prepare", "HEAD"], env=env, check=True, capture_output=True)
  # find_spec locates the package without importing it (and jax).
  probe = ("import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("
           "'sonic_jax').origin), os.environ['AB_OUT'])")
  run = subprocess.run(["bash", script, "run", "--rounds=2", "--", sys.executable, "-c", probe],
                       env=env, check=True, capture_output=True, text=True)
  lines = [l for l in run.stdout.splitlines() if not l.startswith("==")]
  base, new = str(tmp_path / "base" / "sonic_jax"), os.path.join(ROOT, "sonic_jax")
  out = tmp_path / "out"
  assert lines == [f"{new} {out}/warmup", f"{base} {out}/base/1", f"{new} {out}/new/1",
                   f"{new} {out}/new/2", f"{base} {out}/base/2"], run.stdout


def test_scripts_parse():
  """The shell scripts parse, sonicmoe_bench.py answers --help without PyTorch, and the
  benchmark and tool modules import."""
  scripts = glob.glob(os.path.join(ROOT, "benchmarks", "*.sh")) + glob.glob(
      os.path.join(ROOT, "tools", "*.sh"))
  assert len(scripts) >= 5
  for script in scripts:
    proc = subprocess.run(["bash", "-n", script], capture_output=True, text=True)
    assert proc.returncode == 0, (script, proc.stderr)
  proc = subprocess.run([sys.executable, "benchmarks/sonicmoe_bench.py", "--help"], cwd=ROOT,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "--thiek" in proc.stdout, proc.stderr[-2000:]
  proc = subprocess.run(["bash", "benchmarks/wheels.sh"], cwd=ROOT, capture_output=True, text=True)
  assert proc.returncode == 2 and "usage" in proc.stderr
  # The tools define their flags as they are imported.
  for module in ("tools.ptxas_report", "tools.step_timeline"):
    with _own_flags():
      importlib.import_module(module)


def test_grid_problems_and_names():
  assert grid.parse_configs(["256,64,32,8,2"], []) == [(256, 64, 32, 8, 2)]
  for bad in ("256,64,32", "256,64,32,8,x", "256,64,0,8,2"):
    with pytest.raises(app.UsageError, match="expected five positive integers"):
      grid.parse_configs([bad], [])
  cfg = (256, 128, 64, 8, 2)
  std = lambda v: float(np.std(np.asarray(v, np.float32)))
  unit, sonic = grid.random_problem(cfg, data="unit"), grid.random_problem(cfg)
  assert [a.shape for a in sonic] == [(256, 128), (128, 8), (8, 128, 128), (8, 64, 128),
                                      (256, 128)]
  for got, want in zip(map(std, unit), (1, 128 ** -0.5, 128 ** -0.5, 64 ** -0.5, 1)):
    assert abs(got / want - 1) < 0.1
  for got, want in zip(map(std, sonic), (0.2, 0.02, 0.02, 0.02, 0.2)):
    assert abs(got / want - 1) < 0.1
  with pytest.raises(ValueError, match="data must be one of"):
    grid.random_inputs(cfg, data="ones")
  assert grid.device_tag("NVIDIA H100 80GB HBM3") == "h100"
  assert grid.device_tag("NVIDIA H200", 2) == "h200x2" and grid.device_tag("cpu") == "cpu"
  assert grid.results_name({"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-27 03:27 UTC"},
                           "layer") == "h100_2026-11-27_layer.json"
  assert set(grid.SONICMOE_PAPER) == set(grid.PAPER_GRID)


def test_forward_and_backward_keeps_the_forward_output():
  """The timed training step returns the layer's output with its gradients (an unused output
  would let XLA drop the down-projection and aggregation from it)."""
  fn = lambda x, w: jnp.tanh(x @ w)
  x, w, d_y = jnp.ones((4, 3)), jnp.full((3, 2), 0.5), jnp.ones((4, 2))
  y, (d_x, d_w) = jax.jit(timing.forward_and_backward(fn))(x, w, d_y)
  _, vjp = jax.vjp(fn, x, w)
  want_dx, want_dw = vjp(d_y)
  assert jnp.allclose(y, fn(x, w)) and jnp.allclose(d_x, want_dx) and jnp.allclose(d_w, want_dw)


def test_time_interleaved_rounds_and_rotation():
  """Every function gets one sample per round, and each call takes the next input set in turn."""
  seen = []

  def fn(tag):
    seen.append(tag)
    return tag

  times = timing.time_interleaved({"a": (fn, [("a0",), ("a1",)]), "b": (fn, ("b0",))},
                                  repeats=3, min_sample_s=0.0, max_inner=1)
  assert set(times) == {"a", "b"} and all(len(s) == 3 for _, s in times.values())
  # Per function: a warm-up call on every input set, then one call that sizes a sample.
  assert seen[:5] == ["a0", "a1", "a0", "b0", "b0"]
  assert seen[5:] == ["a0", "b0", "a1", "b0", "a0", "b0"]


def test_do_bench_timing():
  """Each call's span runs from its earliest event to its latest event's end, the flush before it
  not counted; events in another pattern give None. On a CPU, time_do_bench times on the host."""
  events = []
  for r in range(3):  # a round: one flush event, then a call of two events
    events += [(r * 1000, 100, "flush"), (r * 1000 + 120, 200, "a"),
               (r * 1000 + 330, 300 + 10 * r, "b")]
  assert timing.per_call_spans(events, 1, 2, 3) == [
      (330 + 300 + 10 * r - 120) / 1e9 for r in range(3)]
  assert timing.per_call_spans(events[:-1], 1, 2, 3) is None
  assert timing.per_call_spans(events, 1, 0, 3) is None
  compiled = jax.jit(lambda a: a @ a).lower(jnp.ones((32, 32))).compile()
  t, info = timing.time_do_bench(compiled, (jnp.ones((32, 32)),), rep_ms=5.0)
  assert t > 0 and info["per_call"] == "host" and info["calls"] >= 1


def test_ncu_summary_reads_raw_reports(tmp_path, capsys):
  """tools/ncu_forward --summarize: `ncu --import --csv --page raw` files (plain or gzipped;
  section-prefixed columns keyed by their metric), one line per kernel, roles named from our
  kernels' names and SonicMoE's (its plain GEMMs numbered in call order)."""
  import gzip
  from tools import ncu_forward
  header = '"ID","Kernel Name","gpu__time_duration.sum","TPC.TriageCompute.sm__pipe_tensor_' \
           'cycles_active_realtime.avg.pct_of_peak_sustained_elapsed","dram__bytes_read.sum"\n'
  units = '"","","ns","%","byte"\n'
  ours = tmp_path / "ncu_concat_step_x.csv"
  ours.write_text(header + units + '"0","up_projection_mosaic_gpu_kernel","3,500,000","70.5",'
                  '"4,000"\n"1","dx_projection_mosaic_gpu_kernel","3000000","80","2000"\n')
  theirs = tmp_path / "ncu_sonicmoe_step_x.csv.gz"
  with gzip.open(theirs, "wt") as f:
    f.write(header + units + '"0","kernel_quackgemm_actGemmGatedSm90_x","3400000","75","4500"\n'
            '"1","kernel_quackgemm_default_epiGemmDefaultSm90_x","1600000","73","900"\n'
            '"2","kernel_quackgemm_default_epiGemmDefaultSm90_x","1500000","66","1400"\n')
  table = ncu_forward.summarize([str(ours), str(theirs)])
  assert set(table) == {"up", "dX", "gemm", "gemm#2"}
  assert table["up"]["concat_step_x"]["gpu__time_duration.sum"] == 3.5e6
  assert table["up"]["sonicmoe_step_x"]["dram__bytes_read.sum"] == 4500
  assert table["gemm#2"]["sonicmoe_step_x"]["gpu__time_duration.sum"] == 1.5e6
  assert "concat_step_x" in capsys.readouterr().out


def test_ncu_stalls_read_source_pages(tmp_path, capsys):
  """tools/ncu_forward --stalls: the share of stall samples per opcode of each kernel (a
  predicate guard is not the opcode; a kernel launched twice as name#2)."""
  from tools import ncu_forward
  header = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
            '"stall_long_sb","stall_wait"\n')
  page = tmp_path / "ncu_concat_forward_x_sass.csv"
  page.write_text(
      '"Kernel Name","up_projection_mosaic_gpu_kernel",\n' + header
      + '"0x0","SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR8], R12","10","100","0","10"\n'
      '"0x10","@!P1  BRA 0x20","60","100","55","5"\n'
      '"0x20","HGMMA.64x128x16.F32.BF16 R88, gdesc[UR12].tnspB, R88","1,030","100","0","30"\n'
      '"Kernel Name","down_projection_mosaic_gpu_kernel",\n' + header
      + '"0x0","NOP","5","1","0","5"\n"Kernel Name","down_projection_mosaic_gpu_kernel",\n' + header
      + '"0x0","BAR","2","1","0","2"\n')
  out = ncu_forward.summarize_stalls([str(page)], top=2)["concat_forward_x"]
  assert out["up_projection_mosaic_gpu_kernel"] == pytest.approx(
      {"SYNCS": 10 / 1100, "BRA": 60 / 1100, "HGMMA": 1030 / 1100})
  assert out["down_projection_mosaic_gpu_kernel#2"] == {"BAR": 1.0}
  assert "long_sb 55" in capsys.readouterr().out


def test_extras_fold_bench_checks_the_fold_against_its_reference(monkeypatch):
  """The fold bench checks the kernel (interpreted, a tiny rounding with extra pairs) against the
  segment-sum reference before timing both."""
  from benchmarks import extras_fold_bench as bench
  from sonic_jax import layout, routing
  # The bench's problem routes, rounds and lays out eagerly: each of the three, one program.
  monkeypatch.setattr(routing, "route", jax.jit(routing.route, static_argnums=(1, 2)))
  monkeypatch.setattr(routing, "round_tokens", jax.jit(routing.round_tokens, static_argnums=(1, 2)))
  monkeypatch.setattr(layout, "build_grouped_layout", jax.jit(
      layout.build_grouped_layout, static_argnums=(1, 2), static_argnames="extras_by_expert"))
  results = bench.run_case(64, 128, 4, 2, 1, tile=16, interpret=True)
  assert [r["variant"] for r in results] == ["xla", "kernel"]
  assert results[1]["extras_used"] > 0 and results[1]["error"] <= 1e-2
  lines = bench.table(results).splitlines()
  assert len(lines) == 2 + 2 and all(line.startswith("| 64,128,4,2 | ") for line in lines[2:])
