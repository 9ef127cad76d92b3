"""Turns benchmark results (JSON) into Markdown tables, PNG plots and BENCHMARKS.md."""

from __future__ import annotations

import json
import os
import sys

from benchmarks import grid

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _f(v, fmt="{:.0f}"):
  return "–" if v is None else fmt.format(v)


def _tf(v):
  return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def row_summary(row):
  if "error" in row:
    return f"{row['name']:<22} {row['error']}"
  if "fwdbwd_ms" not in row:
    return (f"{row['name']:<22} fwd {_tf(row['fwd_tflops']):>5} TFLOP/s ({row['fwd_ms']:.3f} ms, "
            f"forward only)  residuals {_f(row.get('residual_bytes', 0) / 2**20, '{:.1f}')} MiB")
  db = row.get("do_bench")
  idle = (f" (idle {db['fwd_idle_ms']:.3f} / {db['fwdbwd_idle_ms']:.3f})"
          if db and db.get("fwd_idle_ms") is not None and db.get("fwdbwd_idle_ms") is not None
          else "")
  db = (f"  do_bench {db['fwd_ms']:.3f} / {db['fwdbwd_ms']:.3f} ms{idle}"
        if db and "fwdbwd_ms" in db else "")
  return (f"{row['name']:<22} fwd {_tf(row['fwd_tflops']):>5}  bwd {_tf(row['bwd_tflops']):>5}  "
          f"fwd+bwd {_tf(row['fwdbwd_tflops']):>5} TFLOP/s  ({row['fwd_ms']:.3f} / {row['fwdbwd_ms']:.3f} ms)"
          f"  residuals {_f(row.get('residual_bytes', 0) / 2**20, '{:.1f}')} MiB" + db)


def _sonic_best(anchor, key):
  vals = [anchor.get(src, {}).get(key) for src in ("sonicmoe_published", "sonicmoe_measured")]
  vals = [v for v in vals if v is not None]
  return max(vals) if vals else None


def results_table(results):
  anchors, _ = grid.load_anchors()
  lines = [
      "| config (T,d,n,E,K) | row | fwd TF/s | bwd TF/s | fwd+bwd TF/s | fwd ms | fwd+bwd ms | "
      "residuals MiB | step temp GiB | fwd / SonicMoE best | bwd / SonicMoE best |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for res in results["configs"]:
    cfg = tuple(res["config"])
    anchor = anchors.get(cfg, {})
    best_fwd, best_bwd = _sonic_best(anchor, "fwd"), _sonic_best(anchor, "bwd")
    for row in res["rows"]:
      if "error" in row:
        lines.append(f"| {','.join(map(str, cfg))} | {row['name']} | {row['error'][:80]} |"
                     + " |" * 8)
        continue
      sonic = row["name"].startswith("sonic_jax")
      ratio = lambda v, b: f"{v / b:.2f}" if (sonic and b and v is not None) else ""
      res_mib = row.get("residual_bytes")
      opt = lambda k, fmt: "–" if row.get(k) is None else fmt(row[k])
      lines.append(
          f"| {','.join(map(str, cfg))} | {row['name']} | {_tf(row['fwd_tflops'])} | "
          f"{opt('bwd_tflops', _tf)} | {opt('fwdbwd_tflops', _tf)} | {row['fwd_ms']:.3f} | "
          f"{opt('fwdbwd_ms', '{:.3f}'.format)} | "
          f"{_f(None if res_mib is None else res_mib / 2**20, '{:.0f}')} | "
          f"{_f(None if row.get('temp_bytes') is None else row['temp_bytes'] / 2**30, '{:.2f}')} | "
          f"{ratio(row['fwd_tflops'], best_fwd)} | {ratio(row.get('bwd_tflops'), best_bwd)} |")
  return "\n".join(lines)


def do_bench_table(results):
  """The rows that a run also timed as SonicMoE's anchors were timed (`moe_bench --do_bench`),
  against SonicMoE's best and against its measured figure (the same method); "" if none."""
  anchors, _ = grid.load_anchors()
  lines = ["| config (T,d,n,E,K) | row | fwd TF/s | bwd TF/s | fwd ms | fwd+bwd ms | calls timed "
           "fwd / fwd+bwd | fwd / SonicMoE best | bwd / SonicMoE best | fwd / SonicMoE measured | "
           "bwd / SonicMoE measured |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for res in results["configs"]:
    cfg = tuple(res["config"])
    anchor = anchors.get(cfg, {})
    measured = anchor.get("sonicmoe_measured", {})
    for row in res["rows"]:
      db = row.get("do_bench")
      if not db:
        continue
      ratio = lambda v, b: f"{v / b:.2f}" if (b and v is not None) else ""
      bwd = db.get("bwd_tflops")
      lines.append(
          f"| {','.join(map(str, cfg))} | {row['name']} | {_tf(db['fwd_tflops'])} | "
          f"{'–' if bwd is None else _tf(bwd)} | {db['fwd_ms']:.3f} | "
          f"{_f(db.get('fwdbwd_ms'), '{:.3f}')} | {db['fwd_calls']} / {db.get('fwdbwd_calls', '–')} | "
          f"{ratio(db['fwd_tflops'], _sonic_best(anchor, 'fwd'))} | "
          f"{ratio(bwd, _sonic_best(anchor, 'bwd'))} | {ratio(db['fwd_tflops'], measured.get('fwd'))} | "
          f"{ratio(bwd, measured.get('bwd'))} |")
  return "\n".join(lines) if len(lines) > 2 else ""


def anchors_table(results):
  anchors, _ = grid.load_anchors()
  lines = ["| config (T,d,n,E,K) | SonicMoE published fwd/bwd | SonicMoE on an H100 fwd/bwd, "
           "saved GiB | tokamax layer (earlier H100 run) fwd / fwd+bwd | expert load min/mean/max |",
           "|---|---|---|---|---|"]
  for res in results["configs"]:
    cfg = tuple(res["config"])
    a = anchors.get(cfg)
    c = res["expert_counts"]
    load = f"{c['min']}/{c['mean']:.0f}/{c['max']}"
    if a is None:
      lines.append(f"| {','.join(map(str, cfg))} | – | – | – | {load} |")
      continue
    p, m, t = a["sonicmoe_published"], a["sonicmoe_measured"], a["tokamax_moe_measured"]
    lines.append(f"| {','.join(map(str, cfg))} | {p['fwd']}/{p['bwd']} | {m['fwd']:.0f}/{m['bwd']:.0f}, "
                 f"{m['fwd_saved_GiB']:.2f} | {t['fwd']:.0f} / {t['fwdbwd']:.0f} | {load} |")
  return "\n".join(lines)


def kernels_section(results, top=6):
  out = []
  for res in results["configs"]:
    for row in res["rows"]:
      ks = row.get("kernels_fwdbwd_us") or row.get("kernels_fwd_us")
      if not ks:
        continue
      body = "; ".join(f"`{name[:48]}` {us:.0f} µs" for name, us in ks[:top])
      out.append(f"- {res['name']} {row['name']}: {body}")
  return "\n".join(out) if out else "(no device kernels traced on this platform)"


def plot(results, out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np

  anchors, _ = grid.load_anchors()
  configs = results["configs"]
  names = sorted({r["name"] for c in configs for r in c["rows"]})
  labels = [",".join(map(str, c["config"][1:])) for c in configs]
  x = np.arange(len(configs))
  paths = []
  for metric, title in (("fwd_tflops", "forward"), ("fwdbwd_tflops", "forward+backward")):
    fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(configs)), 4.5))
    series = [(n, [next((r.get(metric) for r in c["rows"] if r["name"] == n), None) or 0
                   for c in configs]) for n in names]
    series = [(n, v) for n, v in series if any(v)]
    key = "fwd" if metric == "fwd_tflops" else "fwdbwd"
    pub = [anchors.get(tuple(c["config"]), {}).get("sonicmoe_published", {}).get(key) or 0
           for c in configs]
    if any(pub):
      series.append(("SonicMoE (paper, H100)", pub))
    width = 0.8 / len(series)
    for i, (n, vals) in enumerate(series):
      ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=n)
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_xlabel("d, n, E, K")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"MoE layer {title}, {results['environment']['device']}, "
                 f"{results['environment']['dtype']} {results['environment']['activation']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    p = os.path.join(out_dir, f"tflops_{key}.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

  fig, ax = plt.subplots(figsize=(max(8, 1.4 * len(configs)), 4.5))
  mem_rows = [n for n in names if any(r.get("residual_bytes") for c in configs for r in c["rows"]
                                      if r["name"] == n)]
  series = [(n, [next((r.get("residual_bytes") or 0 for r in c["rows"] if r["name"] == n), 0) / 2**30
                 for c in configs]) for n in mem_rows]
  meas = [anchors.get(tuple(c["config"]), {}).get("sonicmoe_measured", {}).get("fwd_saved_GiB") or 0
          for c in configs]
  if any(meas):
    series.append(("SonicMoE (measured, H100)", meas))
  width = 0.8 / max(1, len(series))
  for i, (n, vals) in enumerate(series):
    ax.bar(x + (i - (len(series) - 1) / 2) * width, vals, width, label=n)
  ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
  ax.set_ylabel("GiB kept for backward (excluding inputs)")
  ax.set_title("Activation memory per layer")
  ax.legend(fontsize=8)
  fig.tight_layout()
  p = os.path.join(out_dir, "activation_memory.png")
  fig.savefig(p, dpi=110)
  plt.close(fig)
  paths.append(p)
  return paths


def markdown(results):
  db = do_bench_table(results)
  db = f"\n\nTimed as SonicMoE's anchors were (do_bench style):\n\n{db}" if db else ""
  return (results_table(results) + db + "\n\nReference figures for the same configurations "
          "(`benchmarks/data/sonicmoe_h100.json`):\n\n" + anchors_table(results) + "\n")


def write_all(results, out_dir, benchmarks_md=False):
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(markdown(results))
  pngs = plot(results, out_dir)
  if benchmarks_md:
    write_benchmarks_md(results, out_dir, pngs)


def merge(runs):
  """One results dict from several runs: per configuration, a later run's row replaces an earlier
  run's row of the same name. The merged 'environment' is the first run's; 'runs' lists all."""
  merged = {"environment": dict(runs[0]["environment"]), "runs": [r["environment"] for r in runs],
            "configs": []}
  by_cfg = {}
  for run in runs:
    for res in run["configs"]:
      key = tuple(res["config"])
      if key not in by_cfg:
        by_cfg[key] = {**res, "rows": []}
        merged["configs"].append(by_cfg[key])
      rows = by_cfg[key]["rows"]
      for row in res["rows"]:
        rows[:] = [r for r in rows if r["name"] != row["name"]] + [row]
  return merged


def kernels_table(kernels):
  """Per-kernel tables (forward, then backward) from benchmarks/kernel_bench.py's kernels.json."""
  all_names = list(kernels["configs"][0]["kernels"])
  parts = []
  for title, names, total in (
      ("Forward", [n for n in all_names if not n.startswith("bwd")], "forward_sum_tflops"),
      ("Backward", [n[4:] for n in all_names if n.startswith("bwd")], "backward_sum_tflops")):
    prefix = "" if title == "Forward" else "bwd "
    total_name = ("forward (sum) TF/s" if title == "Forward"
                  else "backward (sum) TF/s, row gathers")
    lines = [f"{title}:", "", "| config (T,d,n,E,K) | " + " | ".join(names) + f" | {total_name} |",
             "|---|" + "---|" * (len(names) + 1)]
    for res in kernels["configs"]:
      cells = []
      for n in names:
        k = res["kernels"].get(prefix + n)
        if k is None:
          cells.append("–")
          continue
        rate = f"{k['tflops']:.0f} TF/s" if k["tflops"] else f"{k['gbps']:.0f} GB/s"
        cells.append(f"{k['ms']:.3f} ({k['roofline_ms']:.3f}) {rate}")
      gathers = ""
      if title == "Backward":
        g = res["backward_gathers"]  # {"x": ..., "d_out": ...}; one word in older results
        gathers = ", " + (g if isinstance(g, str) else f"x {g['x']}, dO {g['d_out']}")
      lines.append(f"| {','.join(map(str, res['config']))} | " + " | ".join(cells)
                   + f" | {res[total]:.0f}{gathers} |")
    parts.append("\n".join(lines))
  costs = [r for r in kernels["configs"] if isinstance(r.get("gather_cost"), dict)]
  if costs:
    roles = list(costs[0]["gather_cost"])
    lines = ["Fused row gather: time of each kernel with its gather over the same kernel on "
             "pre-gathered contiguous rows, minus one:", "",
             "| config (T,d,n,E,K) | " + " | ".join(roles) + " |", "|---|" + "---|" * len(roles)]
    for r in costs:
      lines.append(f"| {','.join(map(str, r['config']))} | "
                   + " | ".join(f"{100 * r['gather_cost'][role]:+.1f}%" for role in roles) + " |")
    parts.append("\n".join(lines))
  return "\n\n".join(parts)


def pretrain_table(folder):
  """Held-out loss and tokens/s per run from the example pretraining script's metrics CSVs."""
  import csv
  import glob
  lines = ["| run (metrics CSV) | steps | tokens/s | held-out loss (nats/byte) by step |",
           "|---|---|---|---|"]
  for path in sorted(glob.glob(os.path.join(folder, "*.csv"))):
    with open(path) as f:
      rows = list(csv.DictReader(f))
    if not rows:
      continue
    rates = [float(r["tokens_per_s"]) for r in rows]
    losses = ", ".join(f"{r['step']}: {float(r['heldout_loss']):.3f}" for r in rows)
    lines.append(f"| `{os.path.basename(path)}` | {rows[-1]['step']} | "
                 f"{min(rates) / 1e3:.1f}k–{max(rates) / 1e3:.1f}k | {losses} |")
  return "\n".join(lines)


def expert_parallel_section(ep, transports=None):
  """The expert-parallel section from an ep_bench ep.json (and a2a_transport.jsonl lines)."""
  from benchmarks.ep_bench import table as ep_table
  r0 = ep["results"][0]
  text = f"""
## Expert parallelism

`python -m benchmarks.ep_bench` on {r0['devices']} × {r0['device_kind']}, jax {ep['jax']}, backend
`{ep['backend']}`, bf16, SwiGLU. Each configuration is the work of one device: T_local tokens per device
(P·T_local in all), E experts over the P devices. "single" is `sonic_jax.moe` on one GPU with T_local
tokens and all E experts (the same pairs per device, no communication). TFLOP/s per device with the paper's
counts; "collectives" are the exchanges (or all-gather / reduce-scatter) alone at the layer's sizes, with
the bandwidth of the bytes each device sends or receives over the links; "comm share" is four exchanges
(dispatch, combine, and both again in the backward) or two all-gathers + reduce-scatters over the step.
Before timing, every dropless scheme's output and gradients matched the single-GPU op at float32 (max
relative error {max(ep['check_max_rel_err'].values()):.1e}), the ragged transport through the native
`ragged_all_to_all`. The extrapolation keeps the measured single-GPU compute and bandwidth, 8 GPUs per
node, and {ep['inter_node_gbps_assumed']:.0f} GB/s per GPU across nodes (an assumption, not a
measurement); communication is not overlapped with compute.

{ep_table(ep['results'], ep['inter_node_gbps_assumed'])}
"""
  if transports:
    rows = "\n".join(
        f"| {t['label']} | `{t['xla_flags'] or '(none)'}` | "
        + (f"{t['ragged_ms']:.2f} ms ({t['ragged_gbps']:.1f} GB/s)" if "ragged_ms" in t
           else "failed: " + t.get("ragged_error", "")[:80].replace("|", "/"))
        + f" | {t['dense_ms']:.3f} ms ({t['dense_gbps']:.0f} GB/s) |" for t in transports)
    t0 = transports[0]
    text += f"""
The transports alone (`bash benchmarks/a2a_transport.sh --rows={t0['rows']} --d={t0['d']}`: every device sends
{t0['rows']} bf16 rows of width {t0['d']} split over the devices), under the XLA:GPU flags that select the
ragged-all-to-all implementation:

| setting | XLA_FLAGS | ragged_all_to_all | dense all_to_all, same bytes |
|---|---|---|---|
{rows}
"""
  return text


def router_backward_section(rb):
  """BENCHMARKS.md section of a `benchmarks.router_backward` run."""
  rows = ["| config (T,d,n,E,K) | 16-bit backward µs | float32 backward (autodiff) µs | saved µs "
          "| rel. err. dx / dw, 16-bit | rel. err. dx / dw, float32 |", "|---|---|---|---|---|---|"]
  for c in rb["configs"]:
    new, old = c["16-bit backward"], c["float32 backward (autodiff)"]
    rows.append(f"| {','.join(map(str, c['config']))} | {new['us']:.0f} | {old['us']:.0f} | "
                f"{old['us'] - new['us']:.0f} | {new['rel_err_dx']:.1e} / {new['rel_err_dw']:.1e} | "
                f"{old['rel_err_dx']:.1e} / {old['rel_err_dw']:.1e} |")
  table = "\n".join(rows)
  return f"""
## Router GEMM: forward and backward

`{rb['command']}` on {rb['device']}, jax {rb['jax']}, {rb['date']}: the router GEMM's forward and backward
(logits = x @ router_weight with bfloat16 x and weight, float32 logits) as `sonic_jax.router_logits`
runs it (the backward GEMMs take the logits' gradient in bfloat16, float32 accumulation) against
plain autodiff of the float32-result dot (its backward GEMMs run on float32 copies of x and the
weight); median µs per call, interleaved rounds; the gradients' error against float64.

{table}
"""


def merge_kernel_runs(runs):
  """kernel_bench runs (a grid split over device calls) -> one record: their configurations in
  order, and `ceilings`, how each run's measured GEMM rate and copy bandwidth read."""
  first = runs[0]
  for r in runs[1:]:
    if (r["device"], r["jax"], r["gate_up_layout"]) != (first["device"], first["jax"],
                                                        first["gate_up_layout"]):
      raise ValueError("kernel_bench runs of different devices, jax versions or layouts")
  rate = lambda r: f"{r['dense_bf16_tflops']:.0f} TFLOP/s and {r['copy_gbps']:.0f} GB/s"
  if len(runs) == 1:
    ceilings = rate(first)
  else:
    ds = lambda r: ", ".join(str(d) for d in sorted({c["config"][1] for c in r["configs"]}))
    ceilings = "; ".join(f"{rate(r)} in the run of the d = {ds(r)} rows" for r in runs)
  return {**first, "configs": [c for r in runs for c in r["configs"]], "ceilings": ceilings}


def write_benchmarks_md(results, out_dir, pngs, kernels=None, notes="", token_rounding=None,
                        command=None, pretrain=None, expert_parallel="", router_backward=""):
  import shutil
  fig_dir = os.path.join(_ROOT, "benchmarks", "figures")
  os.makedirs(fig_dir, exist_ok=True)
  rel = []
  for p in pngs:
    shutil.copy(p, os.path.join(fig_dir, os.path.basename(p)))
    rel.append(f"benchmarks/figures/{os.path.basename(p)}")
  _, sources = grid.load_anchors()
  runs = results.get("runs", [results["environment"]])
  run_lines = "\n".join(
      f"- {r['device']} ({r['platform']}), jax {r['jax']}, sonic_jax {r['sonic_jax']}, Python "
      f"{r['python']}, {r['date']}, router weights {r.get('router_dtype', 'float32')}: "
      f"`{r['command']}`" for r in runs)
  env = results["environment"]
  kernel_part = ""
  if kernels is not None:
    kernel_part = f"""
## Kernels, one at a time

`python -m benchmarks.kernel_bench` on {kernels['device']}, jax {kernels['jax']}: measured ceilings
(8192³ bf16 GEMM; device copy, bytes read + written; each run measures its own and each kernel's
roofline uses its run's) {kernels['ceilings']}. Each cell: median ms (roofline ms = max(FLOPs / GEMM rate, bytes / copy rate)) and the
achieved rate. "forward (sum)" adds the kernels the `mosaic_gpu` backend runs: route+layout, the
up-projection with its fused gather of x, down-projection, aggregation ("aggregate (backend)": the
forward's weighted gather-sum as the backend runs it, the Mosaic GPU kernel at K = 16, d = 4096 and XLA's
elsewhere; runs without that column summed XLA's); "backward (sum)" the four
backward GEMM kernels as the backend ran them in that run (its `gather_source`, named in the last
column: "x fused" / "dO fused": the rows gathered inside the kernels; "dO dh": dH gathered the dO
rows and stored them, dw2 read them contiguous), and dX rows; without the gather-sums. The
"contiguous input" kernels are the
same kernels on rows gathered beforehand (the XLA gather that this needs is timed in the forward table).

{kernels_table(kernels)}
"""
  tr_part = ""
  if token_rounding is not None:
    from benchmarks.token_rounding_bench import table as tr_table
    tr_part = f"""
## Token rounding against top-K

`python -m benchmarks.token_rounding_bench` on {token_rounding['device']}, jax {token_rounding['jax']},
backend `{token_rounding['backend']}` (row tile 128). "padding rows": rows of the grouped GEMMs that hold no
(token, expert) pair, as a fraction of the pairs; "expert GEMMs": up-projection (with the row gather as the backend
runs it, inside the kernel on `mosaic_gpu`, and the activation epilogue) plus down-projection on the routing's
layout, the paper's "kernel execution time"; "route+layout": router, top-K or rounding, grouped layout;
TFLOP/s count the pairs actually computed. Configurations not listed were not reached in the run's time limit.

{tr_table(token_rounding)}
"""
  if pretrain is not None:
    tr_part += f"""
## Training end to end: the example pretraining script

`bash benchmarks/pretrain_compare.sh` (runs of `examples/pretrain/train.py --config=h100`: d=1024, 8 layers,
64 experts of width 256, K=8, 32 × 1024 byte tokens per step, bf16; same initialisation and data order),
CSVs in `{os.path.relpath(pretrain, _ROOT)}`; details in `examples/pretrain/README.md`. The 400-step runs use
the preset's schedule (warm-up 200), the `*_100steps` pair `--steps=100 --warmup=20 --eval_every=50`.

{pretrain_table(pretrain)}
"""
  do_bench_part = do_bench_table(results)
  if do_bench_part:
    do_bench_part = f"""
### Timed as SonicMoE's anchors were

The rows of runs with `--do_bench`, timed again as `../shared/bench/sonic_ref.py` timed SonicMoE
for its measured anchors (`timing.time_do_bench`, triton's `do_bench(warmup=5, rep=200)`: the
forward, then the forward+backward, each right after compiling, in a 200 ms burst of calls with an
L2 flush before each, every call's device span from a profiler trace, the median; backward =
forward+backward − forward). With the `--data=sonicmoe` inputs this is the anchor's method and
data on an H100 of the same kind (not the same one). The main table above is a sustained load, in
which the H100's power cap lowers its clocks: a burst's first calls run 8–10% faster than its
median, the sustained samples' median slower again.

{do_bench_part}
"""
  command = command or "python -m benchmarks.report ..."
  text = f"""# Benchmarks

Generated by `benchmarks/report.py` from the JSON files in `benchmarks/results/`; do not edit by hand:

    {command}

Runs (a later run's row replaces an earlier run's row of the same name):

{run_lines}
{notes}
- Problem: {env['dtype']}, {env['activation']}, routing `{env['routing']}`, router weights in the dtype each run line gives; inputs as each run line's `--data` says: `sonicmoe`, SonicMoE's benchmark scales (x and dO ~ 0.2·N(0, 1), every weight, the router's too, of std 0.02, as `../shared/bench/sonic_ref.py`); without it, unit scale (x and dO ~ N(0, 1), weights of std 1/√fan-in).
- Method: compile excluded (reported in the JSON); warm-up; median of repeated samples, each a batch of
  back-to-back calls ended by one device synchronisation, rotating input sets; the forward and the
  forward+backward sampled in alternating rounds (runs from the tenth session on; earlier ones timed them one
  after the other, which let the clocks' drift of a few percent into the difference); backward = (forward+backward) −
  forward, where the forward+backward step returns the layer's output with the gradients (as a training step
  uses it: an unused output would let XLA drop the down-projection and aggregation from the step);
  TFLOP/s with the paper's counts (forward 6·T·K·d·n for GLU, backward twice that).
  "residuals" are the bytes that autodiff keeps from the forward for the backward, not counting the layer's
  own inputs (x, weights); "step temp" is XLA's temporary memory for the forward+backward program.
- `sonic_jax[mosaic_gpu]`: Hopper kernels for all six GEMM roles (up, down, dH, dw1, dw2, dX); the rows of
  x gathered inside the up-projection and dw1, those of dO inside dH and dw2 (from the nineteenth
  session's rows on at every width, dw2 with the gathered dO on the wgmma's M side; before, only for
  experts of width n ≤ 512, for wider ones dH stored the rows it gathered for dw2); the router's
  top-K as a Pallas kernel (from
  the seventeenth session's rows on, for E ≤ 128 one kernel for the router GEMM and the top-K), and
  for E ≤ 128 the routing metadata's per-block counts and ranks (a counting sort, from the fifteenth
  session's rows on; a radix sort before and at E = 256); the rest of the routing metadata and the
  aggregations (gather-sums) are XLA operations, but the forward's at K = 16, d = 4096 (a Mosaic
  GPU gather-sum kernel, from the twenty-third session's rows on; the router's top-K picks on packed
  keys from those rows on too) (the router GEMM's backward on bfloat16 operands
  from the fourteenth session's rows on); each kernel's tile configuration from the tuning table of
  its session (from the sixteenth session's rows on, dH at 24576,1536,256,128,8 and
  24576,1536,512,64,4 under a pingpong schedule with the concat layout).
- `sonic_jax[xla]` is the pure-JAX reference path (a scan over row tiles): a correctness path, not a GPU path.
- The uniform upper bound has no router, gather or aggregation: batched GEMMs with T·K/E rows per expert.

{results_table(results)}
{do_bench_part}
Reference figures (`benchmarks/data/sonicmoe_h100.json`; {sources['sonicmoe_published'][:60]}…;
SonicMoE on an H100: {sources['sonicmoe_measured'][:80]}…):

{anchors_table(results)}

""" + "\n".join(f"![{os.path.basename(r)}]({r})" for r in rel) + kernel_part + tr_part \
      + router_backward + expert_parallel + f"""

## Slowest kernels per configuration (µs per step)

{kernels_section(results)}
"""
  with open(os.path.join(_ROOT, "BENCHMARKS.md"), "w") as f:
    f.write(text)


def main(argv):
  import argparse
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("results", nargs="+", help="results.json files of benchmarks.moe_bench runs")
  ap.add_argument("--kernels", action="append",
                  help="kernels.json of a benchmarks.kernel_bench run (repeatable: a grid split "
                       "over several runs)")
  ap.add_argument("--out", required=True, help="folder for results.md and the plots")
  ap.add_argument("--benchmarks_md", action="store_true", help="regenerate BENCHMARKS.md")
  ap.add_argument("--notes", default="", help="extra Markdown lines for BENCHMARKS.md")
  ap.add_argument("--token_rounding", help="token_rounding.json of a token_rounding_bench run")
  ap.add_argument("--pretrain", help="folder of the pretraining script's metrics CSVs")
  ap.add_argument("--ep", help="ep.json of a benchmarks.ep_bench run")
  ap.add_argument("--a2a_transport", help="a2a_transport.jsonl of benchmarks/a2a_transport.sh")
  ap.add_argument("--router_backward", help="router_backward.json of benchmarks.router_backward")
  args = ap.parse_args(argv)
  runs = []
  for path in args.results:
    with open(path) as f:
      runs.append(json.load(f))
  results = merge(runs) if len(runs) > 1 else runs[0]
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "results.md"), "w") as f:
    f.write(markdown(results))
  pngs = plot(results, args.out)
  if args.benchmarks_md:
    def load_json(path):
      if not path:
        return None
      with open(path) as f:
        return json.load(f)

    token_rounding, ep, rb = map(load_json, (args.token_rounding, args.ep, args.router_backward))
    kernels = merge_kernel_runs([load_json(p) for p in args.kernels]) if args.kernels else None
    shown = [("'…'" if i and argv[i - 1] == "--notes" else a) for i, a in enumerate(argv)]
    command = "python -m benchmarks.report " + " ".join(shown)
    expert_parallel = ""
    if ep is not None:
      transports = None
      if args.a2a_transport:
        with open(args.a2a_transport) as f:
          transports = [json.loads(line) for line in f if line.strip()]
      expert_parallel = expert_parallel_section(ep, transports)
    write_benchmarks_md(results, args.out, pngs, kernels, args.notes, token_rounding, command,
                        args.pretrain and os.path.abspath(args.pretrain), expert_parallel,
                        router_backward_section(rb) if rb is not None else "")


if __name__ == "__main__":
  main(sys.argv[1:])
