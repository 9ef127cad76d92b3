r"""Pretrain an MoE language model with sonic_jax on the Python standard library's sources.

  python examples/pretrain/train.py --config=tiny --workdir=/tmp/tiny   # CPU, a few minutes
  python examples/pretrain/train.py --config=h100 --workdir=/tmp/run   # one H100
  python examples/pretrain/train.py --config=tiny --tokenizer=bpe --vocab_size=4096 \
      --workdir=/tmp/bpe                                               # BPE tokens
  python examples/pretrain/train.py --config=olmoe_1b_7b --expert_parallel=4 --workdir=/tmp/olmoe
  python examples/pretrain/train.py --config=tiny --num_layers=4 --d_model=256 \
      --workdir=/tmp/shape                                             # any shape
  python examples/pretrain/sample.py --workdir=/tmp/run --prompt="def "    # text from a checkpoint
  python examples/pretrain/train.py --help
  XLA_FLAGS=--xla_force_host_platform_device_count=4 \
      python examples/pretrain/train.py --expert_parallel=2 --workdir=/tmp/ep   # (data 2, ep 2)

A workdir holds one run: the same command again resumes it, another model there is refused.

Byte tokens or a byte-level BPE trained on the training split (--tokenizer; tokenizer.py), a
decoder-only transformer (rotary attention, RMSNorm, tied or untied embeddings) whose feed-forward
layers are `sonic_jax.layers.MoE`, AdamW with warm-up and cosine decay, gradient clipping, float32
master weights with --dtype compute, the routers' auxiliary losses, optional activation
rematerialisation (--remat), the model and optimizer buffers donated to each step.

Every --log_every steps a row of metrics.csv (and TensorBoard scalars under workdir/tb where
tensorboardX is installed): train loss (nats per token, and per byte of the text it covers, which
compares across tokenizers), auxiliary loss, gradient norm, learning rate, tokens/s, MFU (6 N_active
+ 12 L d S FLOPs per token over the device's peak), the routed experts' TFLOP/s per device, the
expert load (max/mean over experts; per layer in TensorBoard) and the pairs a capacity factor
dropped (summed over the window's steps and the layers); every
--eval_every steps also the held-out loss. Checkpoints (model, optimizer and the run's
configuration as separate items) every --checkpoint_every steps and on SIGTERM or SIGINT; a run
resumes from the latest one in --workdir, and metrics rows past it are dropped first, so a
resumed run never repeats a step's row.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import time

from absl import app, flags, logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import data  # noqa: E402
import step_profile  # noqa: E402
from model import (ATTENTIONS, MOE_IMPLS, REMATS, TransformerLM, active_params,  # noqa: E402
                   check_device, model_flops_per_token, moe_flops_per_token)
from presets import CONFIGS  # noqa: E402
from sharding import bytes_per_device, create_sharded  # noqa: E402
import tokenizer as tokenizer_lib  # noqa: E402

flags.DEFINE_enum("config", "tiny", list(CONFIGS), "preset; the flags below override it")


def _preset(key):
  """A flag's help suffix: the presets' values of the setting `key` (a model field or a run
  setting), which the flag overrides."""
  values = {}
  for name, preset in CONFIGS.items():
    # Run settings are the preset's own entries (none: the tokenizer's bytes, no BPE target);
    # the rest are model fields.
    if key in ("tokenizer", "vocab_size") or key in preset:
      value = preset.get(key, "bytes" if key == "tokenizer" else None)
    else:
      value = getattr(preset["model"], key)
    values[name] = "none" if value is None else value
  if len(set(values.values())) == 1:
    return f" (every preset's: {next(iter(values.values()))})"
  return f" (the preset's: {', '.join(f'{k} {v}' for k, v in values.items())})"

flags.DEFINE_string("workdir", "/tmp/sonic_jax_pretrain", "checkpoints, metrics.csv, loss.png")
flags.DEFINE_integer("steps", None, "training steps, more than --warmup (pass --warmup with a "
                     "short run)" + _preset("steps"))
flags.DEFINE_integer("batch_size", None, "sequences per step" + _preset("batch_size"))
flags.DEFINE_integer("grad_accum", 1, "micro-batches per step, their gradients averaged (the "
                     "batch size a multiple of it)")
flags.DEFINE_integer("seq_len", None, "tokens per sequence" + _preset("seq_len"))
flags.DEFINE_enum("tokenizer", None, list(tokenizer_lib.TOKENIZERS), "bytes (256 tokens) or bpe "
                  "(byte-level BPE trained on the training split)" + _preset("tokenizer"))
flags.DEFINE_integer("vocab_size", None, "--tokenizer=bpe's target vocabulary, the 256 bytes "
                     "included (the model's is the one reached, padded to a multiple of 128)"
                     + _preset("vocab_size"))
flags.DEFINE_integer("corpus_bytes", None, "corpus size in bytes" + _preset("corpus_bytes"))
flags.DEFINE_string("corpus_dir", None, "read the corpus from the .py files under this directory "
                    "(default: the Python standard library); subdirectories named test, tests, "
                    "site-packages, __pycache__ and idlelib are skipped")
flags.DEFINE_string("data_cache", None, "where the trained BPE and the token arrays are cached "
                    "(default: workdir/data_cache); share it between runs")
flags.DEFINE_float("lr", None, "peak learning rate (AdamW)" + _preset("lr"))
flags.DEFINE_integer("warmup", None, "linear warm-up steps from lr / (warmup + 1) to lr, then "
                     "cosine decay to 10%" + _preset("warmup"))
flags.DEFINE_float("weight_decay", 0.1, "AdamW weight decay")
flags.DEFINE_float("clip_norm", 1.0, "clip the gradient to this global norm (0: no clipping)")
flags.DEFINE_integer("eval_every", None, "steps between held-out evaluations"
                     + _preset("eval_every"))
flags.DEFINE_integer("log_every", None, "steps between metrics rows (default: --eval_every)")
flags.DEFINE_integer("checkpoint_every", None, "steps between checkpoints (default: --eval_every); "
                     "one is also written on SIGTERM or SIGINT and at the end; 0: none at all "
                     "(a throughput measurement)")
for _name, _help in (("d_model", "model width d"), ("num_layers", "transformer blocks"),
                     ("num_heads", "attention heads"), ("num_experts", "experts per MoE layer E"),
                     ("expert_dim", "expert hidden width n"), ("top_k", "experts per token K"),
                     ("num_shared_experts", "always-on experts per MoE layer")):
  flags.DEFINE_integer(_name, None, _help + _preset(_name))
flags.DEFINE_enum("remat", None, list(REMATS), "rematerialise each block's activations in the "
                  "backward: none, full (keep its input) or dots (keep matmul outputs)"
                  + _preset("remat"))
flags.DEFINE_enum("moe_impl", None, list(MOE_IMPLS), "the MoE layer: sonic_jax, or the "
                  "MaxText-style baseline on jax.lax.ragged_dot (ragged_dot) or tokamax.ragged_dot "
                  "(tokamax_ragged_dot): one device, or data parallel with --expert_parallel=1, "
                  "with or without --fsdp" + _preset("moe_impl"))
flags.DEFINE_bool("scan_layers", None, "stack the blocks and scan over them (one block compiled)"
                  + _preset("scan_layers"))
flags.DEFINE_enum("attention", None, list(ATTENTIONS), "jax.nn.dot_product_attention's "
                  "implementation: auto (cuDNN where it runs, else XLA), xla or cudnn"
                  + _preset("attention"))
flags.DEFINE_bool("tie_embeddings", None, "output projection = input embedding transposed"
                  + _preset("tie_embeddings"))
flags.DEFINE_float("peak_tflops", None, "the device's peak TFLOP/s for MFU (default: bf16 dense "
                   "peak of a known GPU; none on a CPU)")
flags.DEFINE_integer("profile_step", 0, "trace this step (0: none) and split its device time into "
                     "MoE, attention, other layers, collectives and optimizer: printed and written "
                     "to workdir/profile_split.json, the trace under workdir/profile (the metrics "
                     "row that covers it times only the steps after it)")
flags.DEFINE_bool("tensorboard", True, "TensorBoard scalars under workdir/tb (needs tensorboardX)")
flags.DEFINE_integer("eval_batches", 8, "held-out batches per evaluation")
flags.DEFINE_enum("backend", None, ["auto", "xla", "mosaic_gpu"],
                  "sonic_jax backend" + _preset("backend"))
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                  "compute dtype; parameters stay float32" + _preset("dtype"))
flags.DEFINE_float("bias_update_rate", None, "auxiliary-loss-free balancing rate (0: off)"
                   + _preset("bias_update_rate"))
flags.DEFINE_enum("token_rounding", None, ["none", "down", "up", "nearest"],
                  "tile-aware token rounding of the MoE routers while training (evaluation uses "
                  "plain top-K)" + _preset("token_rounding"))
flags.DEFINE_integer("expert_parallel", 0, "expert-parallel degree P (0: one device): a mesh "
                     "(devices / P data, P ep) over all devices, experts sharded over ep, the "
                     "batch over both")
flags.DEFINE_enum("expert_parallel_scheme", "auto", ["auto", "all_to_all", "all_gather"],
                  "see sonic_jax.layers.MoE")
flags.DEFINE_float("capacity_factor", None, "expert capacity factor (default: dropless): each "
                   "expert keeps ceil(c*T*K/E) pairs of the tokens of one device (or, with the "
                   "all-gather scheme, of the ep axis); the all-to-all's slots hold c times the "
                   "balanced share under --expert_parallel")
flags.DEFINE_bool("fsdp", False, "shard parameters and optimizer state by their model-width axis "
                  "too: expert tensors over data, the rest over (data, ep) (needs "
                  "--expert_parallel >= 1)")
flags.DEFINE_bool("memcpy_p2p", False, "move collectives between this process's GPUs with their "
                  "copy engines (XLA's --xla_gpu_use_memcpy_local_p2p) instead of NCCL kernels: "
                  "for --expert_parallel=2 in one process (slower at 4: docs/design.md)")
flags.DEFINE_bool("distributed", False, "one process of a multi-process run (several hosts, or one "
                  "process per GPU): calls jax.distributed.initialize(), which finds the "
                  "coordinator, the process count and this process's index on SLURM, Open MPI and "
                  "other cluster environments, or takes the three flags below")
flags.DEFINE_string("coordinator_address", None, "--distributed: host:port of process 0")
flags.DEFINE_integer("num_processes", None, "--distributed: how many processes")
flags.DEFINE_integer("process_id", None, "--distributed: this process's index")
flags.DEFINE_integer("seed", 0, "initialisation and data order")
flags.DEFINE_bool("plot", True, "write loss.png at the end")
FLAGS = flags.FLAGS


MODEL_FLAGS = ("d_model", "num_layers", "num_heads", "num_experts", "expert_dim", "top_k",
               "num_shared_experts", "backend", "dtype", "bias_update_rate", "remat",
               "scan_layers", "moe_impl", "attention", "tie_embeddings")
# A multi-process run agrees on a stop request this often (and at log steps): each agreement
# waits for the step to finish, and a cluster's grace period after SIGTERM is often 30 s.
STOP_AGREEMENT_STEPS = 10
# Dense bf16 peak per GPU (TFLOP/s) by exact device kind: the PCIe and NVL cards (other "NVIDIA
# H100 ..." kinds, "NVIDIA H200 NVL") run lower clocks: pass --peak_tflops for them.
PEAK_TFLOPS = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H200": 989.0,
               "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100-SXM4-80GB": 312.0}


def say(*args, **kwargs):
  """print, from the first process only (every process of a multi-process run runs this script)."""
  if jax.process_index() == 0:
    print(*args, **{"flush": True, **kwargs})


def initialize_distributed():
  given = {k: getattr(FLAGS, k) for k in ("coordinator_address", "num_processes", "process_id")
           if getattr(FLAGS, k) is not None}
  if not FLAGS.distributed:
    if given:
      raise app.UsageError(f"--{', --'.join(given)} configure --distributed runs: pass "
                           "--distributed too")
    return
  # CPU devices of several processes talk through gloo (GPUs through NCCL, whatever this says).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(**given)
  except (ValueError, RuntimeError) as e:
    raise app.UsageError(f"--distributed: {e} (outside a cluster environment that JAX detects, "
                         "pass --coordinator_address, --num_processes and --process_id)") from e


def settings():
  s = dict(CONFIGS[FLAGS.config])
  for k in ("steps", "batch_size", "seq_len", "lr", "warmup", "eval_every", "corpus_bytes",
            "tokenizer", "vocab_size"):
    if getattr(FLAGS, k) is not None:
      s[k] = getattr(FLAGS, k)
  s.setdefault("tokenizer", "bytes")
  if s["tokenizer"] == "bytes":
    if FLAGS.vocab_size not in (None, 256):
      raise app.UsageError("--vocab_size is --tokenizer=bpe's (bytes are 256 tokens)")
    s["vocab_size"] = 256
  elif "vocab_size" not in s:
    raise app.UsageError("--tokenizer=bpe needs --vocab_size (its target vocabulary)")
  elif s["vocab_size"] < 257:
    raise app.UsageError(f"--vocab_size ({s['vocab_size']}) must be > 256 with --tokenizer=bpe: "
                         f"its vocabulary holds the 256 bytes and its merges")
  s["corpus_dir"] = FLAGS.corpus_dir
  s["log_every"] = s["eval_every"] if FLAGS.log_every is None else FLAGS.log_every
  s["checkpoint_every"] = (s["eval_every"] if FLAGS.checkpoint_every is None
                           else FLAGS.checkpoint_every)
  overrides = {k: getattr(FLAGS, k) for k in MODEL_FLAGS if getattr(FLAGS, k) is not None}
  if FLAGS.token_rounding is not None:
    overrides["token_rounding"] = None if FLAGS.token_rounding == "none" else FLAGS.token_rounding
  if FLAGS.capacity_factor is not None:
    if not 0 < FLAGS.capacity_factor < math.inf:
      raise app.UsageError(f"--capacity_factor must be > 0, got {FLAGS.capacity_factor}")
    overrides["capacity_factor"] = FLAGS.capacity_factor
  if FLAGS.expert_parallel:
    overrides.update(expert_parallel_axis="ep", expert_parallel_scheme=FLAGS.expert_parallel_scheme)
  elif FLAGS.expert_parallel_scheme != "auto":
    raise app.UsageError(f"--expert_parallel_scheme={FLAGS.expert_parallel_scheme} needs "
                         f"--expert_parallel=P")
  s["model"] = dataclasses.replace(s["model"], **overrides)
  if s["model"].moe_impl != "sonic_jax" and FLAGS.expert_parallel > 1:
    raise app.UsageError(f"--moe_impl={s['model'].moe_impl} has no expert parallelism: "
                         "--expert_parallel=1 (data parallel, optionally --fsdp) or 0")
  return s


def make_mesh():
  """(data, ep) mesh over all devices for --expert_parallel, else None."""
  p = FLAGS.expert_parallel
  if not p:
    if jax.device_count() > 1:
      say(f"{jax.device_count()} devices visible, training on one: --expert_parallel=P spreads "
          f"the run over all of them (1: data parallelism alone)")
    return None
  n = jax.device_count()
  if p < 0:
    raise app.UsageError(f"--expert_parallel must be >= 0 (0: one device), got {p}")
  if n % p:
    raise app.UsageError(f"--expert_parallel ({p}) must divide the number of devices ({n})")
  return jax.make_mesh((n // p, p), ("data", "ep"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def loss_fn(model, inputs, targets):
  logits, aux_loss, counts, dropped = model(inputs)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
  return ce + aux_loss, dict(ce=ce, aux=aux_loss, counts=counts, dropped=dropped)


# The model and optimizer buffers are donated: each step updates them in place.
@nnx.jit(donate_argnums=(0, 1), static_argnames="accum")
def train_step(model, optimizer, inputs, targets, accum=1):
  """One optimizer step on the batch, its gradient accumulated over `accum` micro-batches (rows
  i, i + accum, ... form micro-batch i, so each stays on the devices that hold its rows)."""
  grads, stats = None, []
  for i in range(accum):
    (_, st), g = nnx.value_and_grad(loss_fn, has_aux=True)(
        model, inputs[i::accum], targets[i::accum])
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    stats.append(st)
  if accum > 1:
    grads = jax.tree.map(lambda g: g / accum, grads)
  stats = {k: (jnp.sum if k in ("counts", "dropped") else jnp.mean)(
      jnp.stack([st[k] for st in stats]), axis=0) for k in stats[0]}
  with jax.named_scope("optimizer"):
    optimizer.update(model, grads)
  model.update_selection_biases(stats["counts"])  # after the step, outside the gradient
  return dict(stats, grad_norm=optax.global_norm(grads))


@nnx.jit
def eval_step(model, inputs, targets):
  logits = model(inputs)[0]
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def profile(model, optimizer, inputs, targets):
  """One train step under the profiler: its device time split by `step_profile`, printed and
  written to workdir/profile_split.json. Returns the step's outputs."""
  step = train_step.lower(model, optimizer, inputs, targets, accum=FLAGS.grad_accum).compile(
      compiler_options=step_profile.compiler_options(jax.default_backend()))
  names = step_profile.op_names(step.as_text())
  logdir = os.path.join(FLAGS.workdir, "profile", f"process_{jax.process_index()}")
  jax.profiler.start_trace(logdir)
  out = jax.block_until_ready(step(model, optimizer, inputs, targets))
  jax.profiler.stop_trace()
  result = step_profile.split(step_profile.kernel_events(logdir, "train_step"), names)
  if jax.process_index() == 0:
    with open(os.path.join(FLAGS.workdir, "profile_split.json"), "w") as f:
      json.dump(result, f, indent=1)
  say(f"{chr(10) if sys.stdout.isatty() else ''}step {FLAGS.profile_step}, device time by part "
      "(GPU 0, or CPU device 0's XLA thunks):\n"
      + step_profile.table(result))
  return out


def evaluate(model, heldout, token_bytes, s, put):
  """(nats per token, nats per byte) on fixed held-out windows: the second divides the windows'
  total loss by the bytes their target tokens spell."""
  model.eval()  # plain top-K routing (token rounding is for training)
  losses, nbytes = [], 0
  # In the training step's micro-batches (what fits in memory): the same windows, and the mean of
  # equal-sized batches' means, as whole batches would give.
  micro = s["batch_size"] // FLAGS.grad_accum
  for i, t in data.heldout_batches(heldout, micro, s["seq_len"],
                                   FLAGS.eval_batches * FLAGS.grad_accum):
    losses.append(float(eval_step(model, put(i), put(t))))
    nbytes += int(token_bytes[t].sum())
  model.train()
  tokens = len(losses) * micro * s["seq_len"]
  return float(np.mean(losses)), float(np.mean(losses)) * tokens / nbytes


# Losses and the unigram entropy in nats per token (per byte with --tokenizer=bytes); the
# *_nats_per_byte columns compare runs of different tokenizers.
METRICS = ["step", "train_loss", "aux_loss", "grad_norm", "lr", "tokens_per_s",
           "tokens_per_s_per_device", "mfu", "moe_tflops", "expert_load_max_over_mean",
           "dropped_pairs", "heldout_loss", "heldout_ppl", "unigram_entropy",
           "train_nats_per_byte", "heldout_nats_per_byte", "unigram_nats_per_byte"]


class StopRequest:
  """Set by SIGTERM or SIGINT: the loop checkpoints the step it has finished and exits. A second
  signal stops the process at once, as it would without this (no checkpoint)."""

  def __init__(self):
    self.signal = None
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    if self.signal is not None:
      signal.signal(signum, signal.SIG_DFL)
      signal.raise_signal(signum)
    self.signal = signal.Signals(signum).name


def open_metrics(path, start):
  """metrics.csv for appending, its rows past step `start` dropped first (a run that resumes from
  the checkpoint at `start` computes those steps again)."""
  rows = []
  if start and os.path.exists(path):
    with open(path, newline="") as f:
      rows = [r for r in csv.DictReader(f) if int(r["step"]) <= start]
  f = open(path, "w", newline="")
  writer = csv.DictWriter(f, fieldnames=METRICS, extrasaction="ignore")
  writer.writeheader()
  writer.writerows(rows)
  f.flush()
  return f, writer


def tensorboard(workdir, start):
  """A tensorboardX writer under workdir/tb (events past `start` purged on resume), or None."""
  if not FLAGS.tensorboard:
    return None
  try:
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("tensorboardX is not installed: no TensorBoard scalars (pip install tensorboardX)")
    return None
  logdir = os.path.join(workdir, "tb")
  if not start:  # a fresh run: an earlier run's events would draw beside its curves
    shutil.rmtree(logdir, ignore_errors=True)
  return SummaryWriter(logdir, purge_step=start + 1 if start else None)


def peak_flops():
  """The devices' peak FLOP/s each for MFU: --peak_tflops, else a known GPU's bf16 dense peak."""
  if FLAGS.peak_tflops:
    return FLAGS.peak_tflops * 1e12
  kind = jax.devices()[0].device_kind
  return PEAK_TFLOPS[kind] * 1e12 if kind in PEAK_TFLOPS else None


def run_config(s):
  """What the run was configured with, JSON-ready: saved beside and inside every checkpoint."""
  out = {k: v for k, v in s.items() if k != "model"}
  out.update(model=dataclasses.asdict(s["model"]), preset=FLAGS.config, seed=FLAGS.seed,
             tokenizer_path=tokenizer_path() if s["tokenizer"] == "bpe" else None,
             weight_decay=FLAGS.weight_decay, clip_norm=FLAGS.clip_norm,
             expert_parallel=FLAGS.expert_parallel, fsdp=FLAGS.fsdp, grad_accum=FLAGS.grad_accum)
  return out


# Settings that shape the parameters, the optimizer state or the token ids: a run resumed with
# another value would restore state that does not fit (or means something else).
STATE_SETTINGS = {"tokenizer", "vocab_size"} | {f"model.{k}" for k in (
    "vocab_size", "d_model", "num_layers", "num_heads", "num_experts", "expert_dim",
    "activation", "num_shared_experts", "tie_embeddings", "bias_update_rate", "scan_layers",
    "moe_impl")}


def refused_changes(saved, config, s, vocab_known=True):
  """(the changed settings, those of them a resume refuses): the state settings, and for a BPE
  run the corpus's digest and the vocabulary reached too (its tokenizer is trained on the corpus,
  so other text changes what the ids mean). Before the tokenizer is built (vocab_known False) the
  vocabularies are not compared: they are the tokenizer's."""
  bpe = {"corpus_digest", "tokenizer_vocab"} if s["tokenizer"] == "bpe" else set()
  state = STATE_SETTINGS | bpe
  if not vocab_known:
    state = state - {"model.vocab_size", "tokenizer_vocab"}
  changed = changed_settings(saved, config)
  return changed, [c for c in changed if c.split(":")[0] in state]


def changed_settings(saved, config):
  """["key: old -> new", ...] of the run configurations' differing entries (model fields as
  model.<field>)."""
  flat = lambda c: {**{k: v for k, v in c.items() if k != "model"},
                    **{f"model.{k}": v for k, v in c.get("model", {}).items()}}
  old, new = flat(saved), flat(json.loads(json.dumps(config)))  # tuples as the JSON's lists
  return [f"{k}: {old.get(k)} -> {new.get(k)}" for k in sorted(old.keys() | new.keys())
          if old.get(k) != new.get(k)]


def tokenizer_path():
  """Where a BPE run keeps its tokenizer beside its checkpoints (sample.py reads it)."""
  return os.path.abspath(os.path.join(FLAGS.workdir, "tokenizer.json"))


def tokenize(s, corpus):
  """(tokenizer, train ids, held-out ids, unigram entropy per token and per byte) of the run's
  corpus (uint8 bytes); a BPE is trained, and the splits tokenized, once per corpus and
  vocabulary (cached)."""
  train_bytes, heldout_bytes = data.split(corpus, 0.05)
  source = FLAGS.corpus_dir or "the standard library"
  if not len(train_bytes):  # before a tokenizer is trained on nothing
    raise app.UsageError(f"no corpus: {len(corpus)} bytes of .py source from {source} (check "
                         f"--corpus_dir and --corpus_bytes; directories named test, tests, "
                         f"site-packages, __pycache__ and idlelib are skipped)")
  cache = FLAGS.data_cache or os.path.join(FLAGS.workdir, "data_cache")

  def build():
    try:
      return tokenizer_lib.build(s["tokenizer"], train_bytes, heldout_bytes, s["vocab_size"],
                                 cache)
    except OSError as e:
      raise app.UsageError(f"--data_cache ({cache}): {e}") from e

  if jax.process_count() == 1:
    tok, train, heldout, info = build()
  else:  # the first process fills the cache; the others then load it (or, unshared, train alike)
    if jax.process_index() == 0:
      tok, train, heldout, info = build()
    multihost_utils.sync_global_devices("tokenizer built")
    if jax.process_index() != 0:
      tok, train, heldout, info = build()
  if tok.kind == "bpe":
    done = (f"trained in {info['train_seconds']:.1f} s, splits tokenized in "
            f"{info['tokenize_seconds']:.1f} s" if info["trained"] else "loaded from the cache")
    short = (f" (the target {s['vocab_size']} is not reached: pairs seen once are not merged; "
             f"a larger --corpus_dir gives more)" if tok.vocab_size < s["vocab_size"] else "")
    say(f"BPE: {tok.vocab_size} tokens{short}, {done} ({info['path']}); "
        f"{len(train_bytes) / len(train):.2f} bytes per token")
  h = data.unigram_entropy(train)
  h_byte = h * len(train) / len(train_bytes)
  kind = "BPE" if tok.kind == "bpe" else "byte"
  say(f"corpus {len(corpus) / 1e6:.1f} MB of .py source from {source}: {len(train)} training "
      f"and {len(heldout)} held-out {kind} tokens; unigram entropy {h:.3f} nats/token "
      f"({h_byte:.3f} nats/byte)")
  return tok, train, heldout, h, h_byte


def main(_):
  """absl's entry point. A refused setting exits 1 with its reason alone (absl would print this
  module's docstring before it)."""
  try:
    run()
  except app.UsageError as e:
    sys.exit(f"train.py: {e}")


def run():
  logging.set_verbosity(logging.WARNING)  # orbax logs every save and restore at INFO
  if FLAGS.memcpy_p2p:
    if FLAGS.distributed:
      raise app.UsageError("--memcpy_p2p moves data between one process's GPUs: not with "
                           "--distributed")
    # XLA reads its flags when JAX starts a backend, which nothing has done yet.
    os.environ["XLA_FLAGS"] = " ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                                     "--xla_gpu_use_memcpy_local_p2p=true")))
  initialize_distributed()
  lead = jax.process_index() == 0  # the process that writes metrics, config and plots
  s = settings()
  for k in ("steps", "batch_size", "seq_len", "corpus_bytes"):
    if s[k] < 1:
      raise app.UsageError(f"--{k} must be >= 1, got {s[k]}")
  if not 0 < s["lr"] < math.inf:
    raise app.UsageError(f"--lr must be > 0, got {s['lr']}")
  if not 0 <= s["warmup"] < s["steps"]:
    given = "" if FLAGS.warmup is not None else f", the {FLAGS.config} preset's: pass --warmup"
    raise app.UsageError(f"--warmup ({s['warmup']}{given}) must be in [0, --steps = "
                         f"{s['steps']})")
  if not 0 <= FLAGS.weight_decay < math.inf:
    raise app.UsageError(f"--weight_decay must be >= 0, got {FLAGS.weight_decay}")
  if FLAGS.corpus_dir is not None and not os.path.isdir(FLAGS.corpus_dir):
    raise app.UsageError(f"--corpus_dir: no such directory: {FLAGS.corpus_dir}")
  for k, low in (("eval_every", 1), ("log_every", 1), ("checkpoint_every", 0)):
    if s[k] < low:
      raise app.UsageError(f"--{k} must be >= {low}, got {s[k]}")
  if FLAGS.eval_batches < 1:
    raise app.UsageError(f"--eval_batches must be >= 1, got {FLAGS.eval_batches}")
  if not 0 <= FLAGS.clip_norm < math.inf:
    raise app.UsageError(f"--clip_norm must be >= 0 (0: no clipping), got {FLAGS.clip_norm}")
  if FLAGS.peak_tflops is not None and not 0 < FLAGS.peak_tflops < math.inf:
    raise app.UsageError(f"--peak_tflops must be > 0, got {FLAGS.peak_tflops}")
  for k in ("d_model", "num_layers", "num_heads", "num_experts", "expert_dim", "top_k"):
    if getattr(s["model"], k) < 1:
      raise app.UsageError(f"--{k} must be >= 1, got {getattr(s['model'], k)}")
  if not 0 <= FLAGS.profile_step <= s["steps"]:
    raise app.UsageError(f"--profile_step ({FLAGS.profile_step}) must be in [0, --steps = "
                         f"{s['steps']}] (0: no profile)")
  if FLAGS.grad_accum < 1 or s["batch_size"] % FLAGS.grad_accum:
    raise app.UsageError(f"--grad_accum ({FLAGS.grad_accum}) must be >= 1 and divide --batch_size "
                         f"({s['batch_size']})")
  d_model, heads = s["model"].d_model, s["model"].num_heads
  if d_model % heads or (d_model // heads) % 2:
    raise app.UsageError(f"--d_model ({d_model}) must be --num_heads ({heads}) times an even head "
                         "width (rotary embeddings rotate pairs of features)")
  try:  # before the tokenizer's work: a device that cannot run the attention or kernels asked for
    attention = check_device(s["model"])
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  try:  # the model's own checks, shapes only, before the tokenizer's work (minutes for a BPE)
    nnx.eval_shape(lambda: TransformerLM(dataclasses.replace(s["model"], vocab_size=256),
                                         rngs=nnx.Rngs(0)))
  except (ValueError, TypeError) as e:
    # The model's checks name its fields; those that flags of the same names set read as flags.
    # Only names with an underscore: the checks of the others already write them as flags
    # (--dtype, --attention=cudnn, --backend=mosaic_gpu), which a second "--" would break.
    names = [f.name for f in dataclasses.fields(s["model"]) if "_" in f.name and f.name in FLAGS]
    reason = re.sub(r"\b(%s)\b" % "|".join(names), r"--\1", str(e)) if names else str(e)
    raise app.UsageError(f"the model: {reason}") from e
  mesh = make_mesh()
  for flag in ("fsdp", "distributed", "memcpy_p2p"):
    if getattr(FLAGS, flag) and mesh is None:
      raise app.UsageError(f"--{flag} needs a mesh: --expert_parallel=P (1 for data parallelism "
                           "alone)")
  if mesh is not None and s["model"].num_experts % mesh.shape["ep"]:
    raise app.UsageError(f"--num_experts ({s['model'].num_experts}) must be a multiple of "
                         f"--expert_parallel ({mesh.shape['ep']})")
  if mesh is not None and s["batch_size"] % (mesh.size * FLAGS.grad_accum):
    raise app.UsageError(f"--batch_size ({s['batch_size']}) must be a multiple of the "
                         f"{mesh.size} devices times --grad_accum ({FLAGS.grad_accum}): each "
                         f"micro-batch splits over every device")
  try:
    os.makedirs(FLAGS.workdir, exist_ok=True)
  except OSError as e:
    raise app.UsageError(f"--workdir: {e}") from e
  ckpt_dir = os.path.abspath(os.path.join(FLAGS.workdir, "ckpt"))
  if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):  # orbax would train, then hang
    raise app.UsageError(f"--workdir: {ckpt_dir} is not a directory")
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  # --checkpoint_every=0 writes no checkpoint, so it makes no ckpt/ (a run there still resumes).
  ckpt = ocp.CheckpointManager(ckpt_dir,
                               item_names=("model", "optimizer", "config"),
                               options=ocp.CheckpointManagerOptions(
                                   max_to_keep=2, create=bool(s["checkpoint_every"])))
  try:  # closed however the run ends: its threads would outlive the exit and complain
    _train(s, ckpt, ocp, mesh, attention, lead)
  finally:
    ckpt.close()


def _train(s, ckpt, ocp, mesh, attention, lead):
  """The run after its flag checks: resume (or refuse to), tokenize, train, checkpoint."""
  start = ckpt.latest_step() or 0
  if jax.process_count() > 1:  # every process resumes where the first one does
    start = int(multihost_utils.broadcast_one_to_all(np.int32(start)))
  saved = None

  def refuse_resume(refused):
    # The BPE's corpus is known by its digest: say which flags choose it.
    text = [f"{r} (the text that --corpus_dir and --corpus_bytes choose)"
            if r.startswith("corpus_digest:") else r for r in refused]
    raise app.UsageError(
        f"--workdir={FLAGS.workdir} holds step {start} of another model or tokenizer "
        f"({'; '.join(text)}): pass a new --workdir, or the run's own settings")

  corpus = data.load_corpus(s["corpus_bytes"], s["corpus_dir"])
  # What a BPE is trained on, wherever it was read from (the standard library differs between
  # Python versions): a resume on other text is refused.
  s["corpus_digest"] = hashlib.sha256(corpus.tobytes()).hexdigest()[:16]
  if start:  # refused before the tokenizer's work, which would write into this workdir
    try:
      saved = ckpt.restore(start, args=ocp.args.Composite(config=ocp.args.JsonRestore()))[
          "config"]
    except (KeyError, ValueError, OSError) as e:  # another program's checkpoint, or a partial one
      raise app.UsageError(
          f"--workdir={FLAGS.workdir}: its checkpoint of step {start} holds no configuration "
          f"that train.py wrote ({type(e).__name__}: {e}): pass a new --workdir") from e
    _, refused = refused_changes(saved, run_config(s), s, vocab_known=False)
    if refused:
      refuse_resume(refused)
  tok, train, heldout, h_unigram, h_unigram_per_byte = tokenize(s, corpus)
  s["model"] = cfg = dataclasses.replace(
      s["model"], vocab_size=tokenizer_lib.padded_vocab(tok.vocab_size))
  s["tokenizer_vocab"] = tok.vocab_size
  config = run_config(s)
  if start:
    changed, refused = refused_changes(saved, config, s)
    if refused:
      refuse_resume(refused)
  if min(len(train), len(heldout)) <= s["seq_len"] + 1:
    raise app.UsageError(f"--seq_len ({s['seq_len']}) needs more tokens than the corpus's "
                         f"{len(heldout)} held-out ones: raise --corpus_bytes")
  routing = "".join(f", {name} {value}" for name, value in (
      ("token rounding", cfg.token_rounding), ("capacity factor", cfg.capacity_factor))
                     if value is not None)
  accum = f" in {FLAGS.grad_accum} micro-batches" if FLAGS.grad_accum > 1 else ""
  say(f"{jax.devices()[0].device_kind}; {attention} attention; model d={cfg.d_model}, "
      f"{cfg.num_layers} layers, {cfg.num_heads} heads, E={cfg.num_experts} experts of "
      f"n={cfg.expert_dim}, K={cfg.top_k}{routing}, vocabulary {cfg.vocab_size}, "
      f"{active_params(cfg) / 1e6:.1f}M active parameters (every setting goes to "
      f"{FLAGS.workdir}/config.json); {s['steps']} steps of {s['batch_size']} x {s['seq_len']} "
      f"tokens{accum}, lr {s['lr']:g}")
  # The warm-up's first update already moves the weights: lr / (warmup + 1), not 0.
  schedule = optax.warmup_cosine_decay_schedule(s["lr"] / (s["warmup"] + 1), s["lr"], s["warmup"],
                                                s["steps"], end_value=0.1 * s["lr"])
  tx = optax.chain(optax.clip_by_global_norm(FLAGS.clip_norm) if FLAGS.clip_norm else
                   optax.identity(),
                   optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=FLAGS.weight_decay))

  def create():
    model = TransformerLM(cfg, rngs=nnx.Rngs(FLAGS.seed))
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  devices = 1 if mesh is None else mesh.size  # the devices the step runs on
  put = jnp.asarray  # a host batch (the same on every process) -> the step's input array
  (model, optimizer), total = create_sharded(create, mesh, FLAGS.fsdp)
  if mesh is not None:
    mine = bytes_per_device(nnx.state((model, optimizer)))
    say(f"parameters and optimizer state: {mine / 1e6:.2f} of {total / 1e6:.2f} MB per device"
        f"{' (FSDP)' if FLAGS.fsdp else ''}")
    batch_sharding = NamedSharding(mesh, P(("data", "ep")))
    # Each process places the rows its devices hold, from the batch every process draws alike.
    put = lambda a: jax.make_array_from_callback(a.shape, batch_sharding, lambda i: a[i])
    jax.set_mesh(mesh)  # as a global setting: every jit below sees the mesh
    placed = ["experts over ep"] if mesh.shape["ep"] > 1 else []
    placed += ["expert tensors over data, the others over (data, ep) (FSDP)"] if FLAGS.fsdp else []
    say(f"mesh {dict(mesh.shape)}: {', '.join(placed + ['batch over (data, ep)'])}")

  if start:
    try:
      restored = ckpt.restore(start, args=ocp.args.Composite(
          model=ocp.args.StandardRestore(nnx.state(model)),
          optimizer=ocp.args.StandardRestore(nnx.state(optimizer))))
    except ValueError as e:  # parameters or optimizer state of another shape
      raise app.UsageError(
          f"--workdir={FLAGS.workdir} holds step {start} of a run whose state does not fit this "
          f"one (settings changed: {'; '.join(changed) or 'none'}): pass a new --workdir, or the "
          f"run's own settings ({e})") from e
    except KeyError as e:  # a checkpoint saved without an item (its optimizer state, say)
      raise app.UsageError(
          f"--workdir={FLAGS.workdir}: the checkpoint of step {start} has no {e} item to resume "
          f"training from (train.py writes the model's and the optimizer's)") from e
    nnx.update(model, restored["model"])
    nnx.update(optimizer, restored["optimizer"])
    say(f"resumed from step {start}" + (f" with changed settings: {'; '.join(changed)}"
                                        if changed else "")
        + ("; the learning-rate schedule follows the new --steps from here"
           if start < s["steps"] and any(c.startswith("steps:") for c in changed) else ""))
    if start >= s["steps"]:
      say(f"nothing to train: the run is at step {start} and --steps={s['steps']} (raise --steps "
          f"to continue it)")
    if 0 < FLAGS.profile_step <= start:
      say(f"--profile_step={FLAGS.profile_step} is at or before the resumed step: no profile")
  # After a resume's check: a refused run, or one with nothing to train, leaves the saved
  # config and tokenizer alone.
  if lead and start < s["steps"]:
    with open(os.path.join(FLAGS.workdir, "config.json"), "w") as f:
      json.dump(config, f, indent=1)
    if tok.kind == "bpe":
      tok.save(tokenizer_path())

  def save(step):
    ckpt.save(step, args=ocp.args.Composite(
        model=ocp.args.StandardSave(nnx.state(model)),
        optimizer=ocp.args.StandardSave(nnx.state(optimizer)),
        config=ocp.args.JsonSave(config)))

  if not start and os.path.exists(os.path.join(FLAGS.workdir, "metrics.csv")):
    say(f"no checkpoint in {FLAGS.workdir}: starting at step 0, the earlier run's metrics.csv and "
        f"tb/ replaced")
  log, writer = open_metrics(os.path.join(FLAGS.workdir, "metrics.csv"), start) if lead else (
      None, None)
  tb = tensorboard(FLAGS.workdir, start) if lead else None
  stop = StopRequest()
  tokens_per_step = s["batch_size"] * s["seq_len"]
  window_bytes = []  # the bytes each step's target tokens spell, for the loss per byte
  flops_per_token = model_flops_per_token(cfg, s["seq_len"])
  peak = peak_flops()
  # Step outputs stay on the device and the loop never waits for a step: the host syncs only at
  # log steps and after the step that compiles train_step, and a window's time runs from the end
  # of its first step (the compiling or profiled one, after a start) to that sync.
  window, window_t0, window_steps = [], None, 0
  compiled = False
  stopping = False
  for step in range(start, s["steps"]):
    inputs, targets = data.batch(train, s["batch_size"], s["seq_len"], FLAGS.seed, step)
    window_bytes.append(int(tok.token_bytes[targets].sum()))
    inputs, targets = put(inputs), put(targets)
    if step + 1 == FLAGS.profile_step:
      jax.block_until_ready(window)
      t0 = time.perf_counter()
      window.append(profile(model, optimizer, inputs, targets))
      window_t0, window_steps = time.perf_counter(), 0  # the window times the steps after it
      if not compiled:  # the training step compiles at its own first call (next line's log)
        say(f"step {step + 1} (compiled, profiled) took {window_t0 - t0:.1f} s")
    else:
      t0 = time.perf_counter()
      window.append(train_step(model, optimizer, inputs, targets, accum=FLAGS.grad_accum))
      if compiled:
        window_steps += 1
      else:  # the window times the steps after this one
        jax.block_until_ready(window[-1])
        window_t0, window_steps, compiled = time.perf_counter(), 0, True
        say(f"step {step + 1} (compiled, then run) took {window_t0 - t0:.1f} s")
    done = step + 1
    latest = window[-1]  # the last step's outputs, checked before a checkpoint
    if sys.stdout.isatty():  # a progress bar on terminals; logs get the metrics lines only
      bar = "#" * int(30 * done / s["steps"])
      say(f"\r[{bar:<30}] {done}/{s['steps']}", end="")
    stopping = stop.signal is not None  # read once: a later signal stops the next step
    if jax.process_count() > 1:  # all processes stop at one step, agreed every few steps
      stopping = (done % s["log_every"] == 0 or done % STOP_AGREEMENT_STEPS == 0) and bool(
          multihost_utils.process_allgather(np.int32(stopping)).any())
    last = done == s["steps"] or stopping
    if done % s["log_every"] == 0 or done % s["eval_every"] == 0 or last:
      stats = jax.device_get(window)  # the window's sync
      step_s = (time.perf_counter() - window_t0) / max(window_steps, 1)
      rate = tokens_per_step / step_s if window_steps else math.nan
      counts = np.asarray(stats[-1]["counts"], np.float64)  # (layers, E) of the last step
      load = counts.max(-1) / np.maximum(counts.mean(-1), 1e-9)
      train_loss = np.mean([t["ce"] for t in stats])
      row = dict(step=done, train_loss=train_loss,
                 train_nats_per_byte=train_loss * tokens_per_step * len(stats) / sum(window_bytes),
                 aux_loss=np.mean([t["aux"] for t in stats]), grad_norm=stats[-1]["grad_norm"],
                 lr=float(schedule(step)), tokens_per_s=rate,
                 tokens_per_s_per_device=rate / devices,
                 mfu=flops_per_token * rate / devices / peak if peak else math.nan,
                 moe_tflops=moe_flops_per_token(cfg) * rate / devices / 1e12,
                 expert_load_max_over_mean=load.max(),
                 dropped_pairs=sum(int(t["dropped"]) for t in stats),
                 unigram_entropy=h_unigram, unigram_nats_per_byte=h_unigram_per_byte)
      if done % s["eval_every"] == 0 or done == s["steps"]:
        row["heldout_loss"], row["heldout_nats_per_byte"] = evaluate(model, heldout,
                                                                     tok.token_bytes, s, put)
        row["heldout_ppl"] = math.exp(row["heldout_loss"])
      row = {k: float(v) if k != "step" else v for k, v in row.items()}
      if lead:
        writer.writerow(row)
        log.flush()
      if tb is not None:
        for k, v in row.items():
          if k != "step" and math.isfinite(v):
            tb.add_scalar(k, v, done)
        for layer, v in enumerate(load):
          tb.add_scalar(f"expert_load_max_over_mean/layer_{layer}", v, done)
        tb.flush()
      held = (f", held-out {row['heldout_loss']:.3f} ({row['heldout_nats_per_byte']:.3f} "
              f"nats/byte; ppl {row['heldout_ppl']:.2f}; unigram {h_unigram:.3f} nats/token)"
              if "heldout_loss" in row else "")
      mfu = "" if math.isnan(row["mfu"]) else f"MFU {row['mfu']:.3f}, "  # no peak: no MFU
      # A window of the compiling step alone has no rate: it is left out rather than shown as nan.
      speed = "" if math.isnan(rate) else (f"{rate:.0f} tokens/s, {mfu}MoE "
                                           f"{row['moe_tflops']:.3f} TFLOP/s, ")
      dropped = (f"dropped pairs {row['dropped_pairs']:.0f} over {len(stats)} steps, "
                 if s["model"].capacity_factor is not None else "")
      say(f"{chr(10) if sys.stdout.isatty() else ''}step {done}: train {row['train_loss']:.3f} "
          f"nats/token ({row['train_nats_per_byte']:.3f} nats/byte){held}, "
          f"aux {row['aux_loss']:.4f}, grad norm {row['grad_norm']:.3f}, {speed}{dropped}"
          f"expert load max/mean {load.max():.2f}")
      window, window_t0, window_steps, window_bytes = [], time.perf_counter(), 0, []
    if s["checkpoint_every"] and (done % s["checkpoint_every"] == 0 or last):
      # The checkpoints kept stay those of finite weights: the step's loss is of the weights
      # before its update, its gradient's norm says whether the update was finite.
      loss, norm = map(float, jax.device_get((latest["ce"], latest["grad_norm"])))
      if not (math.isfinite(loss) and math.isfinite(norm)):
        sys.exit(f"train.py: at step {done} the training loss is {loss} and the gradient's norm "
                 f"{norm}: stopped without a checkpoint (lower --lr, or keep --clip_norm > 0)")
      t_save = time.perf_counter()
      save(done)
      window_t0 += time.perf_counter() - t_save  # the rates count training, not checkpointing
    if stopping:
      say(f"{stop.signal or 'a stop request'}: "
          f"{'checkpoint at' if s['checkpoint_every'] else 'stopped after'} step {done}; exiting")
      break
  ckpt.wait_until_finished()
  peak_gib = peak_memory_gib()
  if peak_gib is not None:  # a GPU's allocator keeps the statistic; a CPU's does not
    say(f"peak device memory: {peak_gib:.2f} GiB (the most any of this process's devices held)")
  if lead:
    log.close()
  if tb is not None:
    tb.close()
  if FLAGS.plot and not stopping and lead:
    plot(os.path.join(FLAGS.workdir, "metrics.csv"), os.path.join(FLAGS.workdir, "loss.png"))


def peak_memory_gib() -> float | None:
  """The most memory any local device held at once during the run, in GiB (None where the
  runtime keeps no such statistic)."""
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2**30 if peaks else None


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
  # Per byte, comparable across tokenizers.
  steps = [int(r["step"]) for r in rows]
  held = [(int(r["step"]), float(r["heldout_nats_per_byte"])) for r in rows if r["heldout_loss"]]
  fig, ax = plt.subplots(figsize=(6, 4))
  ax.plot(steps, [float(r["train_nats_per_byte"]) for r in rows], label="train")
  ax.plot(*zip(*held), label="held-out")
  ax.axhline(float(rows[-1]["unigram_nats_per_byte"]), ls="--", c="gray",
             label="unigram entropy")
  ax.set_xlabel("step")
  ax.set_ylabel("nats / byte")
  ax.legend()
  fig.tight_layout()
  fig.savefig(png_path, dpi=100)
  plt.close(fig)


if __name__ == "__main__":
  app.run(main)
