r"""The pretraining example's throughput in several configurations, run one after another on the same
devices: tokens/s per device, MFU, the MoE layers' TFLOP/s per device, the held-out loss (and its
curve where a run evaluates more often), the model and optimizer state per device, and a profiled
step split into MoE, attention, other layers, collectives and optimizer
(`examples/pretrain/step_profile.py`).

  python -m benchmarks.pretrain_bench --config=olmoe_1b_7b --steps=30 \
      --baseline="tokamax ragged_dot" --run="ep4=--expert_parallel=4 --remat=none" \
      --run="ep2 fsdp=--expert_parallel=2 --fsdp" \
      --run="tokamax ragged_dot=--moe_impl=tokamax_ragged_dot --expert_parallel=1 --fsdp \
             --bias_update_rate=0" --common="--warmup=10 [--corpus_dir=DIR]" [--out=DIR]
  python -m benchmarks.pretrain_bench --config=olmoe_1b_7b --steps=300 --log_every=10 \
      --run="ep4 curve=--expert_parallel=4 --eval_every=25 --profile_step=0" \
      --append=DIR/<earlier results file>
  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m benchmarks.pretrain_bench \
      --config=tiny --common="--backend=xla --warmup=2" --steps=8 --log_every=2 \
      --run="ep2=--expert_parallel=2"

A run's --steps must exceed its warm-up (the preset's --warmup, 50 for olmoe_1b_7b, unless
--common or the run sets one).

Each --run is NAME=FLAGS of `examples/pretrain/train.py`, run as its own process (a fresh
workdir, no checkpoints, TensorBoard or plot, one evaluation at the end, one data cache for all
runs, a later --data_cache in --common wins) with --common and the shared --config, --steps and
--log_every (a run's own flags override them; its own --steps also moves its one evaluation and
its profiled step to its last step). A run's figures are the medians over its metrics
rows after the first `--skip_rows` (the example's rows time whole windows of steps after the
first, compiling, step; the row that covers the profiled step times the steps after it). A run
that fails is recorded with its error, and the others still run (the exit status is 1 when every
run failed). --append adds the runs to an
earlier results file of the same devices, preset and versions (another call on the same machine
kind), which keeps its name and record; a --baseline given then re-bases every run.
This process never touches a device: the runs get the whole of each. Writes
<device>x<N>_<date>_pretrain.json for benchmarks/results/; `benchmarks/pretrain_gpu.sh` runs it on
a GPU machine with a larger corpus.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import types

from absl import app, flags

from benchmarks import grid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain", "train.py")
FIGURES = ("tokens_per_s_per_device", "mfu", "moe_tflops")
# The runs import sonic_jax from this checkout, installed or not (`python -m` puts the working
# folder on this process's path only, not on a child script's).
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    [ROOT] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: benchmarks.report imports `table`
  flags.DEFINE_string("config", "tiny", "the example's preset, shared by every run")
  flags.DEFINE_integer("steps", 30, "training steps of each run")
  flags.DEFINE_integer("log_every", 5, "steps between metrics rows")
  flags.DEFINE_integer("skip_rows", 1, "leading metrics rows left out of the medians")
  flags.DEFINE_integer("profile_step", None, "the step each run profiles (default: the last "
                       "step; 0: none)")
  flags.DEFINE_multi_string("run", None, "NAME=FLAGS of one run (repeatable)")
  flags.DEFINE_string("common", "", "flags of every run")
  flags.DEFINE_string("baseline", None, "the run the others' tokens/s are divided by")
  flags.DEFINE_integer("timeout", 1500, "seconds a run may take")
  flags.DEFINE_string("out", "bench_out", "output folder")
  flags.DEFINE_string("append", None, "an earlier results file of these devices, preset and "
                      "versions: its runs and record are kept, these runs added, and the file "
                      "written to --out under its own name (--common is not compared)")


def parse_run(spec: str) -> tuple[str, list[str]]:
  name, sep, rest = spec.partition("=")
  if not sep or not name.strip():
    raise app.UsageError(f"--run must be NAME=FLAGS, got {spec!r}")
  return name.strip(), shlex.split(rest)


def summarize(rows: list[dict], skip: int) -> dict:
  """Medians of the figures over the metrics rows after the first `skip` (fewer skipped where
  fewer rows exist), rows whose rate is not finite left out; the held-out losses by step."""
  kept = rows[min(skip, max(len(rows) - 1, 0)):]
  out = {}
  for k in FIGURES:
    values = [float(r[k]) for r in kept if r.get(k) not in (None, "", "nan")]
    values = [v for v in values if v == v]
    out[k] = statistics.median(values) if values else None
  held = [[int(r["step"]), float(r["heldout_loss"])] for r in rows if r.get("heldout_loss")]
  out["heldout_loss"] = held[-1][1] if held else None
  out["heldout_curve"] = held
  out["steps"] = int(rows[-1]["step"]) if rows else 0
  out["rows"] = len(rows)
  return out


def error_line(stderr: str) -> str | None:
  """The exception of a failed run's stderr: its last line naming an error or absl's flags
  parsing error (jax appends a note on filtered frames after it), else its last line."""
  lines = [l.strip() for l in stderr.strip().splitlines() if l.strip()]
  named = [l for l in lines if re.match(r"^[\w.]*(Error|Exception)\b", l)
           or "Flags parsing error" in l]
  return (named or lines or [None])[-1]


def shown_flags(flags: str) -> str:
  """A run's flags as its table shows them: the data cache left out, the corpus folder by its
  last two parts."""
  out = []
  for flag in shlex.split(flags):
    name, _, value = flag.partition("=")
    if name == "--data_cache":
      continue
    if name == "--corpus_dir":
      flag = f"{name}=.../{'/'.join(value.rstrip('/').split('/')[-2:])}"
    out.append(flag)
  return shlex.join(out)


def state_mb_per_device(stdout: str) -> float | None:
  found = re.search(r"parameters and optimizer state: ([\d.]+) of", stdout)
  return float(found.group(1)) if found else None


def peak_gib_per_device(stdout: str) -> float | None:
  """train.py's peak device memory (GPU runs print it; None where it is absent)."""
  found = re.search(r"peak device memory: ([\d.]+) GiB", stdout)
  return float(found.group(1)) if found else None


def own_steps(extra: list[str]) -> int:
  """The steps of a run: its own --steps where its flags set one, else the shared --steps."""
  steps = [f.partition("=")[2] for f in extra if f.startswith("--steps=")]
  return int(steps[-1]) if steps else FLAGS.steps


def run_one(name, extra, workdir, data_cache):
  steps = own_steps(extra)  # one evaluation and the profile at the run's own last step
  profile = steps if FLAGS.profile_step is None else FLAGS.profile_step
  cmd = [sys.executable, SCRIPT, f"--config={FLAGS.config}", f"--workdir={workdir}",
         f"--steps={steps}", f"--log_every={FLAGS.log_every}",
         f"--eval_every={steps}", "--checkpoint_every=0", "--notensorboard", "--noplot",
         f"--profile_step={profile}", f"--data_cache={data_cache}", *shlex.split(FLAGS.common),
         *extra]
  record = {"name": name, "flags": shlex.join([*shlex.split(FLAGS.common), *extra])}
  print(f"[{name}] {shlex.join(cmd[1:])}", flush=True)
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FLAGS.timeout,
                          env=CHILD_ENV)
  except subprocess.TimeoutExpired:
    return {**record, "error": f"timed out after {FLAGS.timeout} s"}
  if proc.returncode:
    return {**record, "error": error_line(proc.stderr) or f"exit {proc.returncode}"}
  with open(os.path.join(workdir, "metrics.csv")) as f:
    rows = list(csv.DictReader(f))
  record.update(summarize(rows, FLAGS.skip_rows),
                state_mb_per_device=state_mb_per_device(proc.stdout),
                peak_gib_per_device=peak_gib_per_device(proc.stdout))
  split = os.path.join(workdir, "profile_split.json")
  if os.path.exists(split):
    with open(split) as f:
      record["profile"] = json.load(f)
  return record


def _devices():
  """The devices the runs get, asked of a child process (this one keeps off the devices)."""
  probe = ("import jax, json; d = jax.devices(); print(json.dumps([d[0].device_kind, len(d), "
           "d[0].platform]))")
  out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                       env=CHILD_ENV)
  kind, count, platform = json.loads(out.stdout.strip().splitlines()[-1])
  return [types.SimpleNamespace(device_kind=kind, platform=platform)] * count


def table(result: dict) -> str:
  """The runs as a markdown table, the flags every run shares stated once above it."""
  runs = result["runs"]
  flags = {r["name"]: shlex.split(shown_flags(r["flags"])) for r in runs}
  shared = [f for f in next(iter(flags.values()), []) if all(f in v for v in flags.values())]
  own = lambda r: f"`{shlex.join(f for f in flags[r['name']] if f not in shared)}`" if any(
      f not in shared for f in flags[r["name"]]) else "–"
  base = next((r for r in runs if r["name"] == result.get("baseline") and "error" not in r), None)
  # The peak-memory column where a run recorded one (GPU runs of a train.py that prints it).
  peak = any(r.get("peak_gib_per_device") is not None for r in runs)
  columns = ["run", "flags", "steps", "tokens/s per device", "MFU", "MoE TFLOP/s per device",
             f"× {result.get('baseline') or 'baseline'}", "held-out loss", "state MB per device",
             *(["peak GiB per device"] if peak else []),
             "profiled step: MoE / attention / other / collectives / optimizer (% of kernel "
             "time), kernel time / span ms"]
  lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
  fmt = lambda v, f: "–" if v is None else format(v, f)
  for r in runs:
    if "error" in r:
      lines.append(f"| {r['name']} | {own(r)} | | failed: {cell(r['error'])} |"
                   + " |" * (len(columns) - 4))
      continue
    ratio = (r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
             if base and r["tokens_per_s_per_device"] and base["tokens_per_s_per_device"]
             else None)
    prof = r.get("profile")
    split = "–"
    if prof and prof["kernel_sum_ms"]:
      shares = " / ".join(f"{100 * v / prof['kernel_sum_ms']:.0f}" for v in
                          prof["parts_ms"].values())
      split = f"{shares}, {prof['kernel_sum_ms']:.1f} / {prof['span_ms']:.1f}"
    lines.append(
        f"| {r['name']} | {own(r)} | {r.get('steps', '–')} | "
        f"{fmt(r['tokens_per_s_per_device'], ',.0f')} | "
        f"{fmt(r['mfu'], '.3f')} | {fmt(r['moe_tflops'], '.1f')} | {fmt(ratio, '.2f')} | "
        f"{fmt(r['heldout_loss'], '.3f')} | {fmt(r['state_mb_per_device'], ',.0f')} | "
        + (f"{fmt(r.get('peak_gib_per_device'), '.1f')} | " if peak else "") + f"{split} |")
  head = f"Flags of every run: `{shlex.join(shared)}`.\n\n" if shared else ""
  return head + "\n".join(lines)


def cell(text: str, limit: int = 200) -> str:
  """`text` for a markdown table cell: pipes escaped, cut at a word past `limit` characters."""
  if len(text) > limit:
    text = text[:limit].rsplit(" ", 1)[0] + " …"
  return text.replace("|", "\\|")


def curve_table(result: dict) -> str:
  """Held-out loss by step of the runs evaluated at least three times ("" if none was)."""
  runs = [r for r in result["runs"] if len(r.get("heldout_curve") or ()) >= 3]
  if not runs:
    return ""
  steps = sorted({step for r in runs for step, _ in r["heldout_curve"]})
  lines = ["| step | " + " | ".join(f"{r['name']}: held-out loss (nats/token)" for r in runs)
           + " |", "|---|" + "---|" * len(runs)]
  for step in steps:
    cells = [next((f"{loss:.3f}" for s, loss in r["heldout_curve"] if s == step), "–")
             for r in runs]
    lines.append(f"| {step} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(_):
  if not FLAGS.run:
    raise app.UsageError("give at least one --run=NAME=FLAGS")
  runs = [parse_run(spec) for spec in FLAGS.run]
  names = [n for n, _ in runs]
  if len(set(names)) != len(names):
    raise app.UsageError(f"--run names must differ, got {names}")
  if not FLAGS.append and FLAGS.baseline is not None and FLAGS.baseline not in names:
    raise app.UsageError(f"--baseline={FLAGS.baseline!r} is not a run ({names})")
  os.makedirs(FLAGS.out, exist_ok=True)
  out = grid.run_record("pretrain_bench", _devices(), config=FLAGS.config, steps=FLAGS.steps,
                        log_every=FLAGS.log_every, skip_rows=FLAGS.skip_rows,
                        baseline=FLAGS.baseline, runs=[])
  if FLAGS.append:  # the earlier file's record (date, command) stays; this command is added
    with open(FLAGS.append) as f:
      earlier = json.load(f)
    keys = ("device", "devices", "config", "jax", "sonic_jax", "skip_rows")
    differ = [f"{k} {earlier.get(k)!r} here {out[k]!r}" for k in keys if earlier.get(k) != out[k]]
    if differ:
      raise app.UsageError(f"--append: {FLAGS.append} differs: {'; '.join(differ)}")
    clash = sorted({r["name"] for r in earlier["runs"]} & set(names))
    if clash:
      raise app.UsageError(f"--append: {FLAGS.append} already has runs {clash}")
    out = dict(earlier, appended_commands=[*earlier.get("appended_commands", []),
                                           out["command"]])
    out["baseline"] = FLAGS.baseline or earlier["baseline"]  # a new one re-bases every run
  all_names = [r["name"] for r in out["runs"]] + names
  if out["baseline"] is not None and out["baseline"] not in all_names:
    raise app.UsageError(f"--baseline={out['baseline']!r} is not a run ({all_names})")
  path = os.path.join(FLAGS.out, os.path.basename(FLAGS.append) if FLAGS.append
                      else grid.results_name(out, "pretrain"))
  with tempfile.TemporaryDirectory() as data_cache:  # one tokenizer for all runs
    for name, extra in runs:
      with tempfile.TemporaryDirectory() as workdir:
        out["runs"].append(run_one(name, extra, workdir, data_cache))
      with open(path, "w") as f:
        json.dump(out, f, indent=1)
  print(table(out))
  print(curve_table(out))
  print(f"wrote {path}")
  if all("error" in r for r in out["runs"][-len(runs):]):
    sys.exit("every run failed (their errors are in the table)")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
