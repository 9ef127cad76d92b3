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
  out = _run(tmp_path, 120)
  with open(tmp_path / "metrics.csv") as f:
    rows = list(csv.DictReader(f))
  assert [int(r["step"]) for r in rows] == [60, 120]
  last = rows[-1]
  unigram = float(last["unigram_entropy"])
  # Clearly below what a context-free (unigram) model achieves on the held-out bytes.
  assert float(last["heldout_loss"]) < unigram - 0.4, (last, out)
  assert float(last["tokens_per_s"]) > 0 and float(last["expert_load_max_over_mean"]) >= 1
  assert (tmp_path / "loss.png").stat().st_size > 0
  out2 = _run(tmp_path, 180)  # resumes from the step-120 checkpoint
  assert "resumed from step 120" in out2
  with open(tmp_path / "metrics.csv") as f:
    assert [int(r["step"]) for r in csv.DictReader(f)] == [60, 120, 180]


def test_token_rounding_training_runs(tmp_path):
  _run(tmp_path, 60, "--token_rounding=nearest", "--plot=false")
  with open(tmp_path / "metrics.csv") as f:
    (row,) = list(csv.DictReader(f))
  assert float(row["heldout_loss"]) < float(row["unigram_entropy"])
