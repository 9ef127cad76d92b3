"""An independent float64 oracle: the MoE layer written from the math, one expert at a time.

Nothing here imports sonic_jax. Routing picks the top-K logits (softmax and sigmoid are monotone,
so every routing selects the same experts) with NumPy, and the expert path runs every token through
every expert densely, weighting by the token's score for that expert (zero when not routed there).
Gradients are JAX autodiff of this plain function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

def _clamped_swiglu(gate, up, alpha=1.702, limit=7.0):
  """gpt-oss's expert activation as transformers writes it."""
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return gate * jax.nn.sigmoid(gate * alpha) * (up + 1)


GLU_FNS = {"clamped_swiglu": _clamped_swiglu}  # GLU activations that are not act(gate) * up

ACT_FNS = {
    "swiglu": (jax.nn.silu, True),
    "geglu_tanh": (lambda g: jax.nn.gelu(g, approximate=True), True),
    "gelu_tanh": (lambda g: jax.nn.gelu(g, approximate=True), False),
    "clamped_swiglu": (None, True),
    "geglu": (lambda g: jax.nn.gelu(g, approximate=False), True),
    "reglu": (jax.nn.relu, True),
    "gelu": (lambda g: jax.nn.gelu(g, approximate=False), False),
    "relu": (jax.nn.relu, False),
    "relu_sq": (lambda g: jnp.square(jax.nn.relu(g)), False),
    "silu": (jax.nn.silu, False),
}


def select_experts(x, router_weight, top_k):
  logits = np.asarray(x, np.float64) @ np.asarray(router_weight, np.float64)
  return np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]


def routing_scores(logits, ids, routing):
  if routing == "softmax_topk":
    return jax.nn.softmax(jnp.take_along_axis(logits, ids, axis=-1), axis=-1)
  if routing in ("topk_softmax", "topk_softmax_raw"):
    top = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), ids, axis=-1)
    return top / jnp.sum(top, -1, keepdims=True) if routing == "topk_softmax" else top
  if routing in ("sigmoid_topk", "sigmoid_topk_raw"):
    top = jnp.take_along_axis(jax.nn.sigmoid(logits), ids, axis=-1)
    return top / jnp.sum(top, -1, keepdims=True) if routing == "sigmoid_topk" else top
  raise ValueError(routing)


def expert_forward(x_e, w1_e, b1_e, w2_e, b2_e, activation, gate_up_layout):
  """One expert on a batch of rows: returns (H, Y)."""
  fn, glu = ACT_FNS[activation]
  h = x_e @ w1_e + b1_e
  if glu:
    n = h.shape[-1] // 2
    if gate_up_layout == "concat":
      gate, up = h[:, :n], h[:, n:]
    else:
      gate, up = h[:, 0::2], h[:, 1::2]
    a = GLU_FNS[activation](gate, up) if activation in GLU_FNS else fn(gate) * up
  else:
    a = fn(h)
  return h, a @ w2_e + b2_e


def moe_reference(x, router_weight, w1, w2, b1, b2, ids, *, routing, activation, gate_up_layout):
  """y (T, d) in float64; ids (T, K) fixed (from `select_experts`)."""
  e_count = w1.shape[0]
  b1 = jnp.zeros(w1.shape[::2], w1.dtype) if b1 is None else b1
  b2 = jnp.zeros((e_count, w2.shape[2]), w2.dtype) if b2 is None else b2
  logits = x @ router_weight
  scores = routing_scores(logits, jnp.asarray(ids), routing)
  y = jnp.zeros_like(x)
  for e in range(e_count):
    weight = jnp.sum(jnp.where(jnp.asarray(ids) == e, scores, 0.0), axis=-1)  # (T,)
    _, y_e = expert_forward(x, w1[e], b1[e], w2[e], b2[e], activation, gate_up_layout)
    y = y + weight[:, None] * y_e
  return y


def _values_and_grads(inputs, d_y, forward, compiled=False):
  names = [k for k, v in inputs.items() if v is not None]
  with jax.enable_x64(True):
    args64 = {k: (None if v is None else jnp.asarray(np.asarray(v, np.float64)))
              for k, v in inputs.items()}
    d_y64 = jnp.asarray(np.asarray(d_y, np.float64))

    def loss(*flat):
      a = dict(args64)
      a.update(zip(names, flat))
      y = forward(a["x"], a["router_weight"], a["w1"], a["w2"], a.get("b1"), a.get("b2"))
      return jnp.vdot(y, d_y64), y

    vg = jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True)
    # Eagerly by default: one pytest process caches each op's program across tests; a script's fresh
    # process (`compiled=True`) compiles one program instead of each op.
    (_, y), grads = (jax.jit(vg) if compiled else vg)(*[args64[k] for k in names])
    return np.asarray(y), {k: np.asarray(g) for k, g in zip(names, grads)}


def reference_values_and_grads(inputs, d_y, ids, **kw):
  """Float64 output and gradients w.r.t. every array in `inputs` (a dict; None entries skipped)."""
  return _values_and_grads(inputs, d_y, lambda *a: moe_reference(*a, ids, **kw))


def reference_values_and_grads_masks(inputs, d_y, tc, kept, added, compiled=False, **kw):
  """The same for a general routing given as masks (`moe_reference_masks`)."""
  return _values_and_grads(inputs, d_y, lambda *a: moe_reference_masks(*a, tc, kept, added, **kw),
                           compiled)


def rel_err(got, want):
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if not np.all(np.isfinite(got)):
    return np.inf
  denom = np.linalg.norm(want)
  return float(np.linalg.norm(got - want) / (denom if denom > 0 else 1.0))



def token_rounding_reference(probs, top_k, tile, mode):
  """SonicMoE's token rounding written as its benchmark script does, in NumPy float64.

  Returns (tc, kept, added), three (T, E) bool masks: the token-choice (top-K) pairs, the TC pairs
  that stay and the pairs that rounding adds. Each expert ranks all tokens by C = its renormalised
  TC score for its TC tokens, P - 1 for the others, and takes the first target-many.
  """
  probs = np.asarray(probs, np.float64)
  t_count, e_count = probs.shape
  ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
  tc = np.zeros_like(probs, bool)
  np.put_along_axis(tc, ids, True, axis=-1)
  top = np.take_along_axis(probs, ids, axis=-1)
  renorm = np.zeros_like(probs)
  np.put_along_axis(renorm, ids, top / top.sum(-1, keepdims=True), axis=-1)
  c = np.where(tc, renorm, probs - 1.0)
  counts = tc.sum(0)
  rounder = {"down": np.floor, "up": np.ceil, "nearest": np.round}[mode]
  target = np.minimum(rounder(counts / tile).astype(int) * tile, t_count)
  chosen = np.zeros_like(tc)
  for e in range(e_count):
    order = np.argsort(-c[:, e], kind="stable")
    chosen[order[:target[e]], e] = True
  return tc, chosen & tc, chosen & ~tc


def moe_reference_masks(x, router_weight, w1, w2, b1, b2, tc, kept, added, *, activation,
                        gate_up_layout):
  """y for a general routing given as (T, E) masks: token t's weight for expert e is its top-K
  softmax score renormalised over the TC set `tc` where (t, e) is in `kept`, its raw softmax
  probability where (t, e) is in `added`, else 0."""
  e_count = w1.shape[0]
  b1 = jnp.zeros(w1.shape[::2], w1.dtype) if b1 is None else b1
  b2 = jnp.zeros((e_count, w2.shape[2]), w2.dtype) if b2 is None else b2
  probs = jax.nn.softmax(x @ router_weight, axis=-1)
  renorm = probs / jnp.sum(jnp.where(jnp.asarray(tc), probs, 0.0), -1, keepdims=True)
  weights = jnp.where(jnp.asarray(kept), renorm, 0.0) + jnp.where(jnp.asarray(added), probs, 0.0)
  y = jnp.zeros_like(x)
  for e in range(e_count):
    _, y_e = expert_forward(x, w1[e], b1[e], w2[e], b2[e], activation, gate_up_layout)
    y = y + weights[:, e][:, None] * y_e
  return y


def route_reference(logits, top_k, *, scoring="softmax", renormalize=True, renorm_epsilon=0.0,
                    renorm_p=1.0, n_group=1, topk_group=1, group_score="max", scaling=1.0,
                    selection_bias=None, bias_on="scores", ids=None):
  """The families' routers from their description (model-families.md), in NumPy float64 for the
  selection: returns (ids (T, K), a function logits -> (T, K) weights for autodiff). ids: a fixed
  selection to weight instead (hash routing)."""
  logits = np.asarray(logits, np.float64)
  score_fn = {"softmax": lambda l: jax.nn.softmax(l, axis=-1), "sigmoid": jax.nn.sigmoid,
              "sqrt_softplus": lambda l: jnp.sqrt(jnp.logaddexp(l, 0.0))}[scoring]
  with jax.enable_x64(True):
    scores = np.asarray(score_fn(jnp.asarray(logits)))
  choice = (scores if bias_on == "scores" else logits).copy()
  if selection_bias is not None:
    choice = choice + np.asarray(selection_bias, np.float64)
  t_count, e_count = choice.shape
  if n_group > 1:
    per = e_count // n_group
    for t in range(t_count):
      groups = choice[t].reshape(n_group, per)
      g_score = (groups.max(-1) if group_score == "max"
                 else np.sort(groups, -1)[:, -2:].sum(-1))
      keep = np.argsort(-g_score, kind="stable")[:topk_group]
      masked = np.full(n_group, True)
      masked[keep] = False
      choice[t].reshape(n_group, per)[masked] = -np.inf
  if ids is None:
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]

  def weights(l):
    w = jnp.take_along_axis(score_fn(l), jnp.asarray(ids), axis=-1)
    if renormalize:
      w = w / (jnp.sum(w ** renorm_p, -1, keepdims=True) ** (1.0 / renorm_p) + renorm_epsilon)
    return w * scaling

  return ids, weights


def moe_reference_weights(x, router_weight, w1, w2, b1, b2, router_bias, ids, weights_fn, *,
                          activation, gate_up_layout, scale_input=False):
  """y (T, d) for fixed ids and weights = weights_fn(logits): sum_k w_k expert_k(x), or with
  scale_input (Llama 4) sum_k expert_k(w_k x)."""
  e_count = w1.shape[0]
  b1 = jnp.zeros(w1.shape[::2], w1.dtype) if b1 is None else b1
  b2 = jnp.zeros((e_count, w2.shape[2]), w2.dtype) if b2 is None else b2
  logits = x @ router_weight + (0.0 if router_bias is None else router_bias)
  w = weights_fn(logits)
  ids = jnp.asarray(ids)
  y = jnp.zeros_like(x)
  for e in range(e_count):
    for k in range(ids.shape[1]):
      w_k = jnp.where(ids[:, k] == e, w[:, k], 0.0)
      if scale_input:
        _, y_e = expert_forward(x * w_k[:, None], w1[e], b1[e], w2[e], b2[e], activation,
                                gate_up_layout)
        y = y + jnp.where((ids[:, k] == e)[:, None], y_e, 0.0)
      else:
        _, y_e = expert_forward(x, w1[e], b1[e], w2[e], b2[e], activation, gate_up_layout)
        y = y + w_k[:, None] * y_e
  return y
