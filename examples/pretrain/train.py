r"""Pretrain a small MoE language model with sonic_jax on the Python standard library's sources.

  python examples/pretrain/train.py --config=tiny            # CPU, a few minutes
  python examples/pretrain/train.py --config=h100 --workdir=/tmp/run   # one H100
  python examples/pretrain/train.py --help
  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      python examples/pretrain/train.py --expert_parallel=2   # experts over 2 of 4 devices

Byte-level tokens, a decoder-only transformer (rotary attention, RMSNorm, tied embeddings) whose
feed-forward layers are `sonic_jax.layers.MoE`, AdamW with warm-up and cosine decay, gradient
clipping, float32 master weights with --dtype compute, the routers' auxiliary losses. Every
--eval_every steps: train and held-out loss (nats/byte, perplexity), tokens/s, the MoE layers'
TFLOP/s (their forward+backward FLOPs over the whole step time: a lower bound) and the expert load
(max/mean over experts, worst layer). Writes metrics.csv, loss.png and orbax checkpoints to
--workdir and resumes from the latest checkpoint there.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import sys
import time

from absl import app, flags
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
from model import ModelConfig, TransformerLM, moe_flops_per_token  # noqa: E402

CONFIGS = {
    # model, batch, steps: trains on a 2-core CPU in a few minutes.
    "tiny": dict(model=ModelConfig(d_model=128, num_layers=2, num_heads=4, num_experts=8,
                                   expert_dim=64, top_k=2), batch_size=16, seq_len=128, steps=300,
                 lr=3e-3, warmup=30, corpus_bytes=2_000_000, eval_every=100),
    # Sized for one H100: d=1024, 8 layers, 64 experts of width 256, K=8.
    "h100": dict(model=ModelConfig(d_model=1024, num_layers=8, num_heads=16, num_experts=64,
                                   expert_dim=256, top_k=8, dtype="bfloat16"), batch_size=32,
                 seq_len=1024, steps=2000, lr=1e-3, warmup=200, corpus_bytes=40_000_000,
                 eval_every=200),
}

flags.DEFINE_enum("config", "tiny", list(CONFIGS), "preset; the flags below override it")
flags.DEFINE_string("workdir", "/tmp/sonic_jax_pretrain", "checkpoints, metrics.csv, loss.png")
flags.DEFINE_integer("steps", None, "training steps (preset's default)")
flags.DEFINE_integer("batch_size", None, "sequences per step")
flags.DEFINE_integer("seq_len", None, "tokens (bytes) per sequence")
flags.DEFINE_float("lr", None, "peak learning rate (AdamW)")
flags.DEFINE_integer("warmup", None, "linear warm-up steps, then cosine decay to 10%")
flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay")
flags.DEFINE_float("clip_norm", 1.0, "global gradient-norm clipping")
flags.DEFINE_integer("eval_every", None, "steps between evaluations, metrics and checkpoints")
flags.DEFINE_integer("eval_batches", 8, "held-out batches per evaluation")
flags.DEFINE_string("backend", None, "sonic_jax backend: auto, xla, mosaic_gpu")
flags.DEFINE_string("dtype", None, "compute dtype (float32 or bfloat16); parameters stay float32")
flags.DEFINE_float("bias_update_rate", None, "auxiliary-loss-free balancing rate (0: off)")
flags.DEFINE_enum("token_rounding", None, ["none", "down", "up", "nearest"],
                  "tile-aware token rounding of the MoE routers while training (evaluation uses "
                  "plain top-K)")
flags.DEFINE_integer("expert_parallel", 0, "expert-parallel degree P (0: one device): a mesh "
                     "(devices / P data, P ep) over all devices, experts sharded over ep, the "
                     "batch over both")
flags.DEFINE_enum("expert_parallel_scheme", "auto", ["auto", "all_to_all", "all_gather"],
                  "see sonic_jax.layers.MoE")
flags.DEFINE_float("capacity_factor", None, "all-to-all slot capacity (default: dropless)")
flags.DEFINE_integer("seed", 0, "initialisation and data order")
flags.DEFINE_bool("plot", True, "write loss.png at the end")
FLAGS = flags.FLAGS


def settings():
  s = dict(CONFIGS[FLAGS.config])
  for k in ("steps", "batch_size", "seq_len", "lr", "warmup", "eval_every"):
    if getattr(FLAGS, k) is not None:
      s[k] = getattr(FLAGS, k)
  overrides = {k: getattr(FLAGS, k) for k in ("backend", "dtype", "bias_update_rate")
               if getattr(FLAGS, k) is not None}
  if FLAGS.token_rounding is not None:
    overrides["token_rounding"] = None if FLAGS.token_rounding == "none" else FLAGS.token_rounding
  if FLAGS.expert_parallel:
    overrides.update(expert_parallel_axis="ep", expert_parallel_scheme=FLAGS.expert_parallel_scheme,
                     capacity_factor=FLAGS.capacity_factor)
  s["model"] = dataclasses.replace(s["model"], **overrides)
  return s


def make_mesh():
  """(data, ep) mesh over all devices for --expert_parallel, else None."""
  p = FLAGS.expert_parallel
  if not p:
    return None
  n = jax.device_count()
  if p < 0 or n % p:
    raise app.UsageError(f"--expert_parallel ({p}) must divide the {n} devices")
  return jax.make_mesh((n // p, p), ("data", "ep"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def place(tree, mesh):
  """Puts model/optimizer state on the mesh: tensors with the logical "expert" axis first
  sharded over ep (the MoE layers' expert weights and their optimizer moments), the rest
  replicated."""
  specs = nnx.get_partition_spec(tree)
  to_mesh = lambda spec: NamedSharding(mesh, P("ep") if spec and spec[0] == "expert" else P())
  shardings = jax.tree.map(to_mesh, specs, is_leaf=lambda v: isinstance(v, P))
  return jax.device_put(tree, shardings)


def loss_fn(model, inputs, targets):
  logits, aux_loss, counts = model(inputs)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  return ce + aux_loss, (ce, counts)


@nnx.jit
def train_step(model, optimizer, inputs, targets):
  (_, (ce, counts)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, inputs, targets)
  optimizer.update(model, grads)
  model.update_selection_biases(counts)  # after the optimizer step, outside the gradient
  return ce, jnp.stack(counts)


@nnx.jit
def eval_step(model, inputs, targets):
  logits, _, _ = model(inputs)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def evaluate(model, heldout, s):
  model.eval()  # plain top-K routing (token rounding is for training)
  losses = [float(eval_step(model, jnp.asarray(i), jnp.asarray(t)))
            for i, t in data.heldout_batches(heldout, s["batch_size"], s["seq_len"],
                                             FLAGS.eval_batches)]
  model.train()
  return float(np.mean(losses))


def main(_):
  s = settings()
  cfg = s["model"]
  os.makedirs(FLAGS.workdir, exist_ok=True)
  corpus = data.load_corpus(s["corpus_bytes"])
  train, heldout = data.split(corpus, 0.05)
  h_unigram = data.unigram_entropy(train)
  print(f"corpus {len(corpus) / 1e6:.1f} MB of stdlib source; unigram entropy "
        f"{h_unigram:.3f} nats/byte; {jax.devices()[0].device_kind}; {cfg}", flush=True)

  if not 0 <= s["warmup"] < s["steps"]:
    raise app.UsageError(f"--warmup ({s['warmup']}) must be in [0, --steps = {s['steps']})")
  model = TransformerLM(cfg, rngs=nnx.Rngs(FLAGS.seed))
  schedule = optax.warmup_cosine_decay_schedule(0.0, s["lr"], s["warmup"], s["steps"],
                                                end_value=0.1 * s["lr"])
  tx = optax.chain(optax.clip_by_global_norm(FLAGS.clip_norm),
                   optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=FLAGS.weight_decay))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  mesh = make_mesh()
  if mesh is not None:
    nnx.update((model, optimizer), place(nnx.state((model, optimizer)), mesh))
    batch_sharding = NamedSharding(mesh, P(("data", "ep")))
    if s["batch_size"] % jax.device_count():
      raise app.UsageError(f"--batch_size ({s['batch_size']}) must be a multiple of the "
                           f"{jax.device_count()} devices")
    jax.set_mesh(mesh)  # as a global setting: every jit below sees the mesh
    print(f"mesh {dict(mesh.shape)}: experts over ep, batch over (data, ep)", flush=True)

  import orbax.checkpoint as ocp
  ckpt = ocp.CheckpointManager(os.path.abspath(os.path.join(FLAGS.workdir, "ckpt")),
                               options=ocp.CheckpointManagerOptions(max_to_keep=2))
  start = 0
  if ckpt.latest_step() is not None:
    start = ckpt.latest_step()
    state = nnx.state((model, optimizer))
    restored = ckpt.restore(start, args=ocp.args.StandardRestore(state))
    nnx.update((model, optimizer), restored)
    print(f"resumed from step {start}", flush=True)

  csv_path = os.path.join(FLAGS.workdir, "metrics.csv")
  new_file = not os.path.exists(csv_path) or start == 0
  log = open(csv_path, "w" if new_file else "a", newline="")
  writer = csv.writer(log)
  if new_file:
    writer.writerow(["step", "train_loss", "heldout_loss", "heldout_ppl", "tokens_per_s",
                     "moe_tflops", "expert_load_max_over_mean", "unigram_entropy"])
  tokens_per_step = s["batch_size"] * s["seq_len"]
  # Losses stay on the device and the loop never waits for a step: the host syncs only at
  # evaluations, and a window's time runs from the end of its first step (which compiles after a
  # start) to that sync.
  window_loss, window_t0, window_steps = [], None, 0
  for step in range(start, s["steps"]):
    inputs, targets = data.batch(train, s["batch_size"], s["seq_len"], FLAGS.seed, step)
    if mesh is not None:
      inputs, targets = (jax.device_put(a, batch_sharding) for a in (inputs, targets))
    ce, counts = train_step(model, optimizer, jnp.asarray(inputs), jnp.asarray(targets))
    window_loss.append(ce)
    if window_t0 is None:
      jax.block_until_ready(ce)
      window_t0 = time.perf_counter()
    else:
      window_steps += 1
    done = step + 1
    if sys.stdout.isatty():  # a progress bar on terminals; logs get the evaluation lines only
      bar = "#" * int(30 * done / s["steps"])
      print(f"\r[{bar:<30}] {done}/{s['steps']}", end="", flush=True)
    if done % s["eval_every"] == 0 or done == s["steps"]:
      train_loss = float(jnp.mean(jnp.stack(window_loss)))  # the window's sync
      step_s = (time.perf_counter() - window_t0) / max(window_steps, 1)
      heldout_loss = evaluate(model, heldout, s)
      c = np.asarray(counts, np.float64)
      load = float((c.max(-1) / np.maximum(c.mean(-1), 1e-9)).max())
      row = [done, train_loss, heldout_loss, float(np.exp(heldout_loss)),
             tokens_per_step / step_s if window_steps else float("nan"),
             moe_flops_per_token(cfg) * tokens_per_step / step_s / 1e12 if window_steps else float("nan"),
             load, h_unigram]
      writer.writerow(row)
      log.flush()
      print(f"{chr(10) if sys.stdout.isatty() else ''}step {done}: train {row[1]:.3f} held-out {heldout_loss:.3f} nats/byte "
            f"(ppl {row[3]:.2f}, unigram {h_unigram:.3f}), {row[4]:.0f} tokens/s, "
            f"MoE {row[5]:.3f} TFLOP/s, expert load max/mean {load:.2f}", flush=True)
      ckpt.save(done, args=ocp.args.StandardSave(nnx.state((model, optimizer))))
      window_loss, window_t0, window_steps = [], time.perf_counter(), 0
  ckpt.wait_until_finished()
  log.close()
  if FLAGS.plot:
    plot(csv_path, os.path.join(FLAGS.workdir, "loss.png"))


def plot(csv_path, png_path):
  """Writes the loss curves to png_path; without matplotlib, says so and writes nothing."""
  try:
    import matplotlib
  except ImportError:
    print("matplotlib is not installed: no loss.png (pip install 'sonic_jax[examples]')")
    return
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  with open(csv_path) as f:
    rows = list(csv.DictReader(f))
  steps = [int(r["step"]) for r in rows]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(steps, [float(r["train_loss"]) for r in rows], label="train")
  ax.plot(steps, [float(r["heldout_loss"]) for r in rows], label="held-out")
  ax.axhline(float(rows[0]["unigram_entropy"]), ls="--", c="gray", label="unigram entropy")
  ax.set_xlabel("step")
  ax.set_ylabel("nats / byte")
  ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
