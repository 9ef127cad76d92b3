"""A decoder-only transformer LM whose feed-forward layers are sonic_jax MoE layers (Flax NNX)."""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp

from sonic_jax.activations import get_activation
from sonic_jax.backends import resolve_backend
from sonic_jax.layers import MoE

from ragged_moe import RaggedDotMoE


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int = 256
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_experts: int = 8
  expert_dim: int = 64
  top_k: int = 2
  activation: str = "swiglu"
  num_shared_experts: int = 0
  tie_embeddings: bool = True
  rope_base: float = 10000.0
  # jax.nn.dot_product_attention's implementation: "xla", "cudnn" (fused flash attention), or
  # "auto": cuDNN where it takes the device, dtype and head dim (`attention_implementation`).
  attention: str = "auto"
  load_balance_coef: float = 0.01
  z_loss_coef: float = 1e-3
  bias_update_rate: float = 0.0
  token_rounding: str | None = None  # "down", "up", "nearest": in training only (model.train())
  backend: str = "auto"
  dtype: str = "float32"  # compute dtype; parameters are float32
  expert_parallel_axis: str | None = None  # a mesh axis: experts sharded over it (jax.set_mesh)
  expert_parallel_scheme: str = "auto"
  capacity_factor: float | None = None
  # Activation rematerialisation of each block in the backward: "none", "full" (keep only the
  # block's input) or "dots" (keep the matmul outputs without batch dimensions).
  remat: str = "none"
  # The blocks' parameters stacked on a leading "layers" axis and the forward a scan over them (one
  # block traced and compiled, not num_layers); otherwise a Python loop over a list of blocks,
  # whose compile time grows with num_layers (minutes at 32) but which runs faster: the scan
  # zero-fills its stacked residual buffers and copies slices in and out of them
  # (docs/decisions.md).
  scan_layers: bool = False
  # The MoE layer: "sonic_jax" (`sonic_jax.layers.MoE`), or `ragged_moe.RaggedDotMoE`, the
  # MaxText-style baseline (plain top-K routing, no expert parallelism) on jax.lax.ragged_dot
  # ("ragged_dot") or tokamax.ragged_dot ("tokamax_ragged_dot").
  moe_impl: str = "sonic_jax"


def rope(x, base):
  """Rotary position embedding on (batch, seq, heads, head_dim)."""
  _, seq, _, dim = x.shape
  half = dim // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None]
  cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).astype(x.dtype)


def param(value, *names):
  """A parameter with logical axis names (sharding metadata, `nnx.get_partition_spec`), as
  `sonic_jax.layers.MoE` names its own: "embed" for the model width; `sharding.shard_spec` maps
  them to mesh axes."""
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def whole(p):
  """A parameter's value gathered whole where it is used (FSDP stores it sharded): under a mesh
  the constraint makes XLA all-gather the weight rather than reshard the activations."""
  value = p[...]
  if jax.sharding.get_abstract_mesh().empty:
    return value
  return jax.lax.with_sharding_constraint(value, jax.sharding.PartitionSpec())


class RMSNorm(nnx.Module):
  def __init__(self, dim, *, rngs):
    del rngs
    self.scale = param(jnp.ones((dim,), jnp.float32), "embed")

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * whole(self.scale)
    return y.astype(x.dtype)


ATTENTIONS = ("auto", "xla", "cudnn")


def _cudnn_unsupported(dtype, head_dim: int, device) -> str | None:
  """Why jax 0.11's cuDNN attention cannot run this, or None. Its checks
  (jax/_src/cudnn/fused_attention_stablehlo.py): fp16/bf16 inputs (fp8 aside), a head dim that is
  a multiple of 8 and at most 256 on Hopper and later (128 before); cuDNN's fused flash attention
  itself needs an NVIDIA GPU of compute capability 8.0 (Ampere) or later."""
  try:  # CUDA devices report "major.minor"; CPUs have none, ROCm devices a gfx name
    cc = tuple(int(v) for v in str(device.compute_capability).split("."))
  except (AttributeError, ValueError):
    cc = None
  if device.platform != "gpu" or cc is None:
    return f"an NVIDIA GPU (this device is {device.platform}: {device.device_kind})"
  if cc < (8, 0):
    return f"compute capability 8.0 or later ({device.device_kind} has {device.compute_capability})"
  if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
    return f"bfloat16 or float16 compute (--dtype), got {jnp.dtype(dtype).name}"
  limit = 256 if cc >= (9, 0) else 128
  if head_dim % 8 or head_dim > limit:
    return f"a head dim that is a multiple of 8 and at most {limit}, got {head_dim}"
  return None


def attention_implementation(cfg: ModelConfig, device=None) -> str:
  """The `implementation` of jax.nn.dot_product_attention for cfg.attention on `device` (default:
  the first device): "auto" takes cuDNN where it runs (jax's own default is XLA, which
  materialises the (S, S) scores), "cudnn" where it cannot raises naming what is missing."""
  if cfg.attention not in ATTENTIONS:
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {cfg.attention!r}")
  if cfg.attention == "xla":
    return "xla"
  reason = _cudnn_unsupported(cfg.dtype, cfg.d_model // cfg.num_heads,
                              jax.devices()[0] if device is None else device)
  if reason is None:
    return "cudnn"
  if cfg.attention == "cudnn":
    raise ValueError(f"--attention=cudnn needs {reason}; use --attention=auto or xla")
  return "xla"


def check_device(cfg: ModelConfig) -> str:
  """The attention implementation for cfg on this device (`attention_implementation`), after
  checking that the device runs what cfg asks for: a ValueError naming the flag otherwise."""
  attention = attention_implementation(cfg)
  if cfg.backend == "mosaic_gpu":
    try:
      resolve_backend("mosaic_gpu")
    except ValueError as e:
      device = jax.devices()[0]
      raise ValueError(f"--backend=mosaic_gpu needs an sm90 (Hopper) GPU, this device is "
                       f"{device.device_kind} ({device.platform}): use --backend=auto or "
                       f"xla") from e
  return attention


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs):
    init = nnx.initializers.normal(cfg.d_model ** -0.5)
    self.cfg = cfg
    if cfg.d_model % cfg.num_heads:
      raise ValueError(f"d_model ({cfg.d_model}) must be a multiple of num_heads "
                       f"({cfg.num_heads})")
    self.implementation = attention_implementation(cfg)
    self.qkv = param(init(rngs.params(), (cfg.d_model, 3 * cfg.d_model)), "embed", "heads")
    self.out = param(init(rngs.params(), (cfg.d_model, cfg.d_model)) / (2 * cfg.num_layers) ** 0.5,
                     "heads", "embed")

  def __call__(self, x):
    b, s, d = x.shape
    h = self.cfg.num_heads
    q, k, v = jnp.split(x @ whole(self.qkv).astype(x.dtype), 3, axis=-1)
    q, k, v = (t.reshape(b, s, h, d // h) for t in (q, k, v))
    q, k = rope(q, self.cfg.rope_base), rope(k, self.cfg.rope_base)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.implementation)
    return o.reshape(b, s, d) @ whole(self.out).astype(x.dtype)


MOE_IMPLS = ("sonic_jax", "ragged_dot", "tokamax_ragged_dot")


def _ragged_dot_unsupported(cfg: ModelConfig) -> str | None:
  """Why the ragged_dot baseline cannot build this model, or None."""
  for field, plain in (("activation", "swiglu"), ("num_shared_experts", 0),
                       ("bias_update_rate", 0.0), ("token_rounding", None),
                       ("capacity_factor", None)):
    if getattr(cfg, field) != plain:
      takes = "it unset" if plain is None else repr(plain)
      return f"{field}={getattr(cfg, field)!r} (the baseline takes {takes})"
  return None


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs):
    self.norm1, self.norm2 = RMSNorm(cfg.d_model, rngs=rngs), RMSNorm(cfg.d_model, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    if cfg.moe_impl not in MOE_IMPLS:
      raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {cfg.moe_impl!r}")
    if cfg.moe_impl != "sonic_jax":
      reason = _ragged_dot_unsupported(cfg)
      if reason is not None:
        raise ValueError(f"moe_impl={cfg.moe_impl!r} does not take {reason}")
      self.moe = RaggedDotMoE(cfg.d_model, cfg.num_experts, cfg.expert_dim, cfg.top_k,
                              init_std=cfg.d_model ** -0.5,
                              load_balance_coef=cfg.load_balance_coef,
                              z_loss_coef=cfg.z_loss_coef, dtype=jnp.dtype(cfg.dtype),
                              sharded=cfg.expert_parallel_axis is not None,
                              ragged_dot="lax" if cfg.moe_impl == "ragged_dot" else "tokamax",
                              rngs=rngs)
      return
    self.moe = MoE(cfg.d_model, cfg.num_experts, cfg.expert_dim, cfg.top_k,
                   activation=cfg.activation, num_shared_experts=cfg.num_shared_experts,
                   load_balance_coef=cfg.load_balance_coef, z_loss_coef=cfg.z_loss_coef,
                   bias_update_rate=cfg.bias_update_rate, token_rounding=cfg.token_rounding,
                   init_std=cfg.d_model ** -0.5,
                   expert_parallel_axis=cfg.expert_parallel_axis,
                   expert_parallel_scheme=cfg.expert_parallel_scheme,
                   capacity_factor=cfg.capacity_factor,
                   dtype=jnp.dtype(cfg.dtype), backend=cfg.backend, rngs=rngs)

  def __call__(self, x):
    # Named scopes travel into the compiled step's op names: step_profile splits a trace by them.
    with jax.named_scope("attention"):
      x = x + self.attn(self.norm1(x))
    with jax.named_scope("moe"):
      y, aux = self.moe(self.norm2(x))
    return x + y, aux


class TransformerLM(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    # Std 1 although, tied, the first loss is then about 8 nats (each token's own logit near
    # sqrt(d)): it trains to a lower loss than a smaller std (docs/decisions.md).
    self.embed = param(nnx.initializers.normal(1.0)(rngs.params(), (cfg.vocab_size, cfg.d_model)),
                       "vocab", "embed")
    if cfg.scan_layers:
      @nnx.split_rngs(splits=cfg.num_layers)
      @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
      def stacked(rngs):
        return Block(cfg, rngs=rngs)

      self.blocks = stacked(rngs)
    else:
      self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.d_model, rngs=rngs)
    self.unembed = nnx.data(None if cfg.tie_embeddings else param(
        nnx.initializers.normal(cfg.d_model ** -0.5)(rngs.params(), (cfg.d_model, cfg.vocab_size)),
        "embed", "vocab"))

  def __call__(self, tokens):
    """tokens (batch, seq) -> (logits float32 (batch, seq, vocab), aux loss, expert counts
    (layers, E), dropped pairs () summed over the layers)."""
    dtype = jnp.dtype(self.cfg.dtype)
    x = whole(self.embed)[tokens].astype(dtype)

    def layer(block, x):
      x, aux = block(x)
      return x, (aux.loss, aux.stats.expert_counts, aux.stats.dropped_pairs)

    if self.cfg.remat != "none":
      policy = (None if self.cfg.remat == "full"
                else jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
      layer = nnx.remat(layer, policy=policy)
    if self.cfg.scan_layers:
      x, (losses, counts, dropped) = nnx.scan(
          layer, in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0),
          transform_metadata={nnx.PARTITION_NAME: "layers"})(self.blocks, x)
    else:
      outs = []
      for block in self.blocks:
        x, out = layer(block, x)
        outs.append(out)
      losses, counts, dropped = (jnp.stack(o) for o in zip(*outs))
    aux_loss, dropped = jnp.sum(losses), jnp.sum(dropped)
    x = self.norm(x)
    w = (whole(self.embed).T * self.cfg.d_model ** -0.5 if self.unembed is None
         else whole(self.unembed))
    logits = output_logits(x, w.astype(dtype))
    return logits, aux_loss, counts, dropped

  def update_selection_biases(self, counts):
    """Each layer's auxiliary-loss-free balancing step from its expert counts (layers, E)."""
    if self.cfg.scan_layers:
      nnx.vmap(lambda block, c: block.moe.update_selection_bias(c), in_axes=(0, 0),
               transform_metadata={nnx.PARTITION_NAME: "layers"})(self.blocks, counts)
    else:
      for block, c in zip(self.blocks, counts):
        block.moe.update_selection_bias(c)


REMATS = ("none", "full", "dots")


@jax.custom_vjp
def output_logits(x, w):
  """x (..., d) @ w (d, V) with float32 logits, for a float32 softmax. The backward casts the
  logits' float32 cotangent to x's dtype, as mixed-precision autocast does, so both gradient GEMMs
  run at the 16-bit rate; autodiff of the product would run them in float32 (TF32 on a GPU)."""
  return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _output_logits_fwd(x, w):
  return output_logits(x, w), (x, w)


def _output_logits_bwd(residuals, g):
  x, w = residuals
  g = g.astype(x.dtype)
  d_x = jnp.dot(g, w.T, preferred_element_type=jnp.float32).astype(x.dtype)
  d_w = jnp.einsum("...d,...v->dv", x, g, preferred_element_type=jnp.float32).astype(w.dtype)
  return d_x, d_w


output_logits.defvjp(_output_logits_fwd, _output_logits_bwd)


def _width(cfg: ModelConfig) -> int:
  """w1's width in units of n: 2 for a GLU (gate and up), else 1."""
  return get_activation(cfg.activation).width_multiplier()


def active_params(cfg: ModelConfig) -> int:
  """Parameters a token's forward multiplies with, embeddings' lookup excluded but the output
  projection (tied or not) included: per layer attention 4 d^2, the router d E, K routed and the
  shared experts' (2 or 3) d n each."""
  expert = (1 + _width(cfg)) * cfg.d_model * cfg.expert_dim
  per_layer = (4 * cfg.d_model ** 2 + cfg.d_model * cfg.num_experts
               + (cfg.top_k + cfg.num_shared_experts) * expert)
  return cfg.num_layers * per_layer + cfg.d_model * cfg.vocab_size


def model_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token, PaLM's count: 6 N_active + 12 L d S (the attention scores and
  values over the whole sequence, causal masking not discounted)."""
  return 6 * active_params(cfg) + 12 * cfg.num_layers * cfg.d_model * seq_len


def moe_flops_per_token(cfg: ModelConfig) -> float:
  """Forward + backward FLOPs of the routed experts per token (the paper's count: 3 x 6 K d n;
  the router and shared experts not counted)."""
  return 3 * 2 * (1 + _width(cfg)) * cfg.top_k * cfg.d_model * cfg.expert_dim * cfg.num_layers
