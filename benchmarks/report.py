r"""BENCHMARKS.md from the results files in benchmarks/results/, and the README's table.

  python -m benchmarks.report                 # regenerates BENCHMARKS.md
  python -m benchmarks.report --readme        # prints the README's table
  python -m benchmarks.report --results=DIR --out=FILE

A results file is named <device>_<date>_<kind>[_<detail>].json (`grid.results_name`); its kind says
which table it feeds: "layer" (moe_bench, sonicmoe_bench), "kernels" (kernel_bench),
"token_rounding" (token_rounding_bench), "ep" (ep_bench), "nvlink" (nvlink_bench), "options"
(moe_bench --options), "pretrain" (pretrain_bench). Layer files merge in date order: a row of a
more recent run replaces the row of the same name and configuration from an older one. The kernel
table takes each configuration from its most recent file, the expert-parallel table the most recent
file of each device count, the NVLink and pretraining sections every file (the most recent first,
each labelled by its place in date order), the token-rounding table the most recent file of the
most configurations and its role times the most recent file that has them; the other tables show
their kind's most recent file. Each table names the runs its rows come from: device, versions,
date, command and the file's "notes" where it has them. Runs anywhere (no GPU needed).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import json

from benchmarks import grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
KINDS = ("layer", "kernels", "token_rounding", "ep", "nvlink", "options", "pretrain")
_NAME = re.compile(r"^(?P<device>[a-z0-9_]+?)_(?P<date>\d{4}-\d{2}-\d{2})_(?P<kind>"
                   + "|".join(KINDS) + r")(_[a-z0-9_]+)?\.json$")
# Layer rows in the order shown, with their labels; sonic_jax's rows lead, by name.
LABELS = {"sonicmoe": "SonicMoE", "sonicmoe (paper)": "SonicMoE (paper)",
          "tokamax_layer": "tokamax layer", "uniform_upper_bound": "uniform upper bound"}
HIDDEN = {"sonic_jax[xla]"}  # the xla backend is a correctness path (a scan), not a GPU path
README_CONFIGS = [(40960, 768, 256, 128, 8), (24576, 1536, 512, 64, 4),
                  (32768, 4096, 1024, 64, 4), (32768, 4096, 256, 256, 16)]
FWD_KERNELS = ("route+layout", "up (fused gather)", "xla gather x[rows]", "down",
               "aggregate (xla)", "aggregate (backend)")
BWD_KERNELS = ("bwd dH (fused gather)", "bwd dw1 = x^T dH (fused gather)",
               "bwd dw2 = A_s^T dO (fused gather)", "bwd dX rows (dH w1^T)")


def load(results_dir=RESULTS):
  """{kind: [results dict, ...] in date order}; each dict gets "_file" (its base name)."""
  found = {kind: [] for kind in KINDS}
  for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
    m = _NAME.match(os.path.basename(path))
    if m is not None and m["kind"] == "ep" and os.path.basename(path).endswith("_ep_options.json"):
      raise ValueError(f"{path}: ep_options_bench's results back a decision (docs/decisions.md), "
                       "no table: they stay out of the results directory")
    if m is None:
      raise ValueError(f"{path}: results files are named <device>_<date>_<kind>[_detail].json "
                       f"with a kind of {KINDS}")
    with open(path) as f:
      data = json.load(f)
    data["_file"] = os.path.basename(path)
    found[m["kind"]].append(data)
  for runs in found.values():
    runs.sort(key=lambda r: (record(r)["date"], r["_file"]))
  return found


def record(run):
  """A run's record (device, versions, date, command): a layer file's "environment", else the
  file's own keys."""
  return run.get("environment", run)


def _cfg(cfg):
  return ",".join(map(str, cfg))


def _tf(v):
  return "–" if v is None else (f"{v:.0f}" if v >= 10 else f"{v:.2g}")


def _ms(v):
  return "–" if v is None else f"{v:.3f}"


def _versions(rec):
  keys = (("jax", "jax"), ("sonicmoe", "sonic-moe"), ("torch", "torch"), ("tokamax", "tokamax"))
  return ", ".join(f"{label} {rec[k]}" for k, label in keys if isinstance(rec.get(k), str))


def _labelled(runs):
  """[(label, run)] newest first; labelled oldest first ("a", "b", ...), so that a file keeps its
  label when newer ones come."""
  return [(chr(ord("a") + i), run) for i, run in enumerate(runs)][::-1]


def runs_legend(labelled):
  """Markdown lines naming each run [(label, results dict)]."""
  lines = []
  for label, run in labelled:
    rec = record(run)
    lines.append(f"- **{label}**: {rec['device']}"
                 + (f" × {rec['devices']}" if rec.get("devices", 1) > 1 else "")
                 + f", {_versions(rec)}, {rec['date'][:10]}"
                 + (f" (`{run['_file']}`)" if "_file" in run else "") + f": `{rec['command']}`"
                 + "".join(f", then `{c}`" for c in rec.get("appended_commands", ()))
                 + (f". {rec['notes']}" if rec.get("notes") else ""))
  return "\n".join(lines)


def row_summary(row):
  """One line of a layer row, for the benchmarks' logs."""
  if "error" in row:
    return f"{row['name']:<24} {row['error']}"
  return (f"{row['name']:<24} fwd {_tf(row['fwd_tflops']):>5}  bwd {_tf(row['bwd_tflops']):>5}  "
          f"fwd+bwd {_tf(row['fwdbwd_tflops']):>5} TFLOP/s  ({row['fwd_ms']:.3f} / "
          f"{row['fwdbwd_ms']:.3f} ms)  residuals {row.get('residual_bytes', 0) / 2**20:.0f} MiB")


def _rows(run):
  """[(config, row)] of a layer run."""
  return [(tuple(res["config"]), row) for res in run["configs"] for row in res["rows"]]


def merge_layer(runs, hidden=HIDDEN):
  """({config: {row name: (row, run)}}, the runs that gave a row, in date order); rows named in
  `hidden` are left out."""
  merged = {}
  for run in runs:
    for cfg, row in _rows(run):
      if row["name"] not in hidden:
        merged.setdefault(cfg, {})[row["name"]] = (row, run)
  used = [r for r in runs if any(run is r for rows in merged.values() for _, run in rows.values())]
  return merged, used


def _order(name):
  """sonic_jax's rows, then LABELS' order, then any other row."""
  if name.startswith("sonic_jax"):
    return (0, name)
  return (1 + list(LABELS).index(name), name) if name in LABELS else (len(LABELS) + 1, name)


def _paper_row(cfg):
  fwd, bwd = grid.SONICMOE_PAPER[cfg]
  return {"name": "sonicmoe (paper)", "fwd_tflops": fwd, "bwd_tflops": bwd,
          "fwdbwd_tflops": 3 / (1 / fwd + 2 / bwd)}


def layer_table(runs, with_published=True, hidden=HIDDEN):
  """The layer table of layer runs (in date order) with its legend of runs."""
  merged, used = merge_layer(runs, hidden)
  labels = {id(run): chr(ord("a") + i) for i, run in enumerate(used)}
  lines = ["| config (T,d,n,E,K) | layer | fwd TF/s | bwd TF/s | fwd+bwd TF/s | fwd ms | "
           "fwd+bwd ms | residual MiB | fwd / SonicMoE | bwd / SonicMoE | run |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for cfg in sorted(merged, key=lambda c: (grid.PAPER_GRID + [c]).index(c)):
    rows = dict(merged[cfg])
    if with_published and cfg in grid.SONICMOE_PAPER:
      rows["sonicmoe (paper)"] = (_paper_row(cfg), None)
    ref = rows.get("sonicmoe", ({}, None))[0]
    for name in sorted(rows, key=_order):
      row, run = rows[name]
      label, where = LABELS.get(name, name), labels[id(run)] if run is not None else "paper"
      if "error" in row:
        lines.append(f"| {_cfg(cfg)} | {label} | {row['error'][:80]} |" + " |" * 7 + f" {where} |")
        continue
      ratio = lambda k: (f"{row[k] / ref[k]:.2f}" if name.startswith("sonic_jax") and ref.get(k)
                         and row.get(k) else "")
      res = row.get("residual_bytes")
      lines.append(
          f"| {_cfg(cfg)} | {label} | {_tf(row['fwd_tflops'])} | {_tf(row.get('bwd_tflops'))} | "
          f"{_tf(row.get('fwdbwd_tflops'))} | {_ms(row.get('fwd_ms'))} | "
          f"{_ms(row.get('fwdbwd_ms'))} | {'–' if res is None else f'{res / 2**20:.0f}'} | "
          f"{ratio('fwd_tflops')} | {ratio('bwd_tflops')} | {where} |")
  legend = "\n".join(
      f"{runs_legend([(labels[id(r)], r)])}; timing {record(r)['timing']}, data "
      f"{record(r)['data']}, router weights {record(r)['router_dtype']}"
      for r in used)
  return f"{legend}\n\n" + "\n".join(lines)


def readme_table(runs):
  """The README's table: per configuration of README_CONFIGS, forward / backward / forward+backward
  TF/s and residual MiB of sonic_jax, SonicMoE and the tokamax layer, with the runs they come
  from."""
  merged, _ = merge_layer(runs)
  names = ("sonic_jax[mosaic_gpu]", "sonicmoe", "tokamax_layer")
  labels = [LABELS.get(name, "sonic_jax") for name in names]
  lines = ["| config (T,d,n,E,K) | "
           + " | ".join(f"{label} fwd / bwd / fwd+bwd" for label in labels)
           + " | residual MiB: " + " / ".join(labels) + " |", "|---|---|---|---|---|"]
  sources = {}
  for cfg in README_CONFIGS:
    speeds, memory = [], []
    for name, label in zip(names, labels):
      row, run = merged.get(cfg, {}).get(name, ({"error": ""}, None))
      if "error" in row:
        speeds.append("–")
        memory.append("–")
        continue
      rec = record(run)
      sources.setdefault(f"{label}: {rec['device']}, {rec['timing']}, data "
                         f"{rec['data']}", set()).add(rec["date"][:10])
      speeds.append(" / ".join(_tf(row[k]) for k in ("fwd_tflops", "bwd_tflops", "fwdbwd_tflops")))
      res = row.get("residual_bytes")
      memory.append("–" if res is None else f"{res / 2**20:.0f}")
    lines.append(f"| {_cfg(cfg)} | " + " | ".join(speeds) + f" | {' / '.join(memory)} |")
  runs_text = "; ".join(f"{k}, {', '.join(sorted(v))}" for k, v in sources.items())
  return ("\n".join(lines) + "\n\nTF/s, bfloat16, SwiGLU, FLOPs as the SonicMoE paper counts them. "
          f"{runs_text}. Columns are separate runs; GPUs of one kind differ by up to 8%. "
          "Method, 12 configurations: BENCHMARKS.md.")


def kernels_table(runs):
  """Per-kernel tables (forward, backward), each configuration from its latest kernel_bench run."""
  latest = {}
  for run in runs:
    for res in run["configs"]:
      latest[tuple(res["config"])] = (res, run)
  used = [r for r in runs if any(run is r for _, run in latest.values())]
  labels = {id(run): chr(ord("a") + i) for i, run in enumerate(used)}
  parts = []
  for title, names, total in (("Forward", FWD_KERNELS, "forward_sum_tflops"),
                              ("Backward", BWD_KERNELS, "backward_sum_tflops")):
    shown = [n[4:] if n.startswith("bwd ") else n for n in names]
    lines = [f"{title}:", "", "| config (T,d,n,E,K) | " + " | ".join(shown)
             + f" | {title.lower()} (sum) TF/s | run |", "|---|" + "---|" * (len(names) + 2)]
    for cfg in sorted(latest, key=lambda c: (grid.PAPER_GRID + [c]).index(c)):
      res, run = latest[cfg]
      cells = []
      for n in names:
        k = res["kernels"].get(n)
        rate = "" if k is None else (f"{k['tflops']:.0f} TF/s" if k.get("tflops")
                                     else f"{k['gbps']:.0f} GB/s")
        cells.append("–" if k is None else f"{k['ms']:.3f} ({k['roofline_ms']:.3f}) {rate}")
      lines.append(f"| {_cfg(cfg)} | " + " | ".join(cells)
                   + f" | {res[total]:.0f} | {labels[id(run)]} |")
    parts.append("\n".join(lines))
  legend = "\n".join(
      f"{runs_legend([(labels[id(r)], r)])}; data {r.get('data', 'unit')}, measured ceilings "
      f"{r['dense_bf16_tflops']:.0f} TFLOP/s (8192³ bf16 GEMM) and {r['copy_gbps']:.0f} GB/s "
      "(device copy)" for r in used)
  return legend + "\n\n" + "\n\n".join(parts)


def token_rounding_table(run):
  lines = ["| config (T,d,n,E,K) | routing | padding rows | expert GEMMs ms (TF/s) | "
           "speed-up vs top-K | route+layout ms (× top-K) | layer forward ms | speed-up vs "
           "top-K | training step ms (TF/s) | speed-up vs top-K |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for res in run["configs"]:
    for r in res["routings"]:
      route = f"{r['route_layout_ms']:.3f}"
      if "route_layout_vs_top_k" in r:
        route += f" ({r['route_layout_vs_top_k']:.2f}×)"
      step = "–", "–"
      if "step_ms" in r:
        step = f"{r['step_ms']:.3f} ({r['step_tflops']:.0f})", f"{r['step_speedup']:.3f}×"
      lines.append(
          f"| {_cfg(res['config'])} | {r['routing']} | "
          f"{100 * r['padding_fraction']:.1f}% | {r['gemm_ms']:.3f} ({r['gemm_tflops']:.0f}) | "
          f"{r['gemm_speedup']:.3f}× | {route} | {r['forward_ms']:.3f} | "
          f"{r['forward_speedup']:.3f}× | {step[0]} | {step[1]} |")
  return "\n".join(lines)


# The GEMM roles `token_rounding_bench --role_times` times, in its "role_ms" records.
ROLES = ("up", "down", "dh", "dx", "weight_grads")


def _has_role_times(run):
  return any(sum(1 for r in res["routings"] if r.get("role_ms")) >= 2 for res in run["configs"])


def step_bound(base, r):
  """The training-step speed-up over `base` (top-K) that `r`'s layout allows if its routing cost
  nothing beyond top-K's: top-K's step less what the GEMM roles save on `r`'s layout."""
  saved = sum(base["role_ms"][role] - r["role_ms"][role] for role in ROLES)
  return base["step_ms"] / (base["step_ms"] - saved)


def token_rounding_roles_table(run):
  """Each GEMM role's ms alone on each routing's layout, for the configurations that have them
  ("" if none has), with the step speed-up those roles bound and the one measured."""
  lines = []
  for res in run["configs"]:
    routings = [r for r in res["routings"] if r.get("role_ms")]
    if len(routings) < 2:
      continue
    base = routings[0]
    for r in routings:
      cells = []
      for role in ROLES:
        cell = f"{r['role_ms'][role]:.3f}"
        if r is not base:
          cell += f" ({base['role_ms'][role] / r['role_ms'][role]:.2f}×)"
        cells.append(cell)
      cells.append(f"{sum(r['role_ms'][role] for role in ROLES):.3f}")
      bound = measured = "–"
      if r is not base and "step_ms" in r and "step_ms" in base:
        bound, measured = f"{step_bound(base, r):.3f}×", f"{r['step_speedup']:.3f}×"
      cells += [bound, measured]
      lines.append(f"| {_cfg(res['config'])} | {r['routing']} | {r['rows']:,} | "
                   + " | ".join(cells) + " |")
  if not lines:
    return ""
  return "\n".join(["| config (T,d,n,E,K) | routing | grouped rows | up ms | down ms | dH ms | "
                    "dX ms | weight gradients ms | roles ms | step speed-up bound | step "
                    "speed-up measured |", "|---|---|---|---|---|---|---|---|---|---|---|"] + lines)


METHOD = """\
## Method

- **Timing.** Compilation is excluded (the layer table's JSON records its time). Each figure is
  the median of repeated runs after warm-up, by one of two methods (the layer table's run list
  names each run's; the other tables but the pretraining ones, which take the medians of the
  example's own metrics rows, use *interleaved*: the kernel table times each program alone,
  the token-rounding table and the expert-parallel runs whose legend says so a configuration's
  programs in alternating rounds):
  *do_bench* times as triton's `do_bench(warmup=5, rep=200)`, the method of SonicMoE's own
  benchmark: warm-up calls, then a 200 ms burst of calls each after an L2 flush, each call's
  device span read from a profiler trace, the median (where a trace has none: the burst's mean
  call, host-timed); the forward, then the forward+backward (`timing.time_do_bench`; SonicMoE's
  rows by triton's own `do_bench`). *interleaved* takes samples of sustained back-to-back calls,
  each sample a batch ended by one device synchronisation, rotating input sets where a benchmark
  makes several (`moe_bench --input_sets`), the forward and the forward+backward in alternating
  rounds (`timing.time_interleaved`). The forward+backward step returns the layer's output with
  the gradients (an unused output would let XLA drop the down-projection and aggregation from the
  step); backward = (forward+backward) − forward.
- **FLOPs.** The SonicMoE paper's counts for a GLU: forward 6·T·K·d·n, backward 12·T·K·d·n,
  forward+backward 18·T·K·d·n; the uniform upper bound and token rounding count the pairs they
  compute. The kernel table's per-kernel TF/s and rooflines count the rows each GEMM computes,
  padding rows included (2.2-4.4% more than the pairs on this grid); its forward and backward sums
  use the paper's counts. Rooflines are max(FLOPs / GEMM rate, bytes / copy rate) with the GEMM
  rate and copy bandwidth measured in the same run.
- **Memory.** "residual MiB": the bytes autodiff keeps from the forward for the backward, not
  counting the layer's inputs (x, weights); SonicMoE's: the device memory its forward leaves
  allocated, less its output.
- **Problem.** bfloat16, SwiGLU (concat gate/up layout), softmax-over-top-K routing. Data
  "sonicmoe" draws SonicMoE's benchmark's scales (x and dO ~ 0.2·N(0, 1), every weight of std
  0.02); "unit" draws x and dO ~ N(0, 1) and weights of std 1/√fan-in.
- **Runs.** Each table lists the runs its rows come from (device, versions, date, command, results
  file) and each row names its run; a run's command is the one it ran, under the scripts'
  defaults of its date (where a later default differs, or a run was assembled otherwise, its
  notes say how). Baselines measured in the same run as sonic_jax's rows
  share its run label; rows of different runs come from different processes, possibly on different
  GPUs of one kind, which differ by a few percent, and the ratios to SonicMoE compare across runs
  where the labels differ. "SonicMoE (paper)" is read off the paper's Fig. 14.
- **Re-running** (the baselines' wheels come from the ignored folders `.whl` and `.sonic`, which
  `bash benchmarks/wheels.sh tokamax|sonicmoe` fills on a machine with network access, for a GPU
  host without it):
  sonic_jax's layer rows, the 12 configurations on one H100 in 4.5 minutes: `bash
  benchmarks/gpu_bench.sh --backends=mosaic_gpu --baselines=` (the tokamax layer and the upper
  bound: the moe_bench flags of their run's command in the table's run list, through
  `gpu_bench.sh` with `.whl`, which installs tokamax: without it moe_bench leaves its rows out);
  SonicMoE and sonic_jax on one
  GPU: `bash benchmarks/sonic_same_gpu.sh` (with `.sonic`); the compiled tests and the kernel table
  as its runs were timed: `bash benchmarks/gpu_check.sh --data=unit`; token rounding's kernels'
  compiled tests and its table, about 7 minutes on an H100:
  `bash benchmarks/token_rounding_gpu.sh --role_times`;
  the pretraining example with and without rounding: `python -m benchmarks.pretrain_bench
  --config=h100 --steps=150 --log_every=25 "--common=--warmup=20 --tensorboard=false"
  --baseline=top-K --run=top-K=--token_rounding=none --run=nearest=--token_rounding=nearest
  "--run=nearest again=--token_rounding=nearest" "--run=top-K again=--token_rounding=none"`; expert
  parallelism, about 3 minutes on 4 GPUs: `bash benchmarks/ep_gpu.sh --thiek=16384,4096,1024,64,4
  --thiek=8192,4096,512,128,8 --repeats=5`; the NVLink peer copies' compiled tests and table, about
  1.5 minutes on 2 or 4 GPUs: `bash benchmarks/nvlink_gpu.sh`; pretraining on 4 GPUs (with `.whl`
  for tokamax), 2-4 minutes a run of the OLMoE preset (a machine's first run also builds the
  corpus's BPE: give it a longer `--timeout`): `bash benchmarks/pretrain_gpu.sh --config=olmoe_1b_7b
  --run=NAME=FLAGS ...`. The scripts write their results JSON to `$OUT` (default `bench_out`;
  `gpu_bench.sh` to `$OUT/bench`): copy it into `benchmarks/results/`, then `python -m
  benchmarks.report`.
- **Two versions of the code** are compared on one machine in one run, their processes
  alternating, since timings compare only within one machine and one run: `bash tools/ab_trees.sh
  prepare REF` in a checkout, then, with `.cache/ab_base` copied to the GPU host, `bash
  tools/ab_trees.sh run --rounds=2 -- CMD` there (CMD writes to `$AB_OUT`).
"""


def options_table(run):
  """Model-family options: each row's forward and forward+backward time against the run's plain
  softmax top-K row of the same configuration (same run, same GPU)."""
  lines = ["| configuration | option | forward ms | fwd+bwd ms | fwd+bwd vs softmax top-K |",
           "|---|---|---|---|---|"]
  for res in run["configs"]:
    rows = res["rows"]
    base = rows[0]
    for row in rows:
      option = row["name"].partition(" ")[2] or "softmax top-K (plain)"
      if "error" in row:
        lines.append(f"| {_cfg(res['config'])} | {option} | {row['error']} | | |")
        continue
      ratio = row["fwdbwd_ms"] / base["fwdbwd_ms"] if "fwdbwd_ms" in base else float("nan")
      lines.append(f"| {_cfg(res['config'])} | {option} | {row['fwd_ms']:.3f} | "
                   f"{row['fwdbwd_ms']:.3f} | {ratio:.3f} |")
  return "\n".join(lines)


def benchmarks_md(found):
  parts = ["# Benchmarks\n\nGenerated by `python -m benchmarks.report` from the files in "
           "`benchmarks/results/`; do not edit by hand.\n", METHOD]
  if found["layer"]:
    parts.append("## MoE layer\n\nForward, backward and forward+backward of one layer on the "
                 "SonicMoE paper's configurations; the ratios are sonic_jax's TFLOP/s over "
                 "SonicMoE's measured ones.\n\n" + layer_table(found["layer"]) + "\n")
  if found["kernels"]:
    parts.append("## Kernels, one at a time\n\nThe kernels the `mosaic_gpu` backend runs, each "
                 "with the tuning table's configuration for the problem. Each cell: median ms "
                 "(roofline ms) and the achieved rate. \"up\", dH, dw1 and dw2 gather their rows "
                 "of x or dO inside the kernel; \"xla gather x[rows]\" is what a separate XLA "
                 "gather of x's rows would cost. \"aggregate (backend)\" is the forward's weighted "
                 "gather-sum as the backend runs it. The sums add route+layout, up, down and "
                 "aggregate (backend), and dH, dw1, dw2, dX; short programs such as route+layout "
                 "include host dispatch.\n\n" + kernels_table(found["kernels"]) + "\n")
  if found["token_rounding"]:
    # The table: the latest run of the most configurations; the role times: the latest run that
    # has them (a shorter --role_times run need not replace the table's).
    run = max(reversed(found["token_rounding"]), key=lambda r: len(r["configs"]))
    role_run = next((r for r in reversed(found["token_rounding"]) if _has_role_times(r)), None)
    parts.append(f"## Token rounding against top-K\n\n{runs_legend([('run', run)])}; backend "
                 f"`{run['backend']}`, data {run.get('data', 'unit')}. \"padding rows\": rows of "
                 "the grouped GEMMs that hold no (token, expert) pair, as a fraction of the pairs; "
                 "\"expert GEMMs\": up-projection (with its row gather and activation) plus "
                 "down-projection on the routing's layout; \"route+layout\": the routing as "
                 "the layer runs it (router GEMM and top-K, one kernel where the layer fuses "
                 "them; rounding) and its grouped layout; \"training step\": the layer's "
                 "forward and backward (the gradients of x, the router and the expert "
                 "weights).\n\n"
                 + token_rounding_table(run) + "\n")
    if role_run is not None:
      source = "" if role_run is run else runs_legend([("roles", role_run)]) + "\n\n"
      parts.append("Each GEMM role alone on each routing's layout (`--role_times`; random "
                   "operands, zero on padding rows), and top-K's time over rounding's. \"step "
                   "speed-up bound\": the training step's speed-up over top-K if rounding cost "
                   "nothing but its layout, top-K's step over (top-K's step less the time the "
                   "roles save); \"measured\": the same run's interleaved step "
                   "speed-up:\n\n"
                   + source + token_rounding_roles_table(role_run) + "\n")
  if found["options"]:
    run = found["options"][-1]
    parts.append(f"## Model-family options\n\n{runs_legend([('run', run)])}. The layer "
                 "(bf16, `mosaic_gpu`) with one family option each, against plain softmax top-K "
                 "SwiGLU in the same run: a ratio above 1 is the option's cost.\n\n"
                 + options_table(run) + "\n")
  if found["ep"]:
    from benchmarks.ep_bench import SCHEMES, table as ep_table
    latest = {record(r).get("devices", 1): r for r in found["ep"]}  # per device count
    runs = [latest[p] for p in sorted(latest, reverse=True)]
    labelled = [(f"P = {record(r).get('devices', 1)}", r) for r in runs]
    # over the schemes the tables show (older files also checked a transport since removed)
    max_err = max(v for r in runs for k, v in r["check_max_rel_err"].items() if k in SCHEMES)
    legend = runs_legend(labelled).split("\n")
    for i, (_, r) in enumerate(labelled):  # how each run timed, and the XLA options it ran with
      rec = record(r)
      legend[i] += (f". Timing: {rec['timing']}" if rec.get("timing") else
                    ". Timing: each program alone, in turn")
      legend[i] += (f"; XLA_FLAGS `{rec['xla_flags']}`" if rec.get("xla_flags") else "")
      options = ", ".join(f"{k}={str(v).lower()}"
                          for k, v in rec.get("compiler_options", {}).items())
      legend[i] += f"; sharded programs compiled with `{options}`" if options else ""
    legend = "\n".join(legend)
    parts.append(f"## Expert parallelism\n\nThe most recent run on each number of devices:\n\n"
                 f"{legend}\n\nBackend `{runs[0]['backend']}`, bf16, SwiGLU. Each "
                 "configuration is the work of one device: "
                 "T_local tokens per device, E experts over the P devices. \"single\" is "
                 "`sonic_jax.moe` on one device with T_local tokens and all E experts; "
                 "\"× single\" is the sharded TF/s per device over it. \"collectives\" are the "
                 "exchanges (or the all-gather of x and the combine) alone at the layer's sizes; "
                 "\"comm share\" is four exchanges (or two all-gathers and combines) over the "
                 "step; \"hidden\" is the share of a traced step's communication on GPU 0 (NCCL "
                 "kernels and copies between GPUs) that ran while a kernel did (traced for the "
                 "dropless all_gather only). "
                 "Before timing, every dropless scheme matched the single-device op at float32 "
                 f"(max relative error {max_err:.1e}). The extrapolation keeps the measured "
                 "compute and bandwidths, 8 GPUs a node, and "
                 f"{runs[0]['inter_node_gbps_assumed']:.0f} GB/s per GPU across nodes (assumed); "
                 "communication not overlapped.\n\n"
                 + "\n\n".join(ep_table(r["results"], r["inter_node_gbps_assumed"])
                                for r in runs) + "\n")
  if found["nvlink"]:
    from benchmarks.nvlink_bench import table as nvlink_table
    labelled = _labelled(found["nvlink"])
    parts.append("## NVLink peer copies\n\nCandidate transports for expert-parallel dispatch "
                 "and combine (`sonic_jax.mosaic_gpu.peer_copy`; the layer does not use them) "
                 "against NCCL, every device of one host:\n\n"
                 f"{runs_legend(labelled)}\n\nAll-gather of a (rows, d) bf16 array "
                 "per device: NCCL (`jax.lax.all_gather`) against TMA stores into each peer's "
                 "output. Row gather of half of each peer's rows in random order: NCCL's "
                 "all-gather and an XLA gather against cp.async reads from the peers' memory. "
                 "GB/s: bytes of the rows a device needs from its peers over the time (the NCCL "
                 "row gather moves twice that). Each variant's output equalled its NCCL "
                 "reference bit for bit before it was timed.\n\n"
                 + "\n\n".join(f"Run {label}:\n\n" + nvlink_table(run["results"])
                                 for label, run in labelled) + "\n")
  if found["pretrain"]:
    from benchmarks.pretrain_bench import curve_table as pretrain_curves
    from benchmarks.pretrain_bench import table as pretrain_table
    labelled = _labelled(found["pretrain"])
    parts.append(f"## Pretraining\n\n{runs_legend(labelled)}\n\n"
                 "`examples/pretrain/train.py --config=...`, one run after another on the same "
                 "devices (`benchmarks.pretrain_bench`), a table for each results file; MFU is "
                 "(6 N_active + 12 L d S) FLOPs per token × tokens/s per device over the device's "
                 "dense bf16 peak; the MoE layers' TFLOP/s is their FLOPs over the whole step "
                 "time. The profiled step's kernel time (GPU 0) split by the model's named "
                 "scopes; collectives running beside computation make the kernel time exceed the "
                 "span.\n")
    for label, run in labelled:
      parts.append(f"Run {label} (`--config={run['config']}`; medians of the metrics rows after "
                   f"the first {run['skip_rows']}):\n\n" + pretrain_table(run) + "\n")
      curves = pretrain_curves(run)
      if curves:
        parts.append(f"Held-out loss in run {label}'s runs evaluated more often (the last 5% of "
                     "the corpus, never trained on):\n\n" + curves + "\n")
  return "\n".join(parts)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--results", default=RESULTS, help="folder of results files")
  parser.add_argument("--out", default=os.path.join(ROOT, "BENCHMARKS.md"))
  parser.add_argument("--readme", action="store_true", help="print the README's table instead")
  args = parser.parse_args(argv)
  if not os.path.isdir(args.results):
    parser.error(f"--results={args.results} is not a folder")
  found = load(args.results)
  if args.readme:
    print(readme_table(found["layer"]))
    return
  with open(args.out, "w") as f:
    f.write(benchmarks_md(found))
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
