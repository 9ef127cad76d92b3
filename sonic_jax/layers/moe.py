"""`MoE`: a Flax NNX module that holds the parameters and calls `sonic_jax.moe` (or, under expert
parallelism, `sonic_jax.parallel`'s ops)."""

from __future__ import annotations

import inspect
import math
import numbers
from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp

from sonic_jax import activations as acts
from sonic_jax import backends
from sonic_jax import routing as routing_lib
from sonic_jax.batching import split_axes, whole
from sonic_jax.checks import check_capacity, check_rounding
from sonic_jax.config import Config, check_config
from sonic_jax.layout import check_integer_array
from sonic_jax.ops import MoEAux, moe
from sonic_jax.parallel import (EXPERT_PARALLEL_SCHEMES, moe_all_gather, moe_all_to_all,
                                resolve_scheme)
from sonic_jax.precision import dot_f32
from sonic_jax.varying import varying_axes

Array = jax.Array
P = jax.sharding.PartitionSpec


def _axes(*parts) -> list[str]:
  """The mesh axes that PartitionSpec entries name, in order (each None, an axis or a tuple)."""
  return [a for part in parts if part for a in (part if isinstance(part, tuple) else (part,))]


def _constrain(x, spec, mesh):
  """Puts x in `spec` before a shard_map: `reshard` on explicit axes, a constraint on auto ones."""
  names = _axes(*spec)
  explicit = jax.sharding.AxisType.Explicit
  if all(mesh.axis_types[mesh.axis_names.index(a)] == explicit for a in names):
    return jax.sharding.reshard(x, spec)
  return jax.lax.with_sharding_constraint(x, spec)


def _flatten(x):
  """x (..., c) as rows (T, c), tokens in order. On an explicit mesh a plain reshape merges the
  leading dims only where none but the first is sharded; otherwise (the sequence sharded, say)
  the merged dim is sharded over the leading dims' axes in order, and the last dim keeps its."""
  spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
  if x.ndim > 2 and any(p is not None for p in spec[1:x.ndim - 1]):
    return jax.lax.reshape(x, (math.prod(x.shape[:-1]), x.shape[-1]),
                           out_sharding=P(tuple(_axes(*spec[:x.ndim - 1])), spec[x.ndim - 1]))
  return x.reshape(-1, x.shape[-1])


def _unflatten(y, lead, x):
  """The layer's output y (T, d) as x's leading dims `lead`, in x's sharding (on an Explicit mesh
  the layer's shard_map may return y split over more axes, or other ones: `x + y` needs them
  equal). A reshape splits a token dimension sharded over n devices only where the first leading
  dim is a nonzero multiple of n; otherwise it reshards as it reshapes."""
  shape = (*lead, y.shape[-1])
  x_spec = jax.typeof(x).sharding.spec
  spec = jax.typeof(y).sharding.spec
  if len(lead) > 1 and len(spec) and spec[0] is not None:
    mesh = jax.sharding.get_abstract_mesh()
    n = math.prod(mesh.shape[a] for a in _axes(spec[0]))
    if lead[0] == 0 or lead[0] % n:
      return jax.lax.reshape(y, shape, out_sharding=x_spec)
  y = y.reshape(shape)
  if _explicit_spec(x_spec) != _explicit_spec(jax.typeof(y).sharding.spec):
    y = jax.sharding.reshard(y, x_spec)
  return y


def _explicit_spec(spec) -> tuple:
  """A PartitionSpec's entries as a tuple of axis tuples, trailing Nones dropped."""
  entries = [tuple(_axes(e)) for e in spec]
  while entries and not entries[-1]:
    entries.pop()
  return tuple(entries)


class SelectionBias(nnx.Variable):
  """Per-expert selection bias of auxiliary-loss-free balancing: not an `nnx.Param`, so optimizers
  (`nnx.Optimizer(..., wrt=nnx.Param)`) leave it alone; `MoE.update_selection_bias` moves it."""


class MoELayerAux(NamedTuple):
  """What `MoE.__call__` returns beside the output.

  Attributes:
    loss: () load_balance_coef * (the balance loss) + z_loss_coef * z_loss: add it to yours.
    stats: the op's `sonic_jax.MoEAux`: routing results, counts and the unweighted losses (its
      load_balance_loss is the one in `loss`).
  """

  loss: Array
  stats: MoEAux


def _param(rngs, init, shape, dtype, names):
  # Logical axis names as sharding metadata (`nnx.get_partition_spec`); no eager sharding, so the
  # module builds without a mesh and users map the names with their own rules.
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=names, eager_sharding=False)


class MoE(nnx.Module):
  """A token-choice Mixture-of-Experts feed-forward layer (SonicMoE's algorithm).

  Args:
    d_model: d. num_experts: E. expert_dim: n (each expert's intermediate width). top_k: K.
    activation, routing, gate_up_layout, backend, config: as `sonic_jax.moe` (routing: a preset
      name or a `sonic_jax.Router`: scores, renormalisation, n_group / topk_group, routed
      scaling factor, Llama 4's input scaling).
    use_bias: per-expert biases b1, b2.
    use_router_bias: a trainable (E,) bias of the router's logits (gpt-oss).
    router_norm_eps: None, or the router sees its input RMS-normalised with this epsilon (> 0),
      times a trained (d,) scale (the parameter `router_scale`) and d ** -0.5, in float32 (Gemma
      4's router, which normalises the block's input on its own: pass that input as
      `router_input`).
    use_expert_scale: each pair's weight times a trained (E,) scale of its expert (the parameter
      `expert_scale`, ones at init; Gemma 4's per-expert scale).
    fixed_selection: every call gives its selection as `expert_ids` (DeepSeek-V4's hash-routed
      layers; a call without refuses).
    num_shared_experts: always-on experts (DeepSeek/Qwen-MoE style), one dense MLP of width
      num_shared_experts * shared_expert_dim (default expert_dim) added to the routed output.
    shared_expert_gate: the shared output is multiplied by sigmoid(x @ shared_gate), a learned
      scalar gate per token (the parameter `shared_gate`, (d, 1); Qwen2-MoE, Qwen3-Next).
    load_balance_coef, z_loss_coef: weights of the auxiliary losses in `aux.loss`.
    balance_loss: "batch" (Switch: E * sum_e f_e P_e over all the call's tokens) or "sequence"
      (DeepSeek-V2/V3, MaxText: the same per sequence, averaged; x must be (B, S, d); not with
      expert_parallel_axis). "sequence" counts the router's token-choice pairs, "batch" the
      pairs after token rounding; neither loses the pairs a capacity drops.
    bias_update_rate: > 0 enables auxiliary-loss-free balancing: a `SelectionBias` that moves the
      selection, updated by `update_selection_bias` outside the gradient.
    token_rounding: None, "down", "up" or "nearest": tile-aware token rounding while training
      (`sonic_jax.moe`; not with a capacity_factor); evaluation (`deterministic=True`, e.g. after
      `model.eval()`) routes with plain top-K.
    deterministic: evaluation mode (NNX's `model.eval()` / `model.train()` set it).
    expert_parallel_axis: a mesh axis name: experts are sharded over it. Either call the layer
      inside your own `jax.shard_map` (or `nnx.shard_map`) that binds that axis, with the expert
      parameters (those with `expert_axis` first) sharded over it and x's tokens over it too (and
      over any data axes); or call it in a plain `jax.jit` program under `jax.set_mesh(mesh)`: the
      layer then wraps its routed experts in a shard_map of its own over `token_axes` (explicit or
      auto mesh axes), and its aux carries per-token fields sharded like the tokens, counts and the
      z-loss over all tokens, and the balance loss averaged over the data shards' (as in
      data-parallel training; no extra-pair lists). Token rounding rounds each data shard's
      tokens on its own (all of the expert axis's together), as data-parallel replicas would.
    token_axes: the mesh axes that shard the tokens in that second case (default: all axes of the
      mesh but those a surrounding shard_map made manual; they must include the expert axis).
      Without expert_parallel_axis, under `jax.set_mesh` the layer is data parallel over
      token_axes (default: the Explicit axes that split x's tokens in its type; on Auto axes
      give them): a shard_map of its own routes each shard's tokens on its own, experts
      replicated, its aux as above. Otherwise the whole call's tokens are routed together.
    expert_parallel_scheme: "auto" (default), "all_to_all" (`sonic_jax.parallel.moe_all_to_all`) or
      "all_gather" (`moe_all_gather`). "auto" (`sonic_jax.parallel.resolve_scheme`, at each call,
      from the expert axis's size P) is the scheme that moves fewer rows: "all_gather" when
      dropless (all-to-all's dropless slots hold the worst case) or while P < capacity_factor *
      top_k, "all_to_all" beyond, whose traffic stays flat as the axis grows; the all-gather is
      the faster one on 2 and 4 GPUs (docs/decisions.md). The attribute keeps the name given.
    capacity_factor: None (dropless) or a finite number c > 0: on one device each expert keeps at
      most ceil(c * T * K / E) pairs, the first in token order (Switch, MaxText), as it does over
      the expert-parallel axis's tokens with the all-gather scheme; with the all-to-all each
      (sender, receiver) slot holds c times the balanced share. Dropped pairs are counted in
      `aux.stats.dropped_pairs`.
    init_std: std of the expert weights' normal init (router_init_std for the router, default the
      same). dtype: compute dtype (default: x's); param_dtype: storage dtype of the parameters.
      The router weight is used as stored (not cast to `dtype`): float32 storage keeps the router
      GEMM in float32; with 16-bit storage and compute it runs 16-bit, backward included.
      router_param_dtype: storage dtype of the router's parameters (router, router_bias,
      router_scale, expert_scale; default param_dtype): float32 with a 16-bit param_dtype keeps
      the router in float32 while the experts store 16-bit weights.
    Axis names (sharding metadata): expert_axis, embed_axis, mlp_axis.
    rngs: an `nnx.Rngs` (keyword only), whose `params` stream initialises the parameters.
  """

  def __init__(self, d_model: int, num_experts: int, expert_dim: int, top_k: int, *,
               activation: str | acts.Activation = "swiglu",
               routing: str | routing_lib.Router = "softmax_topk",
               gate_up_layout: str = "concat", use_bias: bool = False,
               use_router_bias: bool = False,
               router_norm_eps: float | None = None, use_expert_scale: bool = False,
               fixed_selection: bool = False,
               num_shared_experts: int = 0, shared_expert_dim: int | None = None,
               shared_expert_gate: bool = False,
               load_balance_coef: float = 0.01, z_loss_coef: float = 1e-3,
               balance_loss: str = "batch",
               bias_update_rate: float = 0.0, token_rounding: str | None = None,
               deterministic: bool = False, expert_parallel_axis: str | None = None,
               expert_parallel_scheme: str = "auto", capacity_factor: float | None = None,
               token_axes: tuple[str, ...] | None = None,
               init_std: float = 0.02,
               router_init_std: float | None = None, dtype=None, param_dtype=jnp.float32,
               router_param_dtype=None,
               backend: str = "auto", config: Config | None = None,
               expert_axis: str | None = "expert",
               embed_axis: str | None = "embed", mlp_axis: str | None = "mlp", rngs: nnx.Rngs):
    # Everything a call would refuse is refused here, eval-mode-only paths included.
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
    for name, value in (("use_bias", use_bias), ("use_router_bias", use_router_bias),
                        ("use_expert_scale", use_expert_scale),
                        ("fixed_selection", fixed_selection),
                        ("shared_expert_gate", shared_expert_gate),
                        ("deterministic", deterministic)):
      if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    act = acts.get_activation(activation)
    for name, value, least in (("d_model", d_model, 1), ("expert_dim", expert_dim, 1),
                               ("num_experts", num_experts, 1),
                               ("num_shared_experts", num_shared_experts, 0)):
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
      if value < least:
        raise ValueError(f"{name} must be >= {least}, got {value}")
    if shared_expert_dim is not None:
      if isinstance(shared_expert_dim, bool) or not isinstance(shared_expert_dim,
                                                                numbers.Integral):
        raise TypeError(f"shared_expert_dim must be None or an int, got {shared_expert_dim!r}")
      if shared_expert_dim < 1:
        raise ValueError(f"shared_expert_dim must be >= 1, got {shared_expert_dim}")
    optional = tuple((name, v) for name, v in (("router_init_std", router_init_std),
                                                ("router_norm_eps", router_norm_eps))
                     if v is not None)
    for name, value in (("load_balance_coef", load_balance_coef), ("z_loss_coef", z_loss_coef),
                        ("bias_update_rate", bias_update_rate), ("init_std", init_std),
                        *optional):
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {value!r}")
      if not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if router_norm_eps is not None and not router_norm_eps > 0:
      # rsqrt(mean(0) + 0): an all-zero token (padding) would give NaN, and the balance loss with it
      raise ValueError(f"router_norm_eps must be None or > 0, got {router_norm_eps!r}")
    for name, value, none_ok in (("dtype", dtype, True), ("param_dtype", param_dtype, False),
                                 ("router_param_dtype", router_param_dtype, True)):
      if value is None and none_ok:
        continue
      try:  # jnp.dtype(None) is the default float: None is refused by name here
        floating = value is not None and jnp.issubdtype(jnp.dtype(value), jnp.floating)
      except TypeError:
        floating = False
      if not floating:
        raise ValueError(f"{name} must be a floating dtype{' or None' if none_ok else ''}, got "
                         f"{value!r}")
    if expert_parallel_axis is not None and not isinstance(expert_parallel_axis, str):
      raise TypeError(f"expert_parallel_axis must be None or one mesh axis name (a str), got "
                      f"{expert_parallel_axis!r}")
    if not (token_axes is None or isinstance(token_axes, str) or (
        isinstance(token_axes, (tuple, list)) and all(isinstance(a, str) for a in token_axes))):
      raise TypeError(f"token_axes must be None, an axis name or a tuple of them, got "
                      f"{token_axes!r}")
    router = routing_lib.get_router(routing)
    router.check(num_experts, top_k)  # top_k's type and range too
    if gate_up_layout not in acts.GATE_UP_LAYOUTS:
      raise ValueError(f"gate_up_layout must be one of {acts.GATE_UP_LAYOUTS}, got "
                       f"{gate_up_layout!r}")
    if backend not in backends.BACKENDS:
      raise ValueError(f"backend must be one of {backends.BACKENDS}, got {backend!r}")
    if balance_loss not in ("batch", "sequence"):
      raise ValueError(f"balance_loss must be 'batch' or 'sequence', got {balance_loss!r}")
    if balance_loss == "sequence" and expert_parallel_axis is not None:
      raise ValueError("balance_loss='sequence' does not take expert_parallel_axis: use "
                       "balance_loss='batch' with it")
    if shared_expert_gate and not num_shared_experts:
      raise ValueError("shared_expert_gate needs num_shared_experts >= 1")
    self.router_norm_eps, self.fixed_selection = router_norm_eps, fixed_selection
    self.top_k, self.activation, self.routing = top_k, act, router
    self.balance_loss = balance_loss
    self.gate_up_layout, self.backend, self.dtype = gate_up_layout, backend, dtype
    self.config = check_config(config)
    self.load_balance_coef, self.z_loss_coef = load_balance_coef, z_loss_coef
    self.bias_update_rate = bias_update_rate
    check_capacity(capacity_factor)
    check_rounding(token_rounding, router, capacity_factor)
    excluded = fixed_selection and routing_lib.fixed_selection_excludes(  # what `moe` refuses
        token_rounding, bias_update_rate > 0, router, "selection bias (bias_update_rate > 0)")
    if excluded:
      raise ValueError(f"fixed_selection=True (a given selection) takes no {excluded}")
    self.token_rounding, self.deterministic = token_rounding, deterministic
    if expert_parallel_scheme not in ("auto",) + EXPERT_PARALLEL_SCHEMES:
      raise ValueError(f"expert_parallel_scheme must be 'auto' or one of "
                       f"{EXPERT_PARALLEL_SCHEMES}, got {expert_parallel_scheme!r}")
    self.expert_parallel_axis = expert_parallel_axis
    self.expert_parallel_scheme, self.capacity_factor = expert_parallel_scheme, capacity_factor
    if isinstance(token_axes, str):  # one axis name, not its letters
      token_axes = (token_axes,)
    if token_axes is not None and (not token_axes or len(set(token_axes)) != len(token_axes)):
      raise ValueError(f"token_axes must name one or more distinct mesh axes, got {token_axes!r}")
    self.token_axes = None if token_axes is None else tuple(token_axes)
    width = act.width_multiplier() * expert_dim
    normal = lambda std: jax.nn.initializers.normal(std)
    router_std = init_std if router_init_std is None else router_init_std
    r_dtype = param_dtype if router_param_dtype is None else router_param_dtype
    self.router = _param(rngs, normal(router_std), (d_model, num_experts),
                         r_dtype, (embed_axis, None))
    self.w1 = _param(rngs, normal(init_std), (num_experts, d_model, width), param_dtype,
                     (expert_axis, embed_axis, mlp_axis))
    self.w2 = _param(rngs, normal(init_std), (num_experts, expert_dim, d_model), param_dtype,
                     (expert_axis, mlp_axis, embed_axis))
    zeros = jax.nn.initializers.zeros
    # Optional parts are None when unused; nnx.data marks the attributes as state either way.
    self.b1 = nnx.data(_param(rngs, zeros, (num_experts, width), param_dtype,
                              (expert_axis, mlp_axis)) if use_bias else None)
    self.b2 = nnx.data(_param(rngs, zeros, (num_experts, d_model), param_dtype,
                              (expert_axis, embed_axis)) if use_bias else None)
    self.router_bias = nnx.data(_param(rngs, zeros, (num_experts,), r_dtype, (None,))
                                if use_router_bias else None)
    ones = jax.nn.initializers.ones
    self.router_scale = nnx.data(_param(rngs, ones, (d_model,), r_dtype, (embed_axis,))
                                 if router_norm_eps is not None else None)
    self.expert_scale = nnx.data(_param(rngs, ones, (num_experts,), r_dtype, (None,))
                                 if use_expert_scale else None)
    self.selection_bias = nnx.data(SelectionBias(jnp.zeros((num_experts,), jnp.float32))
                                   if bias_update_rate > 0 else None)
    shared_in = shared_out = None
    if num_shared_experts:
      s_dim = num_shared_experts * (expert_dim if shared_expert_dim is None else shared_expert_dim)
      shared_in = _param(rngs, normal(init_std), (d_model, act.width_multiplier() * s_dim),
                         param_dtype, (embed_axis, mlp_axis))
      shared_out = _param(rngs, normal(init_std), (s_dim, d_model), param_dtype,
                          (mlp_axis, embed_axis))
    self.shared_in, self.shared_out = nnx.data(shared_in), nnx.data(shared_out)
    self.shared_gate = nnx.data(_param(rngs, normal(init_std), (d_model, 1), param_dtype,
                                       (embed_axis, None)) if shared_expert_gate else None)

  def __call__(self, x: Array, router_input: Array | None = None,
               expert_ids: Array | None = None) -> tuple[Array, MoELayerAux]:
    """x (..., d) -> (y with x's shape in the compute `dtype` (default x's), aux). Leading dims
    are flattened into tokens.

    router_input: optional input of the router, x's shape (default x; `moe`'s `router_input`):
    Gemma 4 routes on the block's input and runs the experts on another normalisation of it.
    expert_ids: optional (..., K) integer, x's leading dims: a fixed selection whose weights the
    router computes (DeepSeek-V4's hash-routed layers: `tid2eid[input_ids]`); not while token
    rounding trains, nor with a selection bias (bias_update_rate > 0) or group-limited routing
    (a `Router` with n_group > 1), which only move a selection."""
    for name, a in (("x", x), ("router_input", router_input)):
      if (a is not None or name == "x") and not (hasattr(a, "shape") and hasattr(a, "dtype")):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    if x.ndim < 1 or x.shape[-1] != self.w1.shape[1]:
      raise ValueError(f"x must have shape (..., d_model) with d_model = {self.w1.shape[1]}, got "
                       f"{tuple(x.shape)}")
    # x's dtype as JAX computes with it (a NumPy float64 x is float32 without jax_enable_x64)
    dtype = self.dtype or jax.dtypes.canonicalize_dtype(x.dtype)
    lead = x.shape[:-1]
    h = _flatten(x).astype(dtype)
    cast = lambda p: None if p is None else p[...].astype(dtype)
    if self.balance_loss == "sequence" and x.ndim != 3:
      raise ValueError(f"balance_loss='sequence' takes x of shape (B, S, d), got {x.shape}")
    if router_input is not None and tuple(router_input.shape) != tuple(x.shape):
      raise ValueError(f"router_input must have x's shape {tuple(x.shape)}, got "
                       f"{tuple(router_input.shape)}")
    # before the casts below hide them
    for name, a in (("x", x), ("router_input", router_input)):
      if a is not None and not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype, got {a.dtype}")
    r = None if router_input is None else _flatten(router_input)
    if self.router_scale is not None:
      r = self._normalised_router_input(h if r is None else r)
    elif r is not None:
      r = r.astype(dtype)
    sel_bias = None if self.selection_bias is None else self.selection_bias[...]
    router_bias = None if self.router_bias is None else self.router_bias[...]
    expert_scale = None if self.expert_scale is None else self.expert_scale[...]
    if self.fixed_selection and expert_ids is None:
      raise ValueError("this layer has fixed_selection=True (a hash-routed layer): pass its "
                       "selection as expert_ids")
    if expert_ids is not None:
      check_integer_array("expert_ids", expert_ids)
      # what `moe` refuses beside a given selection, in the layer's own words
      excluded = routing_lib.fixed_selection_excludes(
          None if self.deterministic else self.token_rounding, self.bias_update_rate > 0,
          self.routing, "selection bias (bias_update_rate > 0)")
      if excluded:
        raise ValueError(f"expert_ids (a given selection) takes no {excluded}")
      if tuple(expert_ids.shape) != tuple(lead) + (self.top_k,):
        raise ValueError(f"expert_ids must have shape {tuple(lead) + (self.top_k,)} (x's leading "
                         f"dims, top_k), got {tuple(expert_ids.shape)}")
      expert_ids = _flatten(expert_ids)
    experts = (self.router[...], cast(self.w1), cast(self.w2), cast(self.b1), cast(self.b2),
               router_bias, sel_bias, r, expert_scale, expert_ids)
    axis = self.expert_parallel_axis
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None:  # data parallel under a mesh with token_axes, or one that splits the tokens
      # (inside the user's shard_map over them, the op runs on the shard as it is)
      dp_axes = () if mesh.empty else self.token_axes or split_axes(h)
      own_map = bool(dp_axes) and not set(dp_axes) <= set(mesh.manual_axes)
    else:
      own_map = axis not in mesh.manual_axes
    if own_map:
      # h as the routed experts' shard_map takes it (sharded over token_axes): the shared experts
      # then run on the same shards, and their output adds to y's without a reshard.
      h, y, stats = self._routed_shard_map(h, experts)
    else:
      y, stats = self._routed(h, *experts)  # one device, or inside the user's shard_map
    if self.shared_in is not None:
      # float32 accumulation (float64 for float64 compute); a 16-bit backward for 16-bit compute.
      # The weights whole for the call, as `moe` takes the routed experts' (FSDP stores them
      # split over an Explicit axis that may split the tokens too).
      shared_weight = lambda p: whole(cast(p))
      u = dot_f32(h, shared_weight(self.shared_in))
      a = acts.apply_activation(u, self.activation, self.gate_up_layout).astype(dtype)
      shared = dot_f32(a, shared_weight(self.shared_out))
      if self.shared_gate is not None:
        shared = shared * jax.nn.sigmoid(dot_f32(h, shared_weight(self.shared_gate)))
      y = y + shared.astype(dtype)
    if self.balance_loss == "sequence":  # on the token-choice routing, as the batch loss
      e_count = self.router.shape[1]
      sequence_loss = jnp.zeros((), jnp.float32)
      if h.shape[0]:
        sequence_loss = routing_lib.sequence_balance_loss(
            stats.probs.reshape(*lead, e_count), stats.choice_ids.reshape(*lead, self.top_k))
      stats = stats._replace(load_balance_loss=sequence_loss)
    loss = self.load_balance_coef * stats.load_balance_loss + self.z_loss_coef * stats.z_loss
    return _unflatten(y, lead, x), MoELayerAux(loss, stats)

  def _normalised_router_input(self, r):
    """Gemma 4's router input: r RMS-normalised, times the trained scale and d ** -0.5, in
    float32 (or wider): the router GEMM takes it without a 16-bit rounding, whose error could
    reorder near-tied logits (a float32 router weight then makes it a float32 GEMM, at the
    caller's matmul precision)."""
    wide = jnp.promote_types(r.dtype, jnp.float32)
    r = r.astype(wide)
    r = r * jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + self.router_norm_eps)
    # the scale whole, as the shared experts' weights (FSDP may split it over the token axis)
    return r * whole(self.router_scale[...]).astype(wide) * r.shape[-1] ** -0.5

  def _scheme(self) -> str:
    """The expert-parallel scheme over the bound expert axis (inside a shard_map over it)."""
    devices = jax.lax.axis_size(self.expert_parallel_axis)
    return resolve_scheme(self.expert_parallel_scheme, devices, self.top_k, self.capacity_factor)

  def _routed(self, h, router, w1, w2, b1, b2, router_bias, selection_bias, router_input,
              expert_scale, expert_ids):
    """The routed experts on tokens h (T, d): one device, or this device's part of the axis."""
    kw = dict(top_k=self.top_k, activation=self.activation, routing=self.routing,
              gate_up_layout=self.gate_up_layout, b1=b1, b2=b2, router_bias=router_bias,
              selection_bias=selection_bias, router_input=router_input,
              expert_scale=expert_scale, expert_ids=expert_ids,
              token_rounding=None if self.deterministic else self.token_rounding,
              backend=self.backend, config=self.config)
    if self.expert_parallel_axis is None:
      return moe(h, router, w1, w2, capacity_factor=self.capacity_factor, **kw)
    if self._scheme() == "all_to_all":
      return moe_all_to_all(h, router, w1, w2, axis_name=self.expert_parallel_axis,
                            capacity_factor=self.capacity_factor, **kw)
    return moe_all_gather(h, router, w1, w2, axis_name=self.expert_parallel_axis,
                          capacity_factor=self.capacity_factor, **kw)

  def _routed_shard_map(self, h, experts):
    """`_routed` under a `jax.shard_map` of its own, over the mesh set with `jax.set_mesh`: tokens
    sharded over `token_axes`, expert weights over the expert axis, the rest replicated. Returns
    (h placed so, y, aux): the aux with per-token fields sharded like the tokens, counts and the
    z-loss over all tokens, the balance loss averaged over the data shards' and no extra-pair
    lists (they index device-local tokens)."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = self.expert_parallel_axis
    what = (f"expert_parallel_axis={axis!r}" if axis is not None
            else f"token_axes={self.token_axes!r}")
    if mesh.empty or (axis is not None and axis not in mesh.axis_names):
      raise ValueError(f"{what}: call the layer inside a jax.shard_map over that axis, or under "
                       f"jax.set_mesh(mesh) with a mesh that has it (current mesh axes: "
                       f"{tuple(mesh.axis_names)})")
    outer = varying_axes(h)
    if outer:
      # The shard_map below runs without shard_map's type check: inside a checked one the
      # parameters' gradients would not be summed over the outer axes.
      raise ValueError(
          f"{what}: the layer adds its own shard_map over the token axes, but it is inside a "
          f"jax.shard_map over {sorted(outer)} with check_vma=True, through which its gradients "
          f"would be wrong: give that shard_map check_vma=False, or map it over the layer's axes "
          f"too (the layer then runs the op directly)")
    # By default every axis not already manual (inside a user's shard_map over some of them);
    # without expert parallelism the axes that split the tokens in x's type.
    token_axes = tuple(self.token_axes or (
        split_axes(h) if axis is None
        else (a for a in mesh.axis_names if a not in mesh.manual_axes)))
    if (axis is not None and axis not in token_axes) or any(
        a not in mesh.axis_names or a in mesh.manual_axes for a in token_axes):
      raise ValueError(f"token_axes={token_axes} must be axes of the mesh {tuple(mesh.axis_names)} "
                       f"that no surrounding shard_map made manual"
                       + ("" if axis is None else f", and include the expert axis {axis!r}"))
    types = {mesh.axis_types[mesh.axis_names.index(a)] for a in token_axes}
    if len(types) > 1:
      raise ValueError(f"token_axes={token_axes} mix mesh axis types {sorted(map(str, types))}: "
                       f"the layer shards the tokens over them together, so make them all "
                       f"Explicit or all Auto (jax.make_mesh's axis_types)")
    e_count = experts[1].shape[0]
    if axis is not None and e_count % mesh.shape[axis]:
      raise ValueError(f"num_experts={e_count} does not split over the {mesh.shape[axis]} devices "
                       f"of expert_parallel_axis={axis!r}: make E a multiple of that axis' size")
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if h.shape[0] % shards:
      raise ValueError(f"the layer's {h.shape[0]} tokens do not split over the {shards} devices of "
                       f"token_axes={token_axes}")
    data_axes = tuple(a for a in token_axes if a != axis)
    tokens, whole = P(token_axes), P()
    expert_dim = whole if axis is None else P(axis)
    specs = tuple(None if v is None else s for v, s in zip(
        experts, (whole, expert_dim, expert_dim, expert_dim, expert_dim, whole, whole, tokens,
                  whole, tokens)))

    def local(h, *experts):
      y, st = self._routed(h, *experts)
      if axis is not None and self._scheme() == "all_gather":  # aux of the axis
        mine = lambda a: jax.lax.dynamic_slice_in_dim(
            a, jax.lax.axis_index(axis) * h.shape[0], h.shape[0], axis=0)
        st = st._replace(expert_ids=mine(st.expert_ids), scores=mine(st.scores),
                         router_logits=mine(st.router_logits), probs=mine(st.probs))
      over_data = lambda v, op: op(v, data_axes) if data_axes else v
      st = st._replace(
          expert_counts=over_data(st.expert_counts, jax.lax.psum),
          load_balance_loss=over_data(st.load_balance_loss, jax.lax.pmean),
          z_loss=over_data(st.z_loss, jax.lax.pmean),
          padded_rows=over_data(st.padded_rows, jax.lax.psum),
          dropped_pairs=over_data(st.dropped_pairs, jax.lax.psum),
          extra_tokens=None, extra_experts=None, extra_scores=None)
      return y, st

    stats_specs = MoEAux(expert_counts=whole, expert_ids=tokens, scores=tokens,
                         router_logits=tokens, load_balance_loss=whole, z_loss=whole,
                         padded_rows=whole, dropped_pairs=whole, probs=tokens,
                         choice_ids=tokens if axis is None else None)
    # Under jit: called (or differentiated) eagerly, a shard_map runs its body op by op on every
    # device, far slower than compiling it (docs/decisions.md). An eager call compiles it anew
    # (`local` is a new closure each call); inside the caller's jit XLA inlines the nested call.
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(tokens,) + specs,
                           out_specs=(tokens, stats_specs), check_vma=False)

    def placed_and_mapped(h, *experts):
      # Parameters as stored may be unplaced: each is put where it goes, inside the jit (eagerly,
      # a constraint on an Auto axis refuses an array committed to one device).
      h = _constrain(h, tokens, mesh)
      return (h, *mapped(h, *(None if v is None else _constrain(v, spec, mesh)
                              for v, spec in zip(experts, specs))))

    return jax.jit(placed_and_mapped)(h, *experts)

  def update_selection_bias(self, expert_counts: Array) -> None:
    """Auxiliary-loss-free balancing step: bias_e += rate * sign(mean load - load_e).

    Call it after the optimizer step with the step's `aux.stats.expert_counts` (summed over layers'
    micro-batches or devices as you see fit): shape (E,), or (L, E) on layers stacked by
    `nnx.vmap` / `nnx.scan` (each layer's row against its own mean). A no-op when bias_update_rate
    is 0, and for a row holding a count that is not finite (float counts averaged from a NaN, say:
    its mean and signs would be NaN, which the selection then ranks above or below every expert).
    """
    if self.selection_bias is None:
      return
    bias = self.selection_bias[...]
    if not hasattr(expert_counts, "shape"):
      raise TypeError(f"expert_counts must be an array, got {type(expert_counts).__name__}")
    if tuple(expert_counts.shape) != tuple(bias.shape):
      raise ValueError(f"expert_counts must have the selection bias's shape {tuple(bias.shape)}, "
                       f"got {tuple(expert_counts.shape)}")
    counts = jax.lax.stop_gradient(expert_counts).astype(jnp.float32)
    step = self.bias_update_rate * jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
    finite = jnp.all(jnp.isfinite(counts), axis=-1, keepdims=True)
    self.selection_bias[...] = bias + jnp.where(finite, step, 0.0)


# Flax's Module metaclass shows MoE(*args, **kwargs) to help(), inspect and IDEs: give them the
# constructor's arguments.
_INIT = inspect.signature(MoE.__init__)
MoE.__signature__ = _INIT.replace(parameters=list(_INIT.parameters.values())[1:])
