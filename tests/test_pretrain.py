"""The example pretraining script: the tiny configuration learns the corpus on a CPU and resumes;
SIGTERM checkpoints and exits, a resumed run never repeats a metrics row; sample.py generates from
a checkpoint."""

import csv
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain", "train.py")
SAMPLE = os.path.join(ROOT, "examples", "pretrain", "sample.py")


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
  assert float(last["grad_norm"]) > 0 and 0 < float(last["lr"]) <= 3e-3
  assert float(last["aux_loss"]) > 0 and float(last["dropped_pairs"]) == 0
  assert (tmp_path / "loss.png").stat().st_size > 0
  # The run's configuration beside the checkpoints and inside each, as separate items.
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model"]["num_experts"] == 8 and config["steps"] == 120
  assert {"config", "model", "optimizer"} <= set(os.listdir(tmp_path / "ckpt" / "120"))
  events = os.listdir(tmp_path / "tb")
  assert events and all(e.startswith("events.out.tfevents") for e in events)
  # sample.py: the model alone from the latest checkpoint, its config from inside it.
  proc = subprocess.run([sys.executable, SAMPLE, f"--workdir={tmp_path}", "--prompt=import ",
                         "--tokens=20", "--temperature=0"], capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith("[step 120] import ") and len(proc.stdout) > 30, proc.stdout


def test_sigterm_checkpoints_and_a_resume_repeats_no_row(tmp_path):
  """SIGTERM mid-run: the finished step is logged and checkpointed and the process exits 0; the
  resumed run drops rows past the checkpoint (here a row written after it, as after a crash) and
  continues, one row per logged step. The model's shape comes from flags; its blocks are stacked,
  scanned and rematerialised."""
  cmd = [sys.executable, SCRIPT, "--config=tiny", f"--workdir={tmp_path}", "--steps=2000",
         "--log_every=5", "--eval_every=1000", "--checkpoint_every=1000", "--backend=xla",
         "--num_layers=2", "--d_model=64", "--warmup=5", "--remat=dots", "--scan_layers",
         "--plot=false", "--tensorboard=false"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("step 10:"):
      proc.send_signal(signal.SIGTERM)
      break
  out = "".join(lines) + proc.stdout.read()
  assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
  assert "num_layers=2" in out and "d_model=64" in out and "scan_layers=True" in out
  (stopped,) = [int(l.split()[-2].rstrip(";")) for l in out.splitlines() if "SIGTERM" in l]
  assert stopped >= 10 and os.path.isdir(tmp_path / "ckpt" / str(stopped))
  with open(tmp_path / "metrics.csv") as f:
    rows = list(csv.DictReader(f))
  assert int(rows[-1]["step"]) == stopped
  with open(tmp_path / "metrics.csv", "a") as f:  # a row the crashed run wrote after its checkpoint
    f.write(f"{stopped + 3}" + ",1" * 13 + "\n")
  cmd[4] = f"--steps={stopped + 10}"
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert f"resumed from step {stopped}" in proc.stdout
  with open(tmp_path / "metrics.csv") as f:
    steps = [int(r["step"]) for r in csv.DictReader(f)]
  assert steps == sorted(set(steps)) and stopped + 3 not in steps and steps[-1] == stopped + 10


def test_token_rounding_training_runs(tmp_path):
  _run(tmp_path, 60, "--token_rounding=nearest", "--plot=false")
  with open(tmp_path / "metrics.csv") as f:
    (row,) = list(csv.DictReader(f))
  assert float(row["heldout_loss"]) < float(row["unigram_entropy"])


def test_expert_parallel_training_tracks_one_device(tmp_path):
  """--expert_parallel=2 on 4 CPU devices ((data 2, ep 2) mesh, the layers' own shard_map) follows
  the one-device run: same data and init; the load-balance loss is per data shard, so close, not
  bitwise. So does it with FSDP (parameters and optimizer state also sharded over data: half the
  bytes per device) and two accumulated micro-batches, and so does the same model on one device
  with the ragged_dot baseline MoE layer (same initialisation and math)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
  losses, outs = {}, {}
  for name, extra in (("one", []), ("ep", ["--expert_parallel=2"]),
                      ("fsdp", ["--expert_parallel=2", "--fsdp", "--grad_accum=2"]),
                      ("ragged_dot", ["--moe_impl=ragged_dot"])):
    cmd = [sys.executable, SCRIPT, "--config=tiny", f"--workdir={tmp_path / name}", "--steps=40",
           "--eval_every=40", "--backend=xla", "--plot=false", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / name / "metrics.csv") as f:
      (row,) = list(csv.DictReader(f))
    losses[name] = (float(row["train_loss"]), float(row["heldout_loss"]))
    outs[name] = proc.stdout
  assert "mesh {'data': 2, 'ep': 2}" in outs["ep"]
  for name in ("ep", "fsdp", "ragged_dot"):
    for a, b in zip(losses["one"], losses[name]):
      assert abs(a - b) < 0.02, losses
  per_device = {n: float(outs[n].split("parameters and optimizer state: ")[1].split()[0])
                for n in ("ep", "fsdp")}
  assert per_device["fsdp"] < 0.6 * per_device["ep"], per_device


def test_ragged_dot_baseline_layer_equals_the_sonic_jax_layer():
  """The baseline MoE layer (MaxText-style, jax.lax.ragged_dot) computes sonic_jax's layer: the
  same parameters from the same seed, the same output, losses and gradients (float32)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  sys.path.insert(0, os.path.join(ROOT, "examples", "pretrain"))
  from ragged_moe import RaggedDotMoE
  from sonic_jax.layers import MoE
  d, e, n, k = 32, 8, 16, 2
  common = dict(init_std=d ** -0.5, load_balance_coef=0.01, z_loss_coef=1e-3)
  ours = MoE(d, e, n, k, backend="xla", rngs=nnx.Rngs(3), **common)
  base = RaggedDotMoE(d, e, n, k, rngs=nnx.Rngs(3), **common)
  x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50, d)), jnp.float32)

  def run(layer):
    def loss(layer, x):
      y, aux = layer(x)
      return jnp.sum(y * jnp.cos(y)) + aux.loss, (y, aux.loss, aux.stats.expert_counts)
    (_, out), grads = nnx.value_and_grad(loss, has_aux=True, argnums=(0, 1))(layer, x)
    return out, grads

  (y1, l1, c1), (g1, gx1) = run(ours)
  (y2, l2, c2), (g2, gx2) = run(base)
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(y2, y1) < 1e-5 and abs(float(l2 - l1)) < 1e-6 and rel(gx2, gx1) < 1e-5
  np.testing.assert_array_equal(np.asarray(c1), np.asarray(c2))
  for name in ("router", "w1", "w2"):
    assert rel(getattr(g2, name)[...], getattr(g1, name)[...]) < 1e-5, name
  # What the baseline does not implement is refused by name.
  import pytest
  from model import ModelConfig, TransformerLM
  with pytest.raises(ValueError, match="token_rounding='up'"):
    TransformerLM(ModelConfig(moe_impl="ragged_dot", token_rounding="up"), rngs=nnx.Rngs(0))

