"""The example pretraining script: the tiny configuration learns the corpus on a CPU and resumes;
SIGTERM checkpoints and exits, a resumed run never repeats a metrics row; sample.py generates from
a checkpoint; the BPE tokenizer and a BPE run, the attention choice, the OLMoE-shaped preset's
counts, the flags refused before any work; the sharding rules and sharded training (expert
parallel with FSDP and gradient accumulation, two processes; the ragged_dot baseline) tracking one
device; the baseline layer and the output projection's backward against references."""

import csv
import importlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "pretrain", "train.py")
SAMPLE = os.path.join(ROOT, "examples", "pretrain", "sample.py")
# The example's processes run no interpreted kernel, so without conftest.py's PJRT_NPROC=16: XLA's
# own thread pool (16 threads on 2 cores made the tiny run about 8% slower).
ENV = {k: v for k, v in os.environ.items() if k != "PJRT_NPROC"}


@pytest.mark.slow
def test_tiny_config_learns_and_resumes(tmp_path):
  """The tiny preset, 80 steps: SIGTERM at step 40's metrics line: the finished step is logged and
  checkpointed and the process exits 0; the resumed run (a setting changed, reported) drops rows
  past the checkpoint (here a row written after it, as after a crash), continues, one row per
  logged step, and ends clearly below the unigram entropy."""
  cmd = [sys.executable, SCRIPT, "--config=tiny", f"--workdir={tmp_path}", "--steps=80",
         "--eval_every=40", "--backend=xla"]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=ENV)
  lines = []
  for line in proc.stdout:
    lines.append(line)
    if line.startswith("step 40:"):
      proc.send_signal(signal.SIGTERM)
      break
  out = "".join(lines) + proc.stdout.read()
  assert proc.wait(timeout=600) == 0, proc.stderr.read()[-3000:]
  assert "step 1 (compiled, then run) took " in out, out
  (stopped,) = [int(l.split()[-2].rstrip(";")) for l in out.splitlines() if "SIGTERM" in l]
  assert 40 < stopped < 80 and os.path.isdir(tmp_path / "ckpt" / str(stopped)), out
  with open(tmp_path / "metrics.csv") as f:
    rows = list(csv.DictReader(f))
  assert [int(r["step"]) for r in rows] == [40, stopped]
  # A row the crashed run wrote after its checkpoint, at a step the resumed run does not log (not
  # a multiple of --eval_every): where SIGTERM lands depends on the machine's speed.
  fake = stopped + 1 if (stopped + 1) % 40 else stopped + 2
  with open(tmp_path / "metrics.csv", "a") as f:
    f.write(f"{fake}" + ",1" * 13 + "\n")
  # The same training program (its compilation cached), checkpoints at the end only.
  proc = subprocess.run(cmd + ["--checkpoint_every=80"], capture_output=True, text=True,
                        timeout=900, env=ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert f"resumed from step {stopped} with changed settings: checkpoint_every: 40 -> 80" in out
  with open(tmp_path / "metrics.csv") as f:
    rows = list(csv.DictReader(f))
  assert [int(r["step"]) for r in rows] == [40, stopped, 80]
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
  assert config["model"]["num_experts"] == 8 and config["steps"] == 80
  assert {"config", "model", "optimizer"} <= set(os.listdir(tmp_path / "ckpt" / "80"))
  events = os.listdir(tmp_path / "tb")
  assert events and all(e.startswith("events.out.tfevents") for e in events)
  # Another model in the same workdir is refused before anything is written, as are a workdir
  # whose ckpt is a file and one whose checkpoint another program wrote (here a step's folder
  # holding a stray file); with nothing left to train, the run says so and keeps the saved
  # configuration (the checkpoint's). One process.
  (tmp_path / "file").mkdir()
  (tmp_path / "file" / "ckpt").write_text("x")
  (tmp_path / "other" / "ckpt" / "10").mkdir(parents=True)
  (tmp_path / "other" / "ckpt" / "10" / "x").write_text("x")
  cases = [cmd[2:4] + ["--steps=90", "--backend=xla", "--d_model=64"],
           [cmd[2], f"--workdir={tmp_path / 'file'}", "--backend=xla"],
           [cmd[2], f"--workdir={tmp_path / 'other'}", "--backend=xla"],
           cmd[2:] + ["--eval_every=20"]]
  proc = subprocess.run([sys.executable, "-c", _REFUSE, SCRIPT, json.dumps(cases)],
                        capture_output=True, text=True, timeout=600, env=ENV)
  assert proc.returncode == 0 and "nothing to train: the run is at step 80" in proc.stdout, (
      proc.stderr[-2000:])
  refusals = [json.loads(line)[0] for line in proc.stdout.splitlines() if line.startswith("[")]
  assert "holds step 80 of another model or tokenizer (model.d_model: 128 -> 64)" in refusals[0]
  assert f"--workdir: {tmp_path / 'file' / 'ckpt'} is not a directory" in refusals[1]
  assert "its checkpoint of step 10 holds no configuration that train.py wrote" in refusals[2]
  assert json.loads((tmp_path / "config.json").read_text()) == config


# Runs train.py's main on each argv but the last as absl's app.run would (flags parsed, then main;
# the refusal caught and reported), then app.run on the last: one process pays the imports once.
_REFUSE = """
import contextlib, io, json, os, sys
from absl import app, flags
script, cases = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, os.path.dirname(script))
import train
for argv in cases[:-1]:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    try:
      flags.FLAGS.unparse_flags()
      flags.FLAGS([script, *argv])
      train.main(None)
      refusal = None
    except (flags.Error, SystemExit) as e:  # train.main exits with a refusal's reason
      refusal = str(e)
  print(json.dumps([refusal, out.getvalue()]), flush=True)
flags.FLAGS.unparse_flags()
app.run(train.main, argv=[script, *cases[-1]])
"""


def test_flags_refused_by_name(tmp_path):
  """Refused before the workdir is made and the corpus is read and tokenized (which takes minutes
  for a BPE); the process exits 1 with the reason on stderr."""
  cases = [(["--d_model=132", "--num_heads=4"], "an even head"),
           (["--expert_parallel=2", "--batch_size=4", "--grad_accum=4"], "times --grad_accum (4)"),
           (["--dtype=bf16"], "flag --dtype=bf16: value should be one of"),
           (["--top_k=9"], "the model: --top_k must be in [1, E=8], got 9"),
           (["--memcpy_p2p", "--distributed"], "not with --distributed"),
           (["--backend=mosaic_gpu"], "--backend=mosaic_gpu needs an sm90 (Hopper) GPU"),
           (["--log_every=0"], "--log_every must be >= 1, got 0"),
           (["--eval_batches=0"], "--eval_batches must be >= 1, got 0"),
           (["--expert_parallel_scheme=all_gather"], "needs --expert_parallel=P"),
           (["--clip_norm=-1"], "--clip_norm must be >= 0 (0: no clipping), got -1.0"),
           (["--peak_tflops=-1"], "--peak_tflops must be > 0, got -1.0"),
           (["--num_layers=0"], "--num_layers must be >= 1, got 0"),
           (["--tokenizer=bpe", "--vocab_size=100"], "--vocab_size (100) must be > 256"),
           (["--profile_step=2"], "--profile_step (2) must be in [0, --steps = 1]"),
           (["--corpus_bytes=-10"], "--corpus_bytes must be >= 1, got -10"),
           (["--weight_decay=-1"], "--weight_decay must be >= 0, got -1.0"),
           (["--expert_parallel=-1"], "--expert_parallel must be >= 0 (0: one device), got -1"),
           (["--corpus_dir=/nonexistent"], "--corpus_dir: no such directory: /nonexistent"),
           (["--num_processes=2"], "--num_processes configure --distributed runs"),
           (["--warmup=5"], "--warmup (5) must be in [0, --steps = 1)"),
           (["--attention=cudnn"], "--attention=cudnn needs an NVIDIA GPU")]
  # The first case keeps the preset's warm-up (30 steps) for its one step; the rest pass none.
  cases.insert(0, ([], "--warmup (30, the tiny preset's: pass --warmup) must be in"))
  common = ["--config=tiny", f"--workdir={tmp_path / 'run'}", "--steps=1", "--backend=xla"]
  env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=4")  # a (data 2, ep 2) mesh
  proc = subprocess.run([sys.executable, "-c", _REFUSE, SCRIPT,
                         json.dumps([common + (["--warmup=0"] if flags else []) + flags
                                     for flags, _ in cases])],
                        capture_output=True, text=True, timeout=600, env=env)
  assert proc.returncode == 1 and cases[-1][1] in proc.stderr, proc.stderr[-2000:]
  reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("[")]
  assert len(reports) == len(cases) - 1, proc.stdout
  for (flags, message), (refusal, out) in zip(cases, reports):
    assert refusal is not None and message in refusal, (flags, refusal)
    assert "corpus" not in out, out
  assert not any(line.startswith("corpus ") for line in proc.stdout.splitlines()), proc.stdout
  assert not os.path.exists(tmp_path / "run")


def _free_port():
  import socket
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


@pytest.mark.slow
def test_sharded_training_tracks_one_device(tmp_path):
  """On 4 CPU devices, 6 steps: expert parallelism with FSDP and two accumulated micro-batches
  ((data 2, ep 2) mesh, the layers' own shard_map; parameters and optimizer state also sharded over
  data), run as two processes of two devices each (--distributed: what several hosts run), and the
  ragged_dot baseline MoE layer (same initialisation and math) data parallel with FSDP and its first
  step profiled, each follow the one-device run: same data and init; the load-balance loss is per
  data shard and micro-batch, so close, not bitwise. The first process alone writes metrics and
  prints. The one-device run logs every step: the warm-up's learning rates."""
  losses, outs = {}, {}
  port = _free_port()
  # Checkpoints and TensorBoard scalars (test_tiny_config_learns_and_resumes) in the multi-process
  # run alone.
  runs = (("one", 1, ["--log_every=1", "--checkpoint_every=0", "--tensorboard=false"]),
          ("ep_fsdp", 2, ["--expert_parallel=2", "--fsdp", "--grad_accum=2"]),
          ("ragged_dot", 1, ["--moe_impl=ragged_dot", "--expert_parallel=1", "--fsdp",
                             "--profile_step=1", "--checkpoint_every=0", "--tensorboard=false"]))
  for name, processes, extra in runs:
    # Six steps: compiling is most of a run, so XLA compiles with most optimizations off.
    env = dict(ENV, XLA_FLAGS=f"--xla_force_host_platform_device_count={4 // processes}",
               JAX_DISABLE_MOST_OPTIMIZATIONS="1")
    cmd = [sys.executable, SCRIPT, "--config=tiny", f"--workdir={tmp_path / name}", "--steps=6",
           "--eval_every=6", "--eval_batches=2", "--warmup=3", "--backend=xla", "--plot=false",
           *extra]
    if processes > 1:
      cmd += ["--distributed", f"--coordinator_address=localhost:{port}",
              f"--num_processes={processes}"]
    procs = [subprocess.Popen(cmd + ([f"--process_id={i}"] if processes > 1 else []),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for i in range(processes)]
    results = [p.communicate(timeout=900) for p in procs]
    for p, (_, err) in zip(procs, results):
      assert p.returncode == 0, err[-3000:]
    with open(tmp_path / name / "metrics.csv") as f:
      rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == ([1, 2, 3, 4, 5, 6] if name == "one" else [6])
    # The mean of the steps' losses, which the others' one row reports.
    losses[name] = (sum(float(r["train_loss"]) for r in rows) / len(rows),
                    float(rows[-1]["heldout_loss"]))
    if name == "one":
      # The warm-up's first update runs at lr / (warmup + 1), not 0; the peak (the tiny preset's
      # 3e-3) follows, then the cosine decay towards 10% of it.
      lrs = [float(r["lr"]) for r in rows]
      assert lrs == pytest.approx([7.5e-4, 1.5e-3, 2.25e-3, 3e-3, 2.325e-3, 9.75e-4]), lrs
    outs[name] = results[0][0]
    if processes > 1:
      # The other process prints none of the run's lines (gloo, the CPU collectives between
      # processes, reports its connections from its own threads).
      assert not any(s in results[1][0] for s in ("corpus", "mesh {", "step 6:")), results[1][0]
  assert "mesh {'data': 2, 'ep': 2}" in outs["ep_fsdp"]
  assert ("mesh {'data': 4, 'ep': 1}: expert tensors over data, the others over (data, ep) "
          "(FSDP), batch") in outs["ragged_dot"]
  assert not os.path.exists(tmp_path / "one" / "ckpt")  # --checkpoint_every=0 makes none
  for name in ("ep_fsdp", "ragged_dot"):
    for a, b in zip(losses["one"], losses[name]):
      assert abs(a - b) < 0.02, (name, losses)
  # FSDP on the (data 2, ep 2) mesh: expert tensors over ep and data, the rest over both: about a
  # quarter of the state per device (expert parallelism alone keeps the non-expert parameters
  # whole: over 0.6 here).
  mine, total = (float(v) for v in re.search(r"state: ([\d.]+) of ([\d.]+) MB",
                                                outs["ep_fsdp"]).groups())
  assert mine < 0.27 * total, (mine, total)
  # The profiled first step is a program of its own (on a CPU the training step's, a compile
  # cache hit at step 2); the training step's first call comes at step 2, before the rates' window.
  assert "step 1 (compiled, profiled) took " in outs["ragged_dot"], outs["ragged_dot"]
  assert "step 2 (compiled, then run) took " in outs["ragged_dot"], outs["ragged_dot"]
  # The profiled step's device time, split by the model's named scopes (here XLA:CPU's thunks).
  split = json.loads((tmp_path / "ragged_dot" / "profile_split.json").read_text())["parts_ms"]
  assert all(split[p] > 0 for p in ("moe", "attention", "collectives", "optimizer")), split


def test_ragged_dot_baseline_layer_equals_the_sonic_jax_layer():
  """The baseline MoE layer (MaxText-style, jax.lax.ragged_dot) computes sonic_jax's layer: the
  same parameters from the same seed, the same output, losses and gradients (float32); so does it
  on tokamax.ragged_dot where tokamax is installed."""
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

  @nnx.jit  # one program per layer: the layers' eager ops would compile one by one
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
  # tokamax's grouped GEMM in the same layer (its XLA path on a CPU), where tokamax is installed.
  try:
    import tokamax  # noqa: F401
  except ImportError:
    pass
  else:
    tok = RaggedDotMoE(d, e, n, k, ragged_dot="tokamax", rngs=nnx.Rngs(3), **common)
    (y3, l3, _), (g3, gx3) = run(tok)
    assert rel(y3, y2) < 1e-5 and abs(float(l3 - l2)) < 1e-6 and rel(gx3, gx2) < 1e-5
    assert rel(g3.w1[...], g2.w1[...]) < 1e-5
  with pytest.raises(ValueError, match="ragged_dot must be one of"):
    RaggedDotMoE(d, e, n, k, ragged_dot="cutlass", rngs=nnx.Rngs(3), **common)
  # What the baseline does not implement is refused by name.
  from model import ModelConfig, TransformerLM
  with pytest.raises(ValueError, match="token_rounding='up'"):
    TransformerLM(ModelConfig(moe_impl="ragged_dot", token_rounding="up"), rngs=nnx.Rngs(0))


def _example(name):
  """A module of the example (its directory on sys.path, as the scripts put it)."""
  path = os.path.join(ROOT, "examples", "pretrain")
  if path not in sys.path:
    sys.path.insert(0, path)
  return importlib.import_module(name)


def test_bpe_tokenizer_round_trips_deterministic_and_cached(tmp_path):
  """The byte-level BPE: trained on the training split alone, the same merges on every build;
  any bytes (invalid UTF-8 included) encode and decode exactly; the chunked encoding equals the
  library's on the whole text; a second build on the same corpus loads the cache."""
  import numpy as np
  data, tok_lib = _example("data"), _example("tokenizer")
  train, heldout = data.split(data.load_corpus(300_000), 0.05)
  tok, train_ids, heldout_ids, info = tok_lib.build("bpe", train, heldout, 512, str(tmp_path))
  assert info["trained"] and tok.vocab_size == 512 and train_ids.dtype == np.uint16
  assert tok.tok.to_str() == tok_lib.train_bpe(train.tobytes(), 512).tok.to_str()
  assert tok.decode(train_ids) == train.tobytes() and tok.decode(heldout_ids) == heldout.tobytes()
  assert int(tok.token_bytes[train_ids].sum()) == len(train) and len(train_ids) < len(train) / 2
  odd = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes() + "é∑".encode()
  assert tok.decode(tok.encode(odd)) == odd
  text = heldout.tobytes().decode("utf-8", errors="ignore")
  chunked = [i for c in tok_lib._chunks(text, 500) for i in tok.tok.encode(c).ids]
  assert chunked == tok.tok.encode(text).ids
  again, train2, heldout2, info2 = tok_lib.build("bpe", train, heldout, 512, str(tmp_path))
  assert not info2["trained"] and again.tok.to_str() == tok.tok.to_str()
  np.testing.assert_array_equal(train2, train_ids)
  np.testing.assert_array_equal(heldout2, heldout_ids)
  assert 0 < data.unigram_entropy(train_ids) < np.log(512)
  assert [tok_lib.padded_vocab(v) for v in (256, 500, 39366, 50304)] == [256, 512, 39424, 50304]


@pytest.mark.slow
def test_bpe_run_trains_reports_per_byte_and_samples(tmp_path):
  """--tokenizer=bpe end to end: losses per token and per byte (the byte counts of the evaluated
  tokens), the tokenizer saved with the run, sample.py loading the model alone from the latest
  checkpoint, its config from inside it, and decoding with the tokenizer (the cache that a resume
  loads: test_bpe_tokenizer_round_trips_deterministic_and_cached); a step without a checkpoint is
  refused naming those there are, one that train.py did not write too. The model's blocks are
  stacked, scanned and rematerialised; it trains with token rounding and evaluates (and samples)
  with top-K routing."""
  cmd = [sys.executable, SCRIPT, "--config=tiny", f"--workdir={tmp_path}", "--steps=40",
         "--eval_every=40", "--warmup=5", "--backend=xla", "--tokenizer=bpe", "--vocab_size=512",
         "--corpus_bytes=400000", "--plot=false", "--tensorboard=false", "--remat=dots",
         "--scan_layers", "--token_rounding=nearest"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "BPE: 512 tokens, trained in" in proc.stdout
  assert "K=2, token rounding nearest, vocabulary 512," in proc.stdout, proc.stdout
  model = json.loads((tmp_path / "config.json").read_text())["model"]
  assert (model["remat"], model["scan_layers"], model["token_rounding"]) == ("dots", True,
                                                                             "nearest")
  with open(tmp_path / "metrics.csv") as f:
    (row,) = list(csv.DictReader(f))
  loss, per_byte = float(row["heldout_loss"]), float(row["heldout_nats_per_byte"])
  assert loss / 4 < per_byte < loss / 1.5, row  # BPE tokens span about 2.4 bytes here
  assert per_byte < float(row["unigram_nats_per_byte"]), row
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["tokenizer"] == "bpe" and config["tokenizer_vocab"] == 512
  assert config["model"]["vocab_size"] % 128 == 0 and os.path.exists(config["tokenizer_path"])
  # Past the run's --seq_len (128) the model sees the latest 128 tokens.
  proc = subprocess.run([sys.executable, SAMPLE, f"--workdir={tmp_path}", "--prompt=import ",
                         "--tokens=140", "--temperature=0"], capture_output=True, text=True,
                        timeout=600, env=ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.startswith("[step 40] import ") and len(proc.stdout) > 150, proc.stdout
  proc = subprocess.run([sys.executable, SAMPLE, f"--workdir={tmp_path}", "--step=7"],
                        capture_output=True, text=True, timeout=600, env=ENV)
  assert proc.returncode == 1 and "no checkpoint of step 7" in proc.stderr, proc.stderr[-2000:]
  assert "holds steps [40]" in proc.stderr, proc.stderr[-2000:]
  # Resumed with another corpus (the BPE's ids would change meaning): refused before a tokenizer
  # is trained, the run's own left as it was.
  saved = (tmp_path / "tokenizer.json").read_bytes()
  proc = subprocess.run([*cmd, "--corpus_bytes=300000", "--steps=50"], capture_output=True,
                        text=True, timeout=600, env=ENV)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "another model or tokenizer (corpus_digest: " in proc.stderr, proc.stderr[-2000:]
  assert "(the text that --corpus_dir and --corpus_bytes choose)" in proc.stderr
  assert "BPE" not in proc.stdout
  assert (tmp_path / "tokenizer.json").read_bytes() == saved
  # A step's folder that train.py did not write (here holding a stray file): refused by sample.py
  # (in this process: the refusal comes before any model is built).
  from absl import app
  (tmp_path / "ckpt" / "7").mkdir()
  (tmp_path / "ckpt" / "7" / "x").write_text("x")
  with pytest.raises(app.UsageError, match="step 7 in .* holds no configuration that train.py"):
    _example("sample").load_model(str(tmp_path), 7)


def test_shard_spec_rules():
  """The logical-axis rules: expert tensors over ep, and with FSDP their model width over data;
  the other tensors' model width over the whole mesh, or over data where only that divides it."""
  from jax.sharding import PartitionSpec as P
  shard_spec = _example("sharding").shard_spec

  class Mesh:  # shard_spec reads only the axis sizes
    def __init__(self, data, ep):
      self.shape = {"data": data, "ep": ep}

  ep4, dp2_ep2 = Mesh(1, 4), Mesh(2, 2)
  expert, dense = ("expert", "embed", "mlp"), ("embed", "mlp")
  assert shard_spec(expert, (8, 64, 32), ep4, fsdp=False) == P("ep", None, None)
  assert shard_spec(dense, (64, 32), ep4, fsdp=False) == P(None, None)
  assert shard_spec(expert, (8, 64, 32), ep4, fsdp=True) == P("ep", "data", None)
  assert shard_spec(dense, (64, 32), ep4, fsdp=True) == P(("data", "ep"), None)
  assert shard_spec(dense, (6, 32), dp2_ep2, fsdp=True) == P("data", None)  # 6 % 4 != 0
  assert shard_spec(dense, (5, 32), dp2_ep2, fsdp=True) == P(None, None)
  assert shard_spec(("layers",) + dense, (2, 64, 32), dp2_ep2, fsdp=True) == P(
      None, ("data", "ep"), None)
  assert shard_spec(("vocab", "embed"), (100, 64), dp2_ep2, fsdp=True) == P(None, ("data", "ep"))


def test_olmoe_preset_matches_olmoe_counts():
  """The olmoe_1b_7b preset, built abstractly (no memory): OLMoE-1B-7B's 6.9B parameters and 1.3B
  active ones (OLMoE counts the input embedding, which active_params leaves out as a lookup), and
  the README's FLOP formula, 6 N_active + 12 L d S."""
  import jax
  import numpy as np
  from flax import nnx
  presets, model = _example("presets"), _example("model")
  preset = presets.CONFIGS["olmoe_1b_7b"]
  cfg = preset["model"]
  assert (cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.num_experts, cfg.expert_dim,
          cfg.top_k, cfg.vocab_size, cfg.tie_embeddings) == (2048, 16, 16, 64, 1024, 8, 50304,
                                                             False)
  assert preset["seq_len"] == 4096 and preset["tokenizer"] == "bpe" and cfg.dtype == "bfloat16"
  abstract = nnx.eval_shape(lambda: model.TransformerLM(cfg, rngs=nnx.Rngs(0)))
  leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
  assert all(leaf.dtype == np.float32 for leaf in leaves)
  total = sum(int(np.prod(leaf.shape)) for leaf in leaves)
  active = model.active_params(cfg)
  assert abs(total / 6.9e9 - 1) < 0.02, total
  assert abs((active + cfg.d_model * cfg.vocab_size) / 1.3e9 - 1) < 0.03, active
  d, L, S = cfg.d_model, cfg.num_layers, preset["seq_len"]
  n_active = L * (4 * d * d + d * cfg.num_experts + cfg.top_k * 3 * d * cfg.expert_dim) + d * 50304
  assert active == n_active
  assert model.model_flops_per_token(cfg, S) == 6 * n_active + 12 * L * d * S


def test_attention_selection():
  """--attention: auto is XLA on a CPU and cuDNN on an NVIDIA GPU where jax's cuDNN attention
  takes the dtype and head dim; an explicit cudnn that cannot run is refused by name."""
  import types
  from flax import nnx
  model = _example("model")
  cfg = model.ModelConfig(d_model=2048, num_heads=16, dtype="bfloat16")
  assert model.attention_implementation(cfg) == "xla"  # this machine's CPU
  with pytest.raises(ValueError, match="--attention=cudnn needs an NVIDIA GPU"):
    model.attention_implementation(model.ModelConfig(attention="cudnn"))
  with pytest.raises(ValueError, match="--attention=cudnn"):
    model.TransformerLM(model.ModelConfig(attention="cudnn"), rngs=nnx.Rngs(0))
  gpu = lambda cc, kind="NVIDIA H100 80GB HBM3": types.SimpleNamespace(
      platform="gpu", device_kind=kind, compute_capability=cc)
  pick = lambda dev, **kw: model.attention_implementation(
      model.ModelConfig(**{"d_model": 2048, "num_heads": 16, "dtype": "bfloat16", **kw}), dev)
  assert pick(gpu("9.0")) == "cudnn" and pick(gpu("9.0"), dtype="float16") == "cudnn"
  assert pick(gpu("9.0"), dtype="float32") == "xla"
  assert pick(gpu("9.0"), d_model=4224) == "xla"  # head dim 264 > 256
  assert pick(gpu("9.0"), num_heads=8) == "cudnn"  # 256
  assert pick(gpu("8.0", "NVIDIA A100-SXM4-80GB"), num_heads=8) == "xla"  # 256 > 128 before Hopper
  assert pick(gpu("7.0", "Tesla V100-SXM2-16GB")) == "xla"
  assert pick(gpu("gfx942", "AMD Instinct MI300X")) == "xla"
  assert pick(gpu("9.0"), attention="xla") == "xla"
  with pytest.raises(ValueError, match="bfloat16 or float16"):
    pick(gpu("9.0"), dtype="float32", attention="cudnn")
  # The flag --attention=cudnn, refused before any work: test_flags_refused_by_name.


def test_output_logits_gradients():
  """The output projection's custom backward: the float32 cotangent cast to the inputs' dtype.
  float32 inputs get autodiff's gradients (to float32 summation order); bfloat16 inputs get them
  within bf16 rounding of a float64 product (each gradient by its relative Frobenius error)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  output_logits = _example("model").output_logits
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (2, 16, 64))
  w = jax.random.normal(kw, (64, 96)) / 8
  g = jax.random.normal(kg, (2, 16, 96))
  plain = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)
  ours = jax.vjp(output_logits, x, w)[1](g)
  ref = jax.vjp(plain, x, w)[1](g)
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  logits, vjp = jax.vjp(output_logits, x16, w16)
  assert logits.dtype == jnp.float32
  d_x, d_w = vjp(g)
  assert d_x.dtype == jnp.bfloat16 and d_w.dtype == jnp.bfloat16
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x16, w16, g))
  for got, want in ((d_x, g64 @ w64.T), (d_w, np.einsum("btd,btv->dv", x64, g64))):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
