"""The expert mixture with SonicMoE's low-activation backward, as one `jax.custom_vjp` (`mixture`;
`expert_mixture` checks its arguments first).

Forward: H = gather(x) @ w1 (+b1) and A = act(H) (up-projection), Y = A @ w2 (+b2) (down-projection),
y_t = sum_k s_tk * Y[row(t, k)] (gather-sum aggregation). Saved for backward: x, H, the scores and
the integer grouped layout; not A, not Y, not a gathered copy of x. The backward recomputes A from H
inside the dH role and gets the score gradient there too, dS = <dO W2^T, A>, so Y is never needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sonic_jax import activations as acts
from sonic_jax.backends import Backend, resolve_backend
from sonic_jax.batching import unsplit
from sonic_jax.checks import check_array, check_experts, check_rank
from sonic_jax.config import Config, check_config
from sonic_jax.layout import GroupedLayout
from sonic_jax.varying import like_primal

Array = jax.Array


def scores_by_row(scores: Array, extra_scores: Array | None, layout: GroupedLayout) -> Array:
  """(R,) the score of each grouped row's pair (slot pairs, then extra pairs); 0 for padding."""
  flat = scores.reshape(-1)
  if extra_scores is not None:
    flat = jnp.concatenate([flat, extra_scores.astype(scores.dtype)])
  return jnp.where(layout.row_valid(), flat[jnp.maximum(layout.row_pair, 0)], 0.0)


def _pair_values(row_values: Array, layout: GroupedLayout) -> tuple[Array, Array]:
  """Row-indexed (R,) values back to pair order: (T, S) and (X,); 0 for pairs routed nowhere."""
  last = row_values.shape[0] - 1
  slots = jnp.where(layout.pair_valid(), row_values[jnp.minimum(layout.pair_row, last)], 0.0)
  extra = jnp.where(layout.extra_valid(), row_values[jnp.minimum(layout.extra_row, last)], 0.0)
  return slots, extra


def expert_mixture(x: Array, scores: Array, layout: GroupedLayout, w1: Array, w2: Array, *,
                   extra_scores: Array | None = None, b1: Array | None = None,
                   b2: Array | None = None, activation: str | acts.Activation = "swiglu",
                   gate_up_layout: str = "concat", backend: str | Backend = "auto",
                   config: Config | None = None) -> Array:
  """y (T, d) in x's dtype = sum over each token's routed experts of score * expert(x_t), on a
  grouped layout you built (`build_grouped_layout`; `routed_experts` builds it for you).

  x (T, d); scores (T, S) float weights of the layout's slot pairs; the layout built from (T, S)
  expert ids over w1's E experts with the backend's `row_tile`
  (`sonic_jax.backends.resolve_backend(backend, config).row_tile`: 32 for the xla backend on a
  CPU, 128 elsewhere); w1, w2, b1, b2, activation, gate_up_layout: as `sonic_jax.moe`; extra_scores
  (X,): the weights of the layout's extra pairs (required when it has some). backend: a name of
  `sonic_jax.BACKENDS` (resolved with `config`, a `sonic_jax.Config`) or a resolved `Backend`.
  Differentiable in x, scores, extra_scores, w1, w2, b1 and b2.
  """
  act = check_experts(x, w1, w2, b1, b2, activation, gate_up_layout)
  check_array("scores", scores)
  w1, w2, b1, b2 = unsplit("expert_mixture", "experts", w1=w1, w2=w2, b1=b1, b2=b2)
  x, scores, extra_scores = unsplit("expert_mixture", "tokens", x=x, scores=scores,
                                    extra_scores=extra_scores)
  config = check_config(config)  # used to resolve a backend given by name
  impl = backend if isinstance(backend, Backend) else resolve_backend(backend, config)
  if not isinstance(layout, GroupedLayout):
    raise TypeError(f"layout must be a sonic_jax.GroupedLayout, got {type(layout).__name__}")
  rows = layout.num_rows
  if layout.num_experts != w1.shape[0]:
    raise ValueError(f"layout is built for {layout.num_experts} experts, but w1 holds "
                     f"{w1.shape[0]}")
  if rows and layout.row_tile != impl.row_tile:
    raise ValueError(f"layout must be built with the backend's row_tile = {impl.row_tile}, got "
                     f"one built with {layout.row_tile}")
  check_rank("scores", scores, 2, f"(T, S) = {tuple(layout.pair_row.shape)}, the layout's")
  if scores.shape != layout.pair_row.shape or scores.shape[0] != x.shape[0]:
    raise ValueError(f"scores must have the layout's shape (T, S) = {tuple(layout.pair_row.shape)} "
                     f"with T = {x.shape[0]} (x's), got {tuple(scores.shape)}")
  num_extra = layout.extra_row.shape[0]
  if extra_scores is None and num_extra:
    raise ValueError(f"extra_scores must be given: the layout has {num_extra} extra pairs")
  if extra_scores is not None:
    check_array("extra_scores", extra_scores)
    if extra_scores.shape != (num_extra,):
      raise ValueError(f"extra_scores must have shape (X,) = ({num_extra},), the layout's extra "
                       f"pairs, got {tuple(extra_scores.shape)}")
  # float32 weights at least, as the router gives them (the cotangents come back in the inputs')
  scores = jnp.asarray(scores).astype(jnp.promote_types(scores.dtype, jnp.float32))
  if extra_scores is not None:
    extra_scores = jnp.asarray(extra_scores).astype(scores.dtype) if num_extra else None
  x, w1, w2 = map(jnp.asarray, (x, w1, w2))
  b1, b2 = (None if b is None else jnp.asarray(b) for b in (b1, b2))
  if not (x.shape[0] and x.shape[1] and rows):  # no tokens, d = 0 or no pairs: nothing to run
    return jnp.zeros_like(x)
  return mixture(x, scores, extra_scores, layout, w1, w2, b1, b2, act, gate_up_layout, impl)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def mixture(x: Array, scores: Array, extra_scores: Array | None, layout: GroupedLayout, w1: Array,
            w2: Array, b1: Array | None, b2: Array | None, activation: acts.Activation,
            gate_up_layout: str, backend: Backend) -> Array:
  """`expert_mixture` on checked arguments and a resolved activation and backend.

  `scores` (T, S) float32 weights the slot pairs of `layout` (built from the (T, S) expert ids with
  the backend's `row_tile`) and `extra_scores` (X,) its extra pairs (None when it has none).
  Differentiable in x, scores, extra_scores, w1, w2, b1, b2.
  """
  y, _ = _forward(x, scores, extra_scores, layout, w1, w2, b1, b2, activation, gate_up_layout,
                  backend)
  return y


def _forward(x, scores, extra_scores, layout, w1, w2, b1, b2, activation, gate_up_layout, backend):
  h, a = backend.up_projection(x, w1, b1, layout, activation, gate_up_layout)
  y_rows = backend.down_projection(a, w2, b2, layout)
  y = backend.gather_sum(y_rows, layout, scores, x.dtype, extra_scores)
  return y, (x, h, scores, extra_scores, layout, w1, w2, b1, b2)


def _backward(activation, gate_up_layout, backend, residuals, d_y):
  x, h, scores, extra_scores, layout, w1, w2, b1, b2 = residuals
  row_scores = scores_by_row(scores, extra_scores, layout)
  # d_y_rows: the dO rows in grouped order if the dH role wrote them to HBM, else None.
  d_h, a_s, d_s_rows, d_y_rows = backend.dh_projection(d_y, h, row_scores, w2, b2, layout,
                                                       activation, gate_up_layout)
  dw1, dw2, db1, db2 = backend.weight_grads(x, d_y, d_y_rows, d_h, a_s, row_scores, layout,
                                            b1 is not None, b2 is not None)
  dx_rows = backend.dx_projection(d_h, w1, layout)
  d_x = backend.gather_sum(dx_rows, layout, None, x.dtype)
  d_scores, d_extra = _pair_values(d_s_rows, layout)
  # Each cotangent in its primal's dtype and shard_map type (`varying.like_primal`: a weight
  # replicated over a data axis gets its gradient summed over it).
  cast = lambda g, p: None if p is None else like_primal(g.astype(p.dtype), p)
  return (cast(d_x, x), cast(d_scores, scores), cast(d_extra, extra_scores), None,
          cast(dw1, w1), cast(dw2, w2), cast(db1, b1), cast(db2, b2))


mixture.defvjp(_forward, _backward)
