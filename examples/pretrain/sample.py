r"""Generate text from a checkpoint of examples/pretrain/train.py.

  python examples/pretrain/sample.py --workdir=/tmp/run --prompt="def " --tokens=200
  python examples/pretrain/sample.py --workdir=/tmp/run --step=400 --temperature=0

Restores the model alone (not the optimizer) from the latest checkpoint in --workdir (or --step),
rebuilt from the configuration saved inside that checkpoint, and continues the prompt token by
token with the run's tokenizer (bytes, or the run's BPE from its saved tokenizer.json): top-K
routing (`model.eval()`), no token rounding, on one device. Each new token runs the model over a
fixed-length window (static shapes: one compilation) of the latest tokens, at most the run's
--seq_len: the positions the model was trained on.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import app, flags, logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import ATTENTIONS, ModelConfig, TransformerLM, check_device  # noqa: E402
import tokenizer as tokenizer_lib  # noqa: E402

flags.DEFINE_string("workdir", "/tmp/sonic_jax_pretrain", "the training run's --workdir")
flags.DEFINE_integer("step", None, "checkpoint step (default: the latest)")
flags.DEFINE_string("prompt", "def ", "text to continue (UTF-8 bytes)")
flags.DEFINE_integer("tokens", 200, "tokens to generate (bytes with --tokenizer=bytes runs)",
                     lower_bound=0)
flags.DEFINE_float("temperature", 0.8, "sampling temperature (>= 0); 0: greedy", lower_bound=0.0)
flags.DEFINE_integer("seed", 0, "sampling seed")
flags.DEFINE_enum("backend", None, ["auto", "xla", "mosaic_gpu"],
                  "sonic_jax backend (default: the training run's)")
flags.DEFINE_enum("attention", "auto", list(ATTENTIONS), "attention implementation (all compute "
                  "the same function: auto takes cuDNN where it runs)")
FLAGS = flags.FLAGS


def load_model(workdir, step=None, backend=None, attention="auto"):
  """(model, step, tokenizer, context): the model of a checkpoint, its parameters restored, the
  optimizer left out, the tokenizer it was trained with and its training sequence length."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  if not os.path.isdir(os.path.join(workdir, "ckpt")):  # the manager would create it
    raise app.UsageError(f"no checkpoint in {workdir}/ckpt (no such directory)")
  ckpt = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "ckpt")),
                               item_names=("model", "optimizer", "config"))
  if step is None:
    step = ckpt.latest_step()
    if step is None:
      raise app.UsageError(f"no checkpoint in {workdir}/ckpt")
  elif step not in ckpt.all_steps():
    raise app.UsageError(f"no checkpoint of step {step} in {workdir}/ckpt (it holds steps "
                         f"{sorted(ckpt.all_steps())})")
  try:
    config = ckpt.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
  except (KeyError, ValueError, OSError) as e:  # another program's checkpoint, or a partial one
    raise app.UsageError(f"the checkpoint of step {step} in {workdir}/ckpt holds no configuration "
                         f"that train.py wrote ({type(e).__name__}: {e})") from e
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  model_cfg = {k: v for k, v in config["model"].items() if k in fields}
  # One device: no expert-parallel mesh axis; no token rounding (evaluation routes top-K).
  model_cfg.update(expert_parallel_axis=None, capacity_factor=None, remat="none",
                   attention=attention)
  if backend is not None:
    model_cfg["backend"] = backend
  cfg = ModelConfig(**model_cfg)
  try:  # a device that cannot run the attention or the kernels asked for: one line, not a trace
    check_device(cfg)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  abstract = nnx.eval_shape(lambda: TransformerLM(cfg, rngs=nnx.Rngs(0)))
  graph, state = nnx.split(abstract)
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_device),
                        state)
  restored = ckpt.restore(step, args=ocp.args.Composite(model=ocp.args.StandardRestore(target)))
  model = nnx.merge(graph, restored["model"])
  model.eval()
  kind, path = config.get("tokenizer", "bytes"), config.get("tokenizer_path")
  if kind == "bpe" and not (path and os.path.exists(path)):  # the workdir was moved
    path = os.path.join(workdir, "tokenizer.json")
  return model, step, tokenizer_lib.load(kind, path), int(config["seq_len"])


def generate(model, tok, prompt: bytes, num_tokens: int, temperature: float, seed: int,
             context: int) -> bytes:
  """The prompt's continuation, `num_tokens` tokens sampled one at a time, as bytes; the model
  sees the latest `context` tokens at most."""
  ids = [int(i) for i in tok.encode(prompt)]
  if not ids:
    raise app.UsageError("--prompt must not be empty")
  length = min(len(ids) + num_tokens, context)

  @nnx.jit
  def next_token(model, window, position, key):
    # The embedding's padding rows past the tokenizer's vocabulary are never sampled.
    logits = model(window)[0][0, position - 1, :tok.vocab_size]
    if temperature == 0:
      return jnp.argmax(logits).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

  key = jax.random.key(seed)
  out = list(ids)
  for _ in range(num_tokens):
    recent = out[-length:]  # left-aligned; the causal model ignores the zeros after it
    window = np.zeros((1, length), np.int32)
    window[0, :len(recent)] = recent
    key, sub = jax.random.split(key)
    out.append(int(next_token(model, jnp.asarray(window), len(recent), sub)))
  return tok.decode(np.asarray(out[len(ids):], np.int32))


def main(_):
  logging.set_verbosity(logging.WARNING)
  prompt = FLAGS.prompt.encode()
  try:  # a refusal exits 1 with its reason alone (absl would print this module's docstring first)
    model, step, tok, context = load_model(FLAGS.workdir, FLAGS.step, FLAGS.backend,
                                           FLAGS.attention)
    text = generate(model, tok, prompt, FLAGS.tokens, FLAGS.temperature, FLAGS.seed, context)
  except app.UsageError as e:
    sys.exit(f"sample.py: {e}")
  print(f"[step {step}] " + (prompt + text).decode("utf-8", errors="replace"))


if __name__ == "__main__":
  app.run(main)
