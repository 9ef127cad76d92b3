"""The example pretraining script: the tiny configuration learns the corpus on a CPU, and resumes."""

import csv
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain", "train.py")


def _run(workdir, steps, *extra):
  cmd = [sys.executable, SCRIPT, "--config=tiny", f"--workdir={workdir}", f"--steps={steps}",
         "--eval_every=60", "--backend=xla", *extra]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_tiny_config_learns_and_resumes(tmp_path):
  _run(tmp_path, 60)
  out = _run(tmp_path, 120)  # resumes from the step-60 checkpoint
  assert "resumed from step 60" in out
  with open(tmp_path / "metrics.csv") as f:
    rows = list(csv.DictReader(f))
  assert [int(r["step"]) for r in rows] == [60, 120]
  last = rows[-1]
  unigram = float(last["unigram_entropy"])
  # Clearly below what a context-free (unigram) model achieves on the held-out bytes.
  assert float(last["heldout_loss"]) < unigram - 0.4, (last, out)
  assert float(last["tokens_per_s"]) > 0 and float(last["expert_load_max_over_mean"]) >= 1
  assert (tmp_path / "loss.png").stat().st_size > 0


def test_token_rounding_training_runs(tmp_path):
  _run(tmp_path, 60, "--token_rounding=nearest", "--plot=false")
  with open(tmp_path / "metrics.csv") as f:
    (row,) = list(csv.DictReader(f))
  assert float(row["heldout_loss"]) < float(row["unigram_entropy"])


def test_expert_parallel_training_tracks_one_device(tmp_path):
  """--expert_parallel=2 on 4 CPU devices ((data 2, ep 2) mesh, the layers' own shard_map) follows
  the one-device run: same data and init; the load-balance loss is per data shard, so close, not
  bitwise."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  losses = {}
  for name, extra in (("one", []), ("ep", ["--expert_parallel=2"])):
    cmd = [sys.executable, SCRIPT, "--config=tiny", f"--workdir={tmp_path / name}", "--steps=40",
           "--eval_every=40", "--backend=xla", "--plot=false", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / name / "metrics.csv") as f:
      (row,) = list(csv.DictReader(f))
    losses[name] = (float(row["train_loss"]), float(row["heldout_loss"]))
  assert "mesh {'data': 2, 'ep': 2}" in proc.stdout
  for a, b in zip(losses["one"], losses["ep"]):
    assert abs(a - b) < 0.02, losses
