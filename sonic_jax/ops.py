"""`sonic_jax.moe`: the functional Mixture-of-Experts layer."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sonic_jax import activations as acts
from sonic_jax import routing as routing_lib
from sonic_jax.backends import resolve_backend
from sonic_jax.config import Config, check_config
from sonic_jax.experts import expert_mixture
from sonic_jax.layout import build_grouped_layout

Array = jax.Array


class MoEAux(NamedTuple):
  """What `moe` returns beside the output: routing results and the router's auxiliary losses."""

  expert_counts: Array  # (E,) int32: (token, expert) pairs routed to each expert
  expert_ids: Array  # (T, K) int32
  scores: Array  # (T, K) float32
  router_logits: Array  # (T, E) float32
  load_balance_loss: Array  # () float32: E * sum_e f_e * P_e (1 when uniform)
  z_loss: Array  # () float32: mean logsumexp(logits)^2
  # Pairs that token rounding added beyond the K slots ((0,)-shaped without token rounding):
  extra_tokens: Array | None = None  # (X,) int32, T for unused entries
  extra_experts: Array | None = None  # (X,) int32, E for unused entries
  extra_scores: Array | None = None  # (X,) float32
  padded_rows: Array | None = None  # () int32: rows of the grouped GEMMs that hold no pair
  # Expert parallelism with a capacity (`sonic_jax.parallel.moe_all_to_all`): pairs of the whole
  # expert axis that did not fit their receiver's buffer and got no output (0 when dropless).
  dropped_pairs: Array | None = None  # () int32


def _check_float(name, a):
  if not jnp.issubdtype(a.dtype, jnp.floating):
    raise TypeError(f"{name} must have a floating dtype, got {a.dtype}")


def _check_rank(name, a, rank, shape_doc):
  if a.ndim != rank:
    raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(a.shape)}")


def _check_array(name, a):
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(a).__name__}")
  _check_float(name, a)


def _validate(x, router_weight, w1, w2, b1, b2, top_k, activation, gate_up_layout,
              num_local_experts=None, selection_bias=None):
  """Checks the arguments of `moe`. The expert weights hold the router's E experts, or
  `num_local_experts` of them when experts are sharded (`sonic_jax.parallel`)."""
  for name, a in (("x", x), ("router_weight", router_weight), ("w1", w1), ("w2", w2)):
    _check_array(name, a)
  act = acts.get_activation(activation)
  if gate_up_layout not in acts.GATE_UP_LAYOUTS:
    raise ValueError(f"gate_up_layout must be one of {acts.GATE_UP_LAYOUTS}, got {gate_up_layout!r}")
  _check_rank("x", x, 2, "(T, d)")
  t_count, d = x.shape
  _check_rank("router_weight", router_weight, 2, f"(d, E) = ({d}, E)")
  if router_weight.shape[0] != d:
    raise ValueError(f"router_weight must have shape (d, E) with d = {d} (x's last dim), "
                     f"got {tuple(router_weight.shape)}")
  e_router = router_weight.shape[1]
  e_count = e_router if num_local_experts is None else num_local_experts
  mult = act.width_multiplier()
  _check_rank("w1", w1, 3, f"(E, d, {'2n' if act.is_glu else 'n'}) = ({e_count}, {d}, ...)")
  if w1.shape[0] != e_count or w1.shape[1] != d:
    raise ValueError(f"w1 must have shape (E, d, {'2n' if act.is_glu else 'n'}) with E = {e_count}, "
                     f"d = {d}, got {tuple(w1.shape)}")
  if w1.shape[2] % mult or w1.shape[2] == 0:
    what = "2n (even and > 0) for the GLU" if act.is_glu else "n (> 0) for the"
    raise ValueError(f"w1's last dim must be {what} activation {activation!r}, got {w1.shape[2]}")
  n = w1.shape[2] // mult
  _check_rank("w2", w2, 3, f"(E, n, d) = ({e_count}, {n}, {d})")
  if tuple(w2.shape) != (e_count, n, d):
    hint = ""
    if w2.shape[1] == w1.shape[2] and act.is_glu:
      hint = " (w1 is 2n wide for a GLU activation, so n is half of w1's last dim)"
    elif w2.shape[1] * 2 == w1.shape[2] and not act.is_glu:
      hint = f" (w1 looks 2n wide: is {activation!r} meant to be a GLU activation?)"
    raise ValueError(f"w2 must have shape (E, n, d) = ({e_count}, {n}, {d}), got "
                     f"{tuple(w2.shape)}{hint}")
  for name, a in (("w1", w1), ("w2", w2)):
    if a.dtype != x.dtype:
      raise TypeError(f"{name} must have x's dtype {x.dtype}, got {a.dtype} (cast the expert "
                      "weights to the compute dtype; the Flax layer does this for you)")
  for name, b, shape in (("b1", b1, (e_count, w1.shape[2])), ("b2", b2, (e_count, d))):
    if b is None:
      continue
    if not hasattr(b, "shape"):
      raise TypeError(f"{name} must be an array or None, got {type(b).__name__}")
    _check_float(name, b)
    if tuple(b.shape) != shape:
      raise ValueError(f"{name} must have shape {shape}, got {tuple(b.shape)}")
    if b.dtype != x.dtype:
      raise TypeError(f"{name} must have x's dtype {x.dtype}, got {b.dtype}")
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)):
    raise TypeError(f"top_k must be a Python int, got {type(top_k).__name__}")
  if not 1 <= top_k <= e_router:
    raise ValueError(f"top_k must be in [1, E] = [1, {e_router}], got {top_k}")
  if selection_bias is not None:
    _check_array("selection_bias", selection_bias)
    if tuple(selection_bias.shape) != (e_router,):
      raise ValueError(f"selection_bias must have shape (E,) = ({e_router},), got "
                       f"{tuple(selection_bias.shape)}")
  return act


def moe(x: Array, router_weight: Array, w1: Array, w2: Array, *, top_k: int,
        activation: str = "swiglu", routing: str = "softmax_topk", gate_up_layout: str = "concat",
        b1: Array | None = None, b2: Array | None = None, selection_bias: Array | None = None,
        token_rounding: str | None = None, backend: str = "auto",
        config: Config | None = None) -> tuple[Array, MoEAux]:
  """A token-choice Mixture-of-Experts layer with SonicMoE's low-activation-memory backward.

  Args:
    x: (T, d) tokens.
    router_weight: (d, E); logits = x @ router_weight with float32 accumulation.
    w1: (E, d, 2n) for GLU activations ("swiglu", "geglu", "reglu"), (E, d, n) otherwise.
    w2: (E, n, d).
    top_k: K, the experts per token, 1 <= K <= E.
    activation: "swiglu", "geglu", "reglu" (act(gate) * up) or "gelu" (exact erf form), "relu",
      "relu_sq", "silu".
    routing: "softmax_topk", "topk_softmax", "topk_softmax_raw" or "sigmoid_topk"
      (see `sonic_jax.routing.route`).
    gate_up_layout: for GLU activations, "concat" (w1[..., :n] is the gate, w1[..., n:] the up
      projection) or "interleaved" (gate and up alternate column by column).
    b1: optional (E, 2n) or (E, n) up-projection bias. b2: optional (E, d) down-projection bias.
    selection_bias: optional (E,) bias that moves the expert selection but not the scores
      (auxiliary-loss-free balancing; no gradient flows into it).
    token_rounding: None (plain top-K), or "down", "up", "nearest": SonicMoE's tile-aware token
      rounding for training (`sonic_jax.routing.round_tokens`), which moves every expert's token
      count to a multiple of the backend's row tile so that its grouped GEMMs compute no padding
      rows. Needs a softmax routing ("softmax_topk", "topk_softmax", "topk_softmax_raw"). The
      pairs it adds are in `aux.extra_*`; dropped slot pairs get expert id -1 and score 0.
    backend: "auto", "xla" or "mosaic_gpu".
    config: a `sonic_jax.Config` (implementation choices and kernel tuning; None: the defaults).
      Static: under `jax.jit` pass it by closure or as a static argument.

  Returns:
    (y, aux): y has x's shape and dtype; aux is a `MoEAux`.

  Gradients flow to x (through the experts and the router), router_weight, w1, w2, b1 and b2. The
  backward keeps only x, the pre-activation H, the scores and integer routing metadata.
  """
  act = _validate(x, router_weight, w1, w2, b1, b2, top_k, activation, gate_up_layout,
                  selection_bias=selection_bias)
  x, router_weight, w1, w2 = map(jnp.asarray, (x, router_weight, w1, w2))
  b1, b2 = (None if b is None else jnp.asarray(b) for b in (b1, b2))
  if routing not in routing_lib.ROUTINGS:
    raise ValueError(f"routing must be one of {routing_lib.ROUTINGS}, got {routing!r}")
  config = check_config(config)
  impl = resolve_backend(backend, config)
  e_count = router_weight.shape[1]
  t_count, d = x.shape
  logits, ids = routing_lib.router_logits_and_ids(x, router_weight, top_k, routing,
                                                  selection_bias, config=config)
  routed, _ = routing_lib.route_tokens(logits, top_k, routing, selection_bias, token_rounding,
                                       impl.row_tile, ids)
  layout = build_grouped_layout(routed.expert_ids, e_count, impl.row_tile, routed.extra_tokens,
                                routed.extra_experts, config=config)
  if t_count and d:
    y = expert_mixture(x, routed.scores, routing_lib.extra_scores_or_none(routed), layout, w1,
                       w2, b1, b2, act, gate_up_layout, impl)
  else:  # no tokens, or d = 0: the output is empty and no expert has work (no GEMM of size 0)
    y = jnp.zeros_like(x)
  no_tokens = lambda loss: loss if t_count else jnp.zeros((), loss.dtype)  # a mean over none
  aux = MoEAux(
      expert_counts=layout.expert_counts,
      expert_ids=routed.expert_ids,
      scores=routed.scores,
      router_logits=logits,
      load_balance_loss=no_tokens(routing_lib.load_balance_loss(routed.probs,
                                                                layout.expert_counts)),
      z_loss=no_tokens(routing_lib.z_loss(logits)),
      extra_tokens=routed.extra_tokens,
      extra_experts=routed.extra_experts,
      extra_scores=routed.extra_scores,
      padded_rows=jnp.sum(layout.group_sizes - layout.expert_counts),
      dropped_pairs=jnp.zeros((), jnp.int32),
  )
  return y, aux
