"""Token-choice routers: logits, top-K scores and the auxiliary losses.

A router maps logits (T, E) to `scores` (T, K) float32 and `expert_ids` (T, K) int32. Everything
here is plain JAX (on GPUs the top-K selection runs a Pallas kernel, ids only, no gradient; for a
router whose selection ranks the logits one kernel runs the router GEMM and the selection,
`router_logits_and_ids`; token rounding's selection is a Pallas kernel too), so the router's
backward (softmax or sigmoid backward, then the router GEMM's backward) is JAX autodiff
fed by the score gradient dS that the expert op returns.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from typing import Mapping, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from sonic_jax import precision
from sonic_jax.batching import take_shared, unsplit
from sonic_jax.config import Config, check_config
from sonic_jax.layout import check_integer_array, int32_ids
from sonic_jax.pallas import rounding_select, router_topk
from sonic_jax.precision import dot_f32

Array = jax.Array

SCORINGS = ("softmax", "sigmoid", "sqrt_softplus")
GROUP_SCORES = ("max", "top2_sum")


@dataclasses.dataclass(frozen=True)
class Router:
  """How a token-choice router turns logits (T, E) into K experts per token and their weights.

  Frozen and hashable: a static value under `jax.jit`. The fields read like the families' configs
  (`sonic_jax.hf` builds one from a Hugging Face config).

  scoring: "softmax" (probabilities over all E), "sigmoid" (an independent gate per expert) or
    "sqrt_softplus" (sqrt(softplus(logit)) per expert, DeepSeek-V4).
  renormalize: divide the K selected scores by their p-norm (`renorm_p`, default 1: their sum) plus
    `renorm_epsilon` (HF's norm_topk_prob; DeepSeek-V3 adds 1e-20, DBRX takes a p-norm). With
    selection_bias_on="logits" (the "softmax_topk" preset), renormalised softmax weights (p = 1, no
    epsilon) are computed as a softmax over the K selected logits: the same math in fewer
    operations, SonicMoE's router; it loses float32 precision in the gradient where the selected
    logits are far apart, which the probabilities-then-divide form keeps.
  selection_bias_on: where a `selection_bias` (auxiliary-loss-free balancing, no gradient) is added
    for the selection: "scores" (DeepSeek-V3's e_score_correction_bias, ERNIE, MiniMax) or
    "logits". The weights always come from the unbiased scores.
  n_group, topk_group: group-limited selection (DeepSeek-V2/V3): the E experts form n_group equal
    groups of consecutive ids, each token keeps its topk_group best groups and picks its K experts
    among theirs. group_score: a group's score, "max" of its experts' selection values
    (DeepSeek-V2's group_limited_greedy) or "top2_sum", the sum of its two best (DeepSeek-V3).
    Experts outside the kept groups are never selected (DeepSeek's reference masks them to -inf;
    transformers masks them to 0, which differs only when a kept value is negative).
  routed_scaling_factor: multiplies the weights after renormalisation (DeepSeek-V2/V3, GLM-4.5,
    Kimi-K2, LongCat).
  scale_input: Llama 4: each expert sees its token scaled by the weight, y = sum_k expert_k(s_k x),
    instead of y = sum_k s_k expert_k(x).

  Selection ranks the selection values (scores, plus the bias where given); with no groups, and
  no bias or a bias on the logits, it ranks the logits instead, which every scoring preserves and
  which do not saturate (a float32 sigmoid is exactly 1.0 above a logit of about 17).
  """

  scoring: str = "softmax"
  renormalize: bool = True
  renorm_epsilon: float = 0.0
  renorm_p: float = 1.0
  selection_bias_on: str = "scores"
  n_group: int = 1
  topk_group: int = 1
  group_score: str = "max"
  routed_scaling_factor: float = 1.0
  scale_input: bool = False

  def __post_init__(self):
    if self.scoring not in SCORINGS:
      raise ValueError(f"Router.scoring must be one of {SCORINGS}, got {self.scoring!r}")
    if self.selection_bias_on not in ("scores", "logits"):
      raise ValueError(f"Router.selection_bias_on must be 'scores' or 'logits', got "
                       f"{self.selection_bias_on!r}")
    if self.group_score not in GROUP_SCORES:
      raise ValueError(f"Router.group_score must be one of {GROUP_SCORES}, got "
                       f"{self.group_score!r}")
    for name in ("n_group", "topk_group"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Router.{name} must be an int, got {value!r}")
      if value < 1:
        raise ValueError(f"Router.{name} must be >= 1, got {value}")
      object.__setattr__(self, name, int(value))  # a NumPy integer too: one hash, one repr
    if self.topk_group > self.n_group:
      raise ValueError(f"Router.topk_group must be <= n_group = {self.n_group}, got "
                       f"{self.topk_group}")
    for name in ("renormalize", "scale_input"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise TypeError(f"Router.{name} must be a bool, got {getattr(self, name)!r}")
      object.__setattr__(self, name, bool(getattr(self, name)))
    for name in ("renorm_epsilon", "renorm_p", "routed_scaling_factor"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Router.{name} must be a real number, got {value!r}")
      if not math.isfinite(value):
        raise ValueError(f"Router.{name} must be finite, got {value}")
    if not self.renorm_p > 0 or not self.renorm_epsilon >= 0:
      raise ValueError(f"Router.renorm_p must be > 0 and renorm_epsilon >= 0, got "
                       f"{self.renorm_p}, {self.renorm_epsilon}")
    if not self.routed_scaling_factor > 0:
      raise ValueError(f"Router.routed_scaling_factor must be > 0, got "
                       f"{self.routed_scaling_factor}")

  def check(self, num_experts: int, top_k: int) -> None:
    """Raises a TypeError or ValueError naming the field or argument when this router cannot
    pick top_k of num_experts (top_k not an int in [1, E] included)."""
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
      traced = " (static: close over it, or mark it static under jax.jit)" if isinstance(
          top_k, jax.core.Tracer) else ""
      raise TypeError(f"top_k must be an int{traced}, got {type(top_k).__name__}")
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k must be in [1, E={num_experts}], got {top_k}")
    if self.n_group == 1:
      return
    if num_experts % self.n_group:
      raise ValueError(f"Router.n_group = {self.n_group} must divide the number of experts "
                       f"E = {num_experts}")
    per_group = num_experts // self.n_group
    if self.group_score == "top2_sum" and per_group < 2:
      raise ValueError(f"Router.group_score='top2_sum' needs >= 2 experts per group, got "
                       f"E / n_group = {per_group}")
    if top_k > self.topk_group * per_group:
      raise ValueError(f"top_k = {top_k} exceeds the experts of the topk_group = "
                       f"{self.topk_group} kept groups ({self.topk_group * per_group})")

  @property
  def softmax_of_selected(self) -> bool:
    """The weights are a softmax over the selected logits (see `renormalize`)."""
    return (self.scoring == "softmax" and self.renormalize and self.renorm_p == 1.0
            and self.renorm_epsilon == 0.0 and self.selection_bias_on == "logits")

  def ranks_logits(self, selection_bias) -> bool:
    """The selection is a top-K of the logits (plus a bias): what the fused router kernel does."""
    return self.n_group == 1 and (selection_bias is None or self.selection_bias_on == "logits")


# Read-only: a jitted function keyed on a preset's name must not see it change.
ROUTINGS: Mapping[str, Router] = types.MappingProxyType({
    # SonicMoE's default: top-K of the logits, softmax over those K (= softmax, top-K, renormalise)
    "softmax_topk": Router("softmax", selection_bias_on="logits"),
    "topk_softmax": Router("softmax"),  # softmax over E, top-K, renormalise (Mixtral, Qwen3)
    "topk_softmax_raw": Router("softmax", renormalize=False),  # not renormalised (OLMoE, Qwen2)
    "sigmoid_topk": Router("sigmoid", renorm_epsilon=1e-20),  # DeepSeek-V3 without groups
    "sigmoid_topk_raw": Router("sigmoid", renormalize=False),  # dots.llm1's default
})


def get_router(routing: str | Router) -> Router:
  """A `Router` by preset name (a key of `ROUTINGS`), or the one given."""
  if isinstance(routing, Router):
    return routing
  if not isinstance(routing, str) or routing not in ROUTINGS:
    raise ValueError(f"routing must be one of {tuple(ROUTINGS)} or a sonic_jax.Router, got "
                     f"{routing!r}")
  return ROUTINGS[routing]


class RouterOutput(NamedTuple):
  """A token-choice routing (`route`): each token's K experts, their weights, and the per-token
  distribution over all E that the balance losses use. T stands for the logits' leading dims.

  Attributes:
    scores: (T, K) float32 (float64 for float64 logits), the weight of each selected expert; 0 in
      an empty slot.
    expert_ids: (T, K) int32, the selected experts; -1 in an empty slot (a given `expert_ids`
      entry outside [0, E)).
    probs: (T, E), the per-expert probabilities that the load-balance loss uses.
  """

  scores: Array
  expert_ids: Array
  probs: Array


def router_logits(x: Array, router_weight: Array) -> Array:
  """logits = x @ router_weight with float32 (float64 for float64 inputs) accumulation and result.

  When x and the weight share a 16-bit dtype, the backward GEMMs take the logits' gradient in
  that dtype too (float32 accumulation; `sonic_jax.precision.dot_f32`), as a 16-bit GEMM's
  backward does in mixed-precision training; plain autodiff would run them on float32 operands.
  x (..., d), router_weight (d, E), floating; the logits (..., E).
  """
  from sonic_jax import checks  # checks imports this module
  checks.check_array("x", x)
  checks.check_array("router_weight", router_weight)
  if x.ndim < 1 or router_weight.ndim != 2 or router_weight.shape[0] != x.shape[-1]:
    raise ValueError(f"x (..., d) and router_weight (d, E) must share d, got shapes "
                     f"{tuple(x.shape)} and {tuple(router_weight.shape)}")
  return dot_f32(x, router_weight)


def _top_k_ids(values: Array, top_k: int) -> Array:
  """Expert ids of lax.top_k(values, top_k): on a GPU from the one-pass Pallas kernel
  (`sonic_jax.pallas.router_topk`, same ids), which XLA's GPU top-K is several times slower than."""
  if (router_topk.AVAILABLE and jax.default_backend() == "gpu"
      and router_topk.supports(values, top_k) is None):
    return router_topk.top_k(jax.lax.stop_gradient(values), top_k)[1]
  return jax.lax.top_k(jax.lax.stop_gradient(values), top_k)[1]


def fused_top_k_unsupported(x: Array, router_weight: Array, top_k: int, routing: str | Router,
                            gpu_only: bool = True, config: Config | None = None,
                            selection_bias: Array | None = None,
                            router_bias: Array | None = None) -> str | None:
  """None when `router_logits_and_ids` computes the logits and the expert ids in one kernel (by
  default only on a GPU, up to `config.router_kernel_max_experts` experts; gpu_only=False:
  whether the interpreter can run it elsewhere)."""
  config = check_config(config)
  router = get_router(routing)
  if not router.ranks_logits(selection_bias):
    return "the selection ranks scores, not logits (groups, or a selection bias on the scores)"
  if router_bias is not None:
    return "a router bias (the kernel computes x @ router_weight alone)"
  if not router_topk.AVAILABLE:
    return "Pallas's Triton lowering is not available"
  if gpu_only and jax.default_backend() != "gpu":
    return "not on a GPU"
  if gpu_only and router_weight.shape[-1] > config.router_kernel_max_experts:
    return (f"E={router_weight.shape[-1]} > Config.router_kernel_max_experts="
            f"{config.router_kernel_max_experts}")
  return router_topk.logits_supports(x, router_weight, top_k)


def router_logits_and_ids(x: Array, router_weight: Array, top_k: int, routing: str | Router,
                          selection_bias: Array | None = None, fused: bool | None = None,
                          config: Config | None = None, router_bias: Array | None = None,
                          expert_ids: Array | None = None) -> tuple[Array, Array | None]:
  """(logits, expert ids or None): `router_logits(x, router_weight)` (+ router_bias, (E,),
  differentiable: gpt-oss's router Linear bias) and, where one kernel can give them with the
  logits (`fused_top_k_unsupported` is None: a GPU, 16-bit x and weight, a selection that ranks
  the logits), the ids that `route` would select, for `route(..., expert_ids=ids)`. The fused
  kernel saves the top-K's pass over the logits and a launch; the gradients are those of
  `router_logits` (16-bit GEMMs, float32 accumulation; none into the selection bias).
  fused: None (where it applies and `config` chooses it), False (never: ids None), True (always;
  interpreted off a GPU; a ValueError where it does not apply). expert_ids: a fixed selection,
  returned as the ids beside the logits alone (no fused kernel)."""
  if expert_ids is not None:
    return router_logits_and_ids(x, router_weight, top_k, routing, fused=False,
                                 router_bias=router_bias)[0], expert_ids
  reason = fused_top_k_unsupported(x, router_weight, top_k, routing, gpu_only=fused is None,
                                   config=config, selection_bias=selection_bias,
                                   router_bias=router_bias)
  if fused is False or (reason is not None and not fused):
    logits = router_logits(x, router_weight)
    if router_bias is not None:
      logits = logits + router_bias.astype(logits.dtype)
    return logits, None
  if reason is not None:
    raise ValueError(f"router_logits_and_ids(fused=True): {reason}")
  # The kernel runs on stopped inputs, so autodiff never differentiates it (nor, through its integer
  # ids, the layout's kernels: a custom_vjp's integer output would carry a float0 tangent into
  # them); the logits get the router GEMM's gradient from `_with_router_gradient`.
  stop = jax.lax.stop_gradient
  logits, ids = router_topk.logits_top_k(
      stop(x), stop(router_weight), top_k, None if selection_bias is None else stop(selection_bias),
      interpret=jax.default_backend() != "gpu")
  return _with_router_gradient(x, router_weight, logits), ids


@jax.custom_vjp
def _with_router_gradient(x, router_weight, logits):
  """logits, computed elsewhere as x @ router_weight, with that product's gradient (16-bit GEMMs,
  float32 accumulation: `precision.dot_16bit_grads`)."""
  del x, router_weight
  return logits


def _with_router_gradient_fwd(x, router_weight, logits):
  return logits, (x, router_weight)


def _with_router_gradient_bwd(residuals, g):
  d_x, d_w = precision.dot_16bit_grads(*residuals, g)
  return d_x, d_w, jnp.zeros_like(g)


_with_router_gradient.defvjp(_with_router_gradient_fwd, _with_router_gradient_bwd)


def _group_mask(values: Array, router: Router) -> Array:
  """values with the experts outside each token's topk_group best groups set to -inf."""
  t_shape, e_count = values.shape[:-1], values.shape[-1]
  grouped = values.reshape(*t_shape, router.n_group, e_count // router.n_group)
  if router.group_score == "max":
    group_scores = jnp.max(grouped, axis=-1)
  else:
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
  _, groups = jax.lax.top_k(group_scores, router.topk_group)
  keep = jnp.any(groups[..., :, None] == jnp.arange(router.n_group), axis=-2)  # (T, n_group)
  keep = jnp.broadcast_to(keep[..., None], grouped.shape).reshape(values.shape)
  return jnp.where(keep, values, -jnp.inf)


def _selection_ids(logits: Array, scores: Array, top_k: int, router: Router,
                   selection_bias: Array | None) -> Array:
  """The K selected experts (T, K) int32; no gradient flows through the choice."""
  stop = jax.lax.stop_gradient
  on_scores = not router.ranks_logits(selection_bias) and router.selection_bias_on == "scores"
  ranked = stop(scores if on_scores else logits)
  if selection_bias is not None:
    ranked = ranked + stop(selection_bias).astype(ranked.dtype)
  if router.n_group > 1:
    ranked = _group_mask(ranked, router)
  return _top_k_ids(ranked, top_k)


def route(logits: Array, top_k: int, routing: str | Router = "softmax_topk",
          selection_bias: Array | None = None, expert_ids: Array | None = None) -> RouterOutput:
  """Selects K experts per token and their weights, as `routing` (a `Router` or the name of one
  of `ROUTINGS`) says.

  logits: (..., E) floating, any leading dims (the tokens), computed in float32 (float64 for
  float64 logits). top_k: K, 1 <= K <= E. Returns a `RouterOutput`: scores and expert_ids
  (..., K), probs (..., E).

  selection_bias (E,), optional: added to the selection values (`Router.selection_bias_on`) for
  choosing the experts only; the weights come from the unbiased scores (DeepSeek-V3's
  auxiliary-loss-free balancing). It receives no gradient.

  Presets: "softmax_topk" (SonicMoE's default: top-K of the logits, softmax over those K),
  "topk_softmax" (softmax over E, top-K, renormalised; the same weights, a bias on the
  probabilities), "topk_softmax_raw" (not renormalised), "sigmoid_topk" (sigmoid gates,
  renormalised), "sigmoid_topk_raw" (not renormalised).

  expert_ids (T, K) integer, optional: the selection, already made (the fused kernel's, or a fixed
  one such as DeepSeek-V4's hash layers'); the weights come from these logits. A slot whose id lies
  outside [0, E) is empty: id -1 and weight 0, the token's other weights renormalised without it.
  Group-limited routing (n_group > 1) takes none: the groups would go unused.

  `moe`'s routing from these pieces: its router_bias (E,) is added to the logits before this
  (`router_logits(x, w) + router_bias`), its expert_scale (E,) multiplies each returned weight by
  its expert's entry (`scores * expert_scale[expert_ids]`, 0 where the id is -1); then
  `routed_experts(x, out.expert_ids, scores, ..., scale_input=router.scale_input)`.
  """
  from sonic_jax import checks  # checks imports this module
  checks.check_array("logits", logits)
  if logits.ndim < 1:
    raise ValueError("logits must have shape (..., E), got a scalar")
  if selection_bias is not None:
    checks.check_array("selection_bias", selection_bias)
  router = get_router(routing)
  router.check(logits.shape[-1], top_k)
  if selection_bias is not None and selection_bias.shape != (logits.shape[-1],):
    raise ValueError(f"selection_bias must have shape (E,) = ({logits.shape[-1]},), got "
                     f"{tuple(selection_bias.shape)}")
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  log_gates = None  # sigmoid and sqrt-softplus gates divide in log space (`_normalised`)
  if router.scoring == "softmax":
    probs = jax.nn.softmax(logits, axis=-1)
  elif router.scoring == "sigmoid":
    probs, log_gates = jax.nn.sigmoid(logits), jax.nn.log_sigmoid(logits)
  else:
    probs, log_gates = _sqrt_softplus(logits), 0.5 * _log_softplus(logits)
  valid = None  # where a given selection names an expert
  if expert_ids is None:
    ids = _selection_ids(logits, probs, top_k, router, selection_bias)
  else:
    # Groups would go silently unused (a selection bias may come with the ids: the fused router
    # kernel's were chosen with it).
    if router.n_group > 1:
      raise ValueError("expert_ids (a given selection) takes no group-limited routing "
                       "(Router.n_group > 1)")
    check_integer_array("expert_ids", expert_ids)
    if expert_ids.shape != logits.shape[:-1] + (top_k,):
      raise ValueError(f"expert_ids must have shape {logits.shape[:-1] + (top_k,)}, got "
                       f"{expert_ids.shape}")
    ids = int32_ids(expert_ids, logits.shape[-1], -1)
    valid = (ids >= 0) & (ids < logits.shape[-1])
    ids = jnp.where(valid, ids, -1)  # no expert: an empty slot, weight 0
  picked = lambda v, fill: (jnp.take_along_axis(v, ids, axis=-1) if valid is None else jnp.where(
      valid, jnp.take_along_axis(v, jnp.maximum(ids, 0), axis=-1), fill))
  if router.softmax_of_selected:
    # An empty slot's logit is the dtype's lowest: exp gives 0 beside any real one, and a token
    # with no expert gets finite weights (then zeroed) rather than NaN.
    scores = jax.nn.softmax(picked(logits, jnp.finfo(logits.dtype).min), axis=-1)
    scores = scores if valid is None else jnp.where(valid, scores, 0.0)
  elif router.renormalize and (log_gates is not None or router.renorm_p != 1.0):
    # A p-norm of softmax probabilities underflows where p is large (sum p_i^p below the float's
    # least), so p != 1 normalises in log space too.
    log_v = jax.nn.log_softmax(logits, axis=-1) if log_gates is None else log_gates
    scores = _normalised(picked(log_v, -jnp.inf), router.renorm_p, router.renorm_epsilon)
  else:
    scores = picked(probs, 0.0)
    if router.renormalize:
      norm = jnp.sum(scores, axis=-1, keepdims=True) + router.renorm_epsilon
      scores = scores / (norm if valid is None else jnp.where(norm > 0, norm, 1.0))
  if router.routed_scaling_factor != 1.0:
    scores = scores * router.routed_scaling_factor
  if log_gates is not None:
    # The balance losses take per-token distributions: the gates normalised over E (DeepSeek).
    probs = _normalised(log_gates, 1.0, 1e-20)
  return RouterOutput(scores, ids, probs)


def _normalised(log_v: Array, p: float, epsilon: float) -> Array:
  """v / (||v||_p + epsilon) along the last axis, from log v (-inf for v = 0), in log space: gates
  that all underflow (sigmoid or sqrt-softplus of logits below about -88 in float32) keep finite
  weights and gradients, where the division's gradient overflows (1 / norm^2). A row of zeros
  gives zeros; a row with a NaN, NaNs (as the softmax's would), not a silent zero."""
  log_norm = jax.nn.logsumexp(p * log_v, axis=-1, keepdims=True) / p
  if epsilon:
    log_norm = jnp.logaddexp(log_norm, jnp.log(jnp.asarray(epsilon, log_v.dtype)))
  empty = log_norm == -jnp.inf  # every entry 0 and no epsilon
  return jnp.where(empty, 0.0, jnp.exp(log_v - jnp.where(empty, 0.0, log_norm)))


def _log_softplus(logits: Array) -> Array:
  """log(softplus(logits)) without underflow: below -15, with x = e^l, l + log(log1p(x) / x) by
  its series -x/2 + 5x^2/24 (the next term, x^3/8 < 1e-20, is far below float64's resolution of
  l), whose gradient stays finite as x underflows."""
  small = logits < -15.0
  x = jnp.exp(jnp.where(small, logits, -15.0))
  return jnp.where(small, logits + x * (-0.5 + x * (5.0 / 24.0)),
                   jnp.log(jax.nn.softplus(jnp.where(small, 0.0, logits))))


def _sqrt_softplus(logits: Array) -> Array:
  """sqrt(softplus(logits)) (DeepSeek-V4's scores), with a finite gradient where softplus
  underflows to 0 (a float32 logit below about -88, denormals flushed): the balance losses
  differentiate every expert's score."""
  soft = jax.nn.softplus(logits)
  positive = soft > 0
  return jnp.where(positive, jnp.sqrt(jnp.where(positive, soft, 1.0)), 0.0)


def expert_counts(expert_ids: Array, num_experts: int) -> Array:
  """Number of (token, expert) pairs per expert, (E,) int32. Ids outside [0, E) are not counted."""
  flat = expert_ids.reshape(-1)
  valid = (flat >= 0) & (flat < num_experts)
  return jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, flat, num_experts)].add(
      1, mode="drop")


def load_balance_loss(probs: Array, counts: Array) -> Array:
  """Switch-Transformer balance loss E * sum_e f_e * P_e.

  f_e is the fraction of routed pairs that go to expert e (not differentiable) and P_e the mean
  router probability of expert e over tokens. Equals 1 under perfectly uniform routing.
  """
  num_experts = probs.shape[-1]
  f = counts.astype(jnp.float32) / jnp.maximum(jnp.sum(counts), 1).astype(jnp.float32)
  p = jnp.mean(probs, axis=0)
  return num_experts * jnp.sum(jax.lax.stop_gradient(f).astype(p.dtype) * p)


def z_loss(logits: Array) -> Array:
  """Router z-loss: mean over tokens of logsumexp(logits)^2 (ST-MoE)."""
  lse = jax.nn.logsumexp(logits, axis=-1)
  return jnp.mean(lse * lse)


# Token rounding (the SonicMoE paper's section 4; docs/design.md, "Token rounding"): a
# training-time router that moves each expert's number of tokens to a multiple of the grouped
# GEMM's row tile, so no tile is partly padding.
TOKEN_ROUNDINGS = rounding_select.MODES  # ("down", "up", "nearest")


class RoundingWarning(UserWarning):
  """Token rounding over too few tokens per expert: most experts would keep no pairs."""


def fixed_selection_excludes(token_rounding, has_selection_bias, router, bias_name):
  """The first of these options that a fixed selection (expert_ids) excludes, named for an error
  message, or None: each only moves a selection, so it would go silently unused."""
  for given, what in ((token_rounding is not None, "token_rounding (the two exclude each other)"),
                      (has_selection_bias, bias_name),
                      (router.n_group > 1, "group-limited routing (Router.n_group > 1)")):
    if given:
      return what
  return None


def rounding_unsupported(routing: str | Router) -> str | None:
  """None when token rounding applies to this router, else why not: SonicMoE's rounding ranks an
  expert's other tokens by their softmax probability."""
  router = get_router(routing)
  if router.scoring != "softmax":
    return f"token_rounding needs a softmax router, got scoring={router.scoring!r}"
  if router.n_group > 1:
    return "token_rounding does not take group-limited routing (n_group > 1)"
  if router.scale_input:
    return "token_rounding does not take scale_input routing"
  return None


class RoundedRouting(NamedTuple):
  """A routing after token rounding: the K slots of token choice, minus the pairs rounding dropped,
  plus X = E * J extra (token, expert) pairs that rounding added, J = `extra_pairs_per_expert`:
  entries [e * J, (e + 1) * J) are expert e's, its added tokens in increasing order, then unused
  entries. The weights are as `round_tokens` gives them; `moe` and the parallel ops scale them
  further (`route_tokens`) by the router's routed_scaling_factor and expert_scale where those
  apply.

  Attributes:
    scores: (T, K) float32, kept pairs' token-choice scores, 0 for dropped pairs.
    expert_ids: (T, K) int32, -1 where the pair was dropped.
    extra_tokens: (X,) int32, the token of each added pair, T for unused entries.
    extra_experts: (X,) int32, the expert of each added pair, E for unused entries.
    extra_scores: (X,) float32, the added pair's raw router probability, 0 when unused.
    probs: (T, E), the router probabilities (softmax over all E).
  """

  scores: Array
  expert_ids: Array
  extra_tokens: Array
  extra_experts: Array
  extra_scores: Array
  probs: Array


def extra_pairs_per_expert(mode: str, tile: int, num_tokens: int) -> int:
  """Static bound J on the pairs that rounding adds to one expert (at most T, the tokens)."""
  return rounding_select.added_bound(mode, tile, num_tokens)


ROUNDING_METHODS = ("auto", "kernel", "xla")


def _rounding_kernel_unsupported(num_tokens: int, num_experts: int, per_expert: int) -> str | None:
  if not rounding_select.AVAILABLE:
    return "Pallas's Triton lowering is not available"
  return rounding_select.supports(num_tokens, num_experts, per_expert)


def round_tokens(routed: RouterOutput, tile: int, mode: str,
                 method: str = "auto", logits: Array | None = None) -> RoundedRouting:
  """Token rounding of a softmax token-choice routing to multiples of `tile` rows per expert.

  tile: the row tile each expert's count is rounded to, the grouped GEMMs' (`row_tile` of the
  backend and of `build_grouped_layout`; `moe` passes its backend's).

  With c_e the token-choice count of expert e, its target is floor ("down"), ceil ("up") or
  round-half-to-even ("nearest") of c_e / tile, times tile, capped at T. Each expert ranks the
  tokens as SonicMoE does: its token-choice (TC) tokens first, by their score, then the
  other tokens by raw probability (ties to the lower token; a NaN score or probability ranks below
  every number, so a token whose row of x holds a NaN is the first of its TC experts' to drop and
  the last any other adds: only an expert that takes all T tokens adds it), and
  takes the first target-many. So
  rounding down drops an expert's lowest-scored TC pairs and rounding up adds its most probable
  non-TC tokens; kept TC pairs keep their score, added pairs get their raw softmax probability (both
  differentiable; the selection is not). A token may end up with fewer or more than K experts, or
  none. Static shapes: the added pairs live in an (E * extra_pairs_per_expert(mode, tile, T),)
  list, grouped by expert (`RoundedRouting`).

  method: "kernel" selects with one Pallas program per expert (`sonic_jax.pallas.rounding_select`,
  interpreted off a GPU; T <= 65536), "xla" with XLA's sort and top-K over the (E, T) matrix (the
  kernel's reference), "auto" (default) the kernel on a GPU where it applies, else XLA. The same
  pairs either way.

  routed must come from `route` with a router that `rounding_unsupported` accepts (softmax, no
  groups, no input scaling; `moe` checks the router): the arrays do not say which router made
  them, and with another's (sigmoid scores, say) the added pairs' weights would not be that
  router's.

  logits (T, E), optional: the logits whose softmax `routed.probs` is. The added pairs' weights
  are then exp(logit - logsumexp(token's logits)) of their own logits: the same values, and a
  backward of one scatter of the X pairs beside a dense term with a (T,) factor, where gathering
  from `routed.probs` takes the softmax's backward through a dense (T, E) gradient.
  """
  if not isinstance(routed, RouterOutput):
    raise TypeError(f"routed must be the RouterOutput that `route` returns, got "
                    f"{type(routed).__name__}")
  if mode not in TOKEN_ROUNDINGS:
    raise ValueError(f"mode must be one of {TOKEN_ROUNDINGS}, got {mode!r}")
  if isinstance(tile, bool) or not isinstance(tile, numbers.Integral):
    raise TypeError(f"tile must be an int, got {tile!r}")
  if tile < 1:
    raise ValueError(f"tile must be >= 1, got {tile}")
  if method not in ROUNDING_METHODS:
    raise ValueError(f"method must be one of {ROUNDING_METHODS}, got {method!r}")
  routed, logits = _check_routed(routed, logits)
  probs, ids = routed.probs, routed.expert_ids
  t_count = ids.shape[0]
  e_count = probs.shape[1]
  per_expert = extra_pairs_per_expert(mode, tile, t_count)
  reason = _rounding_kernel_unsupported(t_count, e_count, per_expert)
  if method == "kernel" and reason is not None:
    raise ValueError(f"round_tokens(method='kernel'): {reason}")
  use_kernel = method == "kernel" or (method == "auto" and reason is None
                                      and jax.default_backend() == "gpu")
  if use_kernel:
    keep, added = _select_by_kernel(routed, tile, mode, per_expert)
  else:
    keep, added = _select_by_xla(routed, tile, mode, per_expert)
  scores = jnp.where(keep, routed.scores, 0.0)
  kept_ids = jnp.where(keep, ids, -1).astype(jnp.int32)
  if per_expert == 0:
    empty = jnp.zeros((0,), jnp.int32)
    return RoundedRouting(scores, kept_ids, empty, empty, jnp.zeros((0,), scores.dtype), probs)
  extra_tokens = added.reshape(-1)
  used = extra_tokens < t_count
  experts = jax.lax.broadcasted_iota(jnp.int32, added.shape, 0).reshape(-1)
  extra_experts = jnp.where(used, experts, e_count)
  token = jnp.minimum(extra_tokens, t_count - 1)
  if logits is None:
    extra_scores = jnp.where(used, probs[token, experts], 0.0)
  else:
    logits = logits.astype(probs.dtype)
    lse = jax.nn.logsumexp(logits, axis=-1)
    extra_scores = jnp.where(used, jnp.exp(logits[token, experts] - lse[token]), 0.0)
  return RoundedRouting(scores, kept_ids, extra_tokens, extra_experts, extra_scores, probs)


def _check_routed(routed: RouterOutput, logits: Array | None):
  """(routed, logits), checked: scores and expert_ids (T, K), probs (T, E) and logits (T, E) of
  one T, not split over their tokens on a mesh (the ranking takes all of them together)."""
  from sonic_jax import checks  # checks imports this module
  fields = {"routed.scores": routed.scores, "routed.probs": routed.probs}
  if logits is not None:
    fields["logits"] = logits
  for name, a in fields.items():
    checks.check_array(name, a)
  check_integer_array("routed.expert_ids", routed.expert_ids)
  shapes = {name: tuple(a.shape) for name, a in dict(fields, **{
      "routed.expert_ids": routed.expert_ids}).items()}
  t_k, t_e = shapes["routed.expert_ids"], shapes["routed.probs"]
  if (len(t_k) != 2 or len(t_e) != 2 or shapes["routed.scores"] != t_k or t_e[0] != t_k[0]
      or shapes.get("logits", t_e) != t_e):
    raise ValueError(f"round_tokens takes routed.scores and routed.expert_ids (T, K), routed.probs "
                     f"(T, E) and logits (T, E) of one T (a `route` of (T, E) logits), got "
                     f"{shapes}")
  scores, probs, ids, logits = unsplit("round_tokens", "tokens", **{
      "routed.scores": routed.scores, "routed.probs": routed.probs,
      "routed.expert_ids": routed.expert_ids, "logits": logits})
  return RouterOutput(scores, ids, probs), logits


def _select_by_kernel(routed: RouterOutput, tile: int, mode: str, per_expert: int):
  """(keep (T, K) bool, added (E, J) int32) by `sonic_jax.pallas.rounding_select`."""
  ids = routed.expert_ids
  t_count = ids.shape[0]
  keys = rounding_select.selection_keys(routed.probs, ids, routed.scores,
                                        rounding_select.padded_tokens(t_count))
  keep_tc, added = rounding_select.select(keys, num_tokens=t_count, tile=tile, mode=mode,
                                          added_per_expert=per_expert,
                                          interpret=jax.default_backend() != "gpu")
  token = jax.lax.broadcasted_iota(jnp.int32, ids.shape, 0)
  return keep_tc[ids, token] > 0, added


def _select_by_xla(routed: RouterOutput, tile: int, mode: str, per_expert: int):
  """(keep (T, K) bool, added (E, J) int32): the ranking by a sort of the TC pairs and XLA's top-K
  of the other tokens' probabilities."""
  probs, ids = routed.probs, routed.expert_ids
  t_count, k_count = ids.shape
  e_count = probs.shape[1]
  flat_ids = ids.reshape(-1)
  counts = expert_counts(ids, e_count)
  target = rounding_select.target_count(counts, tile, mode, t_count)
  # Scores and probabilities rank by their bits (`rounding_select.order_bits`), as the kernel's do:
  # -0.0 ties with 0.0, and subnormals keep their order on a machine that flushes them.
  bits = lambda v: rounding_select.order_bits(jax.lax.stop_gradient(v))
  # Rounding down: rank each expert's TC pairs by score (ties by pair order) and keep the first
  # target_e of them.
  keep = jnp.ones_like(flat_ids, dtype=bool)
  if mode != "up":
    key = bits(routed.scores).reshape(-1)
    pair = jnp.arange(flat_ids.shape[0], dtype=jnp.int32)
    order = jnp.lexsort((pair, -key, flat_ids)).astype(jnp.int32)  # expert-major, best first
    starts = jnp.cumsum(counts) - counts
    rank_sorted = pair - starts[flat_ids[order]]
    rank = jnp.zeros_like(flat_ids).at[order].set(rank_sorted)
    keep = rank < target[flat_ids]
  keep = keep.reshape(t_count, k_count)
  if per_expert == 0:
    return keep, jnp.zeros((e_count, 0), jnp.int32)
  # Rounding up: each expert adds its most probable tokens that did not choose it.
  chose = jnp.zeros((t_count, e_count), bool).at[
      jnp.arange(t_count)[:, None], ids].set(True)
  candidates = jnp.where(chose, -1, bits(probs)).T  # (E, T)
  best, tokens = jax.lax.top_k(candidates, per_expert)  # (E, J)
  need = jnp.maximum(target - counts, 0)
  used = (jnp.arange(per_expert)[None, :] < need[:, None]) & (best >= 0)
  return keep, jnp.sort(jnp.where(used, tokens, t_count).astype(jnp.int32), axis=1)


def _warn_if_most_pairs_drop(mode: str, num_tokens: int, top_k: int, num_experts: int,
                             tile: int) -> None:
  """Warns (as the call is traced) where "nearest" or "down" rounding would leave most experts
  without a pair: an expert keeps none under half a tile ("nearest") or a tile ("down"), so at
  fewer pairs per expert on average most tokens' routed outputs are zero. An easy trap in small
  runs, and under data parallelism, where each shard rounds its own tokens."""
  keeps_none_below = {"nearest": tile / 2, "down": tile}.get(mode)
  per_expert = num_tokens * top_k / num_experts
  if keeps_none_below is not None and num_tokens and per_expert < keeps_none_below:
    warnings.warn(
        f"token_rounding={mode!r} over {num_tokens} tokens with K = {top_k} and E = "
        f"{num_experts}: {per_expert:.3g} pairs per expert on average, under "
        f"{'half ' if mode == 'nearest' else ''}the row tile ({tile}), so most experts keep no "
        "pairs and most tokens' routed outputs are zero. Round over more tokens (each data "
        "shard rounds its own), or use token_rounding='up' or None", RoundingWarning,
        stacklevel=4)


def route_tokens(logits: Array, top_k: int, routing: str | Router, selection_bias: Array | None,
                 token_rounding: str | None, tile: int,
                 expert_ids: Array | None = None, *,
                 expert_scale: Array | None = None) -> tuple[RoundedRouting, RouterOutput]:
  """`route` (expert_ids: as there), then `round_tokens` when token_rounding is
  not None (an empty extra-pair list otherwise), then each pair's weight times `expert_scale`
  (E,) of its expert where given. Returns (the routing the experts see, the token-choice routing
  it started from)."""
  if expert_scale is not None and jnp.shape(expert_scale) != (logits.shape[-1],):
    raise ValueError(f"expert_scale must have shape (E,) = ({logits.shape[-1]},), got "
                     f"{jnp.shape(expert_scale)}")
  routed = route(logits, top_k, routing, selection_bias, expert_ids)
  if token_rounding is None:
    empty = jnp.zeros((0,), jnp.int32)
    rounded = RoundedRouting(routed.scores, routed.expert_ids, empty, empty,
                             jnp.zeros((0,), routed.scores.dtype), routed.probs)
    return _scaled_by_expert(rounded, expert_scale), routed
  if token_rounding not in TOKEN_ROUNDINGS:
    raise ValueError(f"token_rounding must be None or one of {TOKEN_ROUNDINGS}, "
                     f"got {token_rounding!r}")
  reason = rounding_unsupported(routing)
  if reason is not None:
    raise ValueError(reason)
  _warn_if_most_pairs_drop(token_rounding, logits.shape[0], top_k, logits.shape[-1], tile)
  rounded = round_tokens(routed, tile, token_rounding, logits=logits)
  scale = get_router(routing).routed_scaling_factor
  if scale != 1.0:  # the added pairs' raw probabilities, scaled as the slot pairs' weights are
    rounded = rounded._replace(extra_scores=rounded.extra_scores * scale)
  return _scaled_by_expert(rounded, expert_scale), routed


def _scaled_by_expert(rounded: RoundedRouting, expert_scale: Array | None) -> RoundedRouting:
  """Each pair's weight times its expert's entry of expert_scale (E,) (Gemma 4); differentiable
  in both. Pairs routed nowhere keep weight 0."""
  if expert_scale is None:
    return rounded
  e_count = expert_scale.shape[0]
  def of(ids):
    picked = take_shared(expert_scale, jnp.clip(ids, 0, e_count - 1))
    return jnp.where((ids >= 0) & (ids < e_count), picked, 0).astype(rounded.scores.dtype)
  return rounded._replace(scores=rounded.scores * of(rounded.expert_ids),
                          extra_scores=rounded.extra_scores * of(rounded.extra_experts))


def extra_scores_or_none(rounded: RoundedRouting) -> Array | None:
  """The extra pairs' scores for `experts.mixture`: None when there are none, since a zero-size
  differentiable input crashes XLA:CPU's collectives under shard_map on jax 0.11.2."""
  return rounded.extra_scores if rounded.extra_scores.shape[0] else None


def sequence_balance_loss(probs: Array, expert_ids: Array) -> Array:
  """DeepSeek-V2/V3's (and MaxText's) sequence-wise balance loss, averaged over sequences.

  probs (B, S, E): per-token router distributions (`RouterOutput.probs`: softmax, or sigmoid gates
  normalised over E); expert_ids (B, S, K), ids outside [0, E) not counted. Per sequence,
  f_e = E / (K S) * (pairs routed to e) (not differentiable) and P_e = mean_t probs[t, e]; the loss
  is sum_e f_e P_e (1 when uniform), averaged over the B sequences.
  """
  from sonic_jax import checks  # checks imports this module
  checks.check_array("probs", probs)
  check_integer_array("expert_ids", expert_ids)
  if probs.ndim != 3 or expert_ids.ndim != 3 or probs.shape[:2] != expert_ids.shape[:2]:
    raise ValueError(f"probs must be (B, S, E) and expert_ids (B, S, K) with the same B and S, got "
                     f"{probs.shape} and {expert_ids.shape}")
  batch, seq, e_count = probs.shape
  if batch == 0 or seq == 0:
    return jnp.zeros((), probs.dtype)  # no tokens: no imbalance (as `moe`'s loss for T = 0)
  k_count = expert_ids.shape[2]
  counts = jax.vmap(lambda ids: expert_counts(ids, e_count))(expert_ids)  # (B, E)
  f = counts.astype(probs.dtype) * (e_count / max(k_count * seq, 1))
  p = jnp.mean(probs, axis=1)
  return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, axis=-1))


def hf_load_balancing_loss(router_logits, top_k: int, attention_mask: Array | None = None) -> Array:
  """transformers' `load_balancing_loss_func` over all layers (Mixtral, Qwen-MoE, OLMoE, ...).

  router_logits: a sequence of (T, E) logits, one per layer (`aux.stats.router_logits`), or
  one (T, E) or (L, T, E) array; attention_mask: optional (B, S) with B * S = T, 0 for padding
  tokens. As in transformers, the layers' tokens are pooled (their logits concatenated) before the
  fractions and means multiply: E * sum_{k, e} (fraction of all layers' tokens whose k-th choice
  is e) * (mean probability of e over them); L equal layers give one layer's loss.
  top_k: K, the experts each token chose (the model's num_experts_per_tok), 1 <= K <= E.
  Returns a () scalar, float32 (float64 for float64 logits); 0 with no tokens, or none unmasked.
  The per-layer `MoEAux.load_balance_loss` differs (its f sums to 1 per layer).
  """
  from sonic_jax import checks  # checks imports this module
  if hasattr(router_logits, "ndim"):  # one array: its rows, not a Python loop over them
    layers = {"router_logits": router_logits}
  elif not isinstance(router_logits, (str, bytes, Mapping)) and hasattr(router_logits, "__iter__") \
      and (listed := list(router_logits)):
    layers = {f"router_logits[{i}]": l for i, l in enumerate(listed)}
  else:
    raise TypeError(f"router_logits must be an array or a non-empty list of arrays, one per layer, "
                    f"got {router_logits!r:.80}")
  for name, l in layers.items():
    checks.check_array(name, l)
    if l.ndim < 2:
      raise ValueError(f"{name} must be (..., T, E) logits, got shape {tuple(l.shape)}")
  if len({l.shape[-1] for l in layers.values()}) > 1:
    raise ValueError(f"router_logits' layers must have one E (their last dim), got shapes "
                     f"{[tuple(l.shape) for l in layers.values()]}")
  logits = jnp.concatenate([jnp.asarray(l).reshape(-1, l.shape[-1]) for l in layers.values()])
  if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral):
    raise TypeError(f"top_k must be an int, got {top_k!r}")
  if not 1 <= top_k <= logits.shape[-1]:
    raise ValueError(f"top_k must be in [1, E = {logits.shape[-1]}], got {top_k}")
  logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
  e_count = logits.shape[-1]
  probs = jax.nn.softmax(logits, axis=-1)
  ids = jax.lax.top_k(jax.lax.stop_gradient(probs), top_k)[1]
  mask = jax.nn.one_hot(ids, e_count, dtype=probs.dtype)  # (N, K, E)
  if logits.shape[0] == 0:
    return jnp.zeros((), logits.dtype)  # no tokens: no imbalance (as `moe`'s loss for T = 0)
  if attention_mask is None:
    tokens_per_expert = jnp.mean(mask, axis=0)
    prob_per_expert = jnp.mean(probs, axis=0)
  else:
    if not hasattr(attention_mask, "shape"):
      raise TypeError(f"attention_mask must be None or a (B, S) array, got "
                      f"{type(attention_mask).__name__}")
    per_layer = attention_mask.size
    if not per_layer or logits.shape[0] % per_layer:
      raise ValueError(f"attention_mask has {per_layer} tokens, which do not divide the "
                       f"{logits.shape[0]} rows of router_logits")
    m = jnp.tile(attention_mask.reshape(-1), logits.shape[0] // per_layer).astype(probs.dtype)
    # No unmasked token: the sums are 0, and so is the loss (as with no tokens), not 0 / 0.
    tokens = jnp.where(jnp.sum(m) > 0, jnp.sum(m), 1)
    tokens_per_expert = jnp.sum(mask * m[:, None, None], axis=0) / tokens
    # A masked token's row is left out, not multiplied by 0: a NaN there (padding) stays out.
    prob_per_expert = jnp.sum(jnp.where(m[:, None] != 0, probs * m[:, None], 0),
                              axis=0) / tokens
  return e_count * jnp.sum(tokens_per_expert * prob_per_expert[None, :])
