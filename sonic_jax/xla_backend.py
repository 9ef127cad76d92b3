"""The `xla` backend: SonicMoE's algorithm in plain JAX.

It is the CPU path and the reference that the Hopper kernels are tested against: the same roles on
the same grouped layout, the same stored dtypes (H, A, Y, dH, A_s in the compute dtype, float32
accumulation), the same residuals. Gathers are explicit here (XLA materialises them); the kernels
fuse them into their operand loads. Grouped GEMMs are a scan over the layout's row tiles, one small
GEMM per tile: exact FLOPs, differentiable to any order and batchable, but not a fast GPU path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sonic_jax import activations as acts
from sonic_jax.batching import take_shared
from sonic_jax.layout import GroupedLayout
from sonic_jax.varying import varying_axes

Array = jax.Array
_acc = acts.compute_dtype  # float32 accumulation (float64 for float64 inputs)

def _tiles(rows: Array, layout: GroupedLayout) -> Array:
  return rows.reshape(-1, layout.row_tile, *rows.shape[1:])


def _tile_weights(layout: GroupedLayout) -> tuple[Array, Array]:
  """Per tile: the expert index to read weights from (clamped) and whether the tile is in use."""
  used = layout.tile_expert < layout.num_experts
  return jnp.minimum(layout.tile_expert, layout.num_experts - 1), used


def grouped_matmul(rows: Array, weights: Array, layout: GroupedLayout) -> Array:
  """Varlen-M grouped GEMM: out[r] = rows[r] @ weights[expert(r)], (R, m), float32 accumulation.

  A scan over row tiles, each one small GEMM against its expert's weights: the true FLOPs (plus the
  layout's padding), unlike `jax.lax.ragged_dot`, which XLA expands to an E-times-larger dense GEMM;
  and differentiable to any order and batchable, which ragged_dot's varlen-K form is not.
  """
  expert, used = _tile_weights(layout)
  acc = _acc(rows.dtype)

  def tile(_, xs):
    rows_tile, e, in_use = xs
    out = jnp.dot(rows_tile, take_shared(weights, e), preferred_element_type=acc)
    return None, jnp.where(in_use, out, 0.0)

  _, out = jax.lax.scan(tile, None, (_tiles(rows, layout), expert, used))
  return out.reshape(rows.shape[0], weights.shape[-1])


def grouped_matmul_t(rows: Array, weights: Array, layout: GroupedLayout) -> Array:
  """Varlen-M against transposed weights: out[r] = rows[r] @ weights[expert(r)].T."""
  return grouped_matmul(rows, jnp.swapaxes(weights, 1, 2), layout)


def grouped_weight_grad(lhs_rows: Array, rhs_rows: Array, layout: GroupedLayout) -> Array:
  """Varlen-K grouped GEMM: out[e] = sum over e's rows of lhs_rows[r]^T rhs_rows[r], (E, k, m).

  Experts without rows get exact zeros.
  """
  expert, used = _tile_weights(layout)
  acc = _acc(lhs_rows.dtype)
  init = jnp.zeros((layout.num_experts, lhs_rows.shape[1], rhs_rows.shape[1]), acc)
  # Under shard_map the carry must vary over the manual axes that the tiles' products vary over.
  varying = tuple(sorted(set().union(*map(varying_axes, (lhs_rows, rhs_rows, expert)))))
  if varying:
    init = jax.lax.pcast(init, varying, to="varying")

  def tile(total, xs):
    lhs_tile, rhs_tile, e, in_use = xs
    part = jnp.dot(lhs_tile.T, rhs_tile, preferred_element_type=acc)
    return total.at[e].add(jnp.where(in_use, part, 0.0)), None

  total, _ = jax.lax.scan(tile, init, (_tiles(lhs_rows, layout), _tiles(rhs_rows, layout),
                                       expert, used))
  return total


def row_bias(bias: Array, layout: GroupedLayout) -> Array:
  padded = jnp.concatenate([bias, jnp.zeros((1,) + bias.shape[1:], bias.dtype)], axis=0)
  # row_expert == E past the used rows: the zero row
  return take_shared(padded, layout.row_expert).astype(_acc(bias.dtype))


def up_projection(x, w1, b1, layout: GroupedLayout, activation: acts.Activation, gate_up_layout: str):
  """H = gather(x) @ w1_e (+ b1_e); A = act(H). Returns (H, A) in x's dtype, each (R, .)."""
  h = grouped_matmul(x[layout.row_token], w1, layout)
  if b1 is not None:
    h = h + row_bias(b1, layout)
  h = h.astype(x.dtype)
  # As in the kernel epilogue, A comes from the rounded H, so that the backward's recomputation
  # of A gives the same values.
  a = acts.apply_activation(h, activation, gate_up_layout)
  return h, a.astype(x.dtype)


def down_projection(a, w2, b2, layout: GroupedLayout):
  """Y = A @ w2_e (+ b2_e), (R, d), unscaled by the router scores."""
  y = grouped_matmul(a, w2, layout)
  if b2 is not None:
    y = y + row_bias(b2, layout)
  return y.astype(a.dtype)


def gather_sum(rows: Array, layout: GroupedLayout, pair_weights: Array | None, out_dtype,
               extra_weights: Array | None = None) -> Array:
  """out[t] = sum_s w[t, s] * rows[pair_row[t, s]] with float32 accumulation (no scatter).

  Extra pairs (token rounding), when the layout has any, add sum_x w_x * rows[extra_row[x]] to
  their tokens through a segment sum over the X extra rows. Weights of None mean 1.
  """
  valid = layout.pair_valid()
  acc = _acc(rows.dtype)
  gathered = rows[jnp.minimum(layout.pair_row, rows.shape[0] - 1)].astype(acc)  # (T, S, d)
  w = valid.astype(acc) if pair_weights is None else jnp.where(valid, pair_weights.astype(acc), 0.0)
  # where() rather than a multiply alone so that padding garbage can never leak through 0 * inf.
  gathered = jnp.where(valid[..., None], gathered, 0.0)
  out = jnp.einsum("tsd,ts->td", gathered, w)
  if layout.num_extra:  # extra_weights is then an (X,) array or None
    ok = layout.extra_valid()
    extra = rows[jnp.minimum(layout.extra_row, rows.shape[0] - 1)].astype(acc)  # (X, d)
    w_x = ok.astype(acc) if extra_weights is None else jnp.where(ok, extra_weights.astype(acc), 0.0)
    extra = jnp.where(ok[:, None], extra, 0.0) * w_x[:, None]
    # Unused entries carry token T and fall outside the T segments.
    out = out + jax.ops.segment_sum(extra, layout.extra_token, num_segments=out.shape[0])
  return out.astype(out_dtype)


def dh_projection(d_out, h, row_scores, w2, b2, layout: GroupedLayout,
                  activation: acts.Activation, gate_up_layout: str):
  """The dH role: dA' = gather(dO) @ w2_e^T, then from H: dH = s*act'(H, dA'), A_s = s*A, dS.

  dS_r = <dA'_r, A_r> (+ <dO_t, b2_e>) equals <dO_t, Y_r> without Y having been stored.
  Returns dH (R, .), A_s (R, n) in H's dtype, dS (R,) float32 and the gathered dO rows (R, d) that
  it read, or None: `weight_grads` takes them for dw2 and db2 (a backend whose dH kernel gathers
  the rows as it loads them returns None, or rows it gathered for the b2 term).
  """
  valid = layout.row_valid()[:, None]
  # Masked, not only multiplied by the padding rows' zero scores: the row padding reads must not
  # reach dS, dw2 or db2 through 0 * inf.
  d_out_rows = jnp.where(valid, d_out[layout.row_token], 0)
  d_a = grouped_matmul_t(d_out_rows, w2, layout)
  a, d_h = acts.activation_backward(h, d_a, activation, gate_up_layout)
  d_s = jnp.sum(d_a * a, axis=-1)
  if b2 is not None:
    d_s = d_s + bias_score_term(d_out_rows, b2, layout, d_a.dtype)
  s = row_scores[:, None]
  d_h = jnp.where(valid, s * d_h, 0.0).astype(h.dtype)
  a_s = jnp.where(valid, s * a, 0.0).astype(h.dtype)
  d_s = jnp.where(layout.row_valid(), d_s, 0.0)
  return d_h, a_s, d_s, d_out_rows


def bias_score_term(d_out_rows, b2, layout: GroupedLayout, dtype):
  """(R,) <dO_t, b2_e> of each grouped row: dS's term from the down-projection's bias (Y = A w2
  + b2), in `dtype`."""
  return jnp.sum(d_out_rows.astype(dtype) * row_bias(b2, layout), axis=-1)


def bias_grads(d_out_rows, d_h, row_scores, layout: GroupedLayout, with_b1: bool, with_b2: bool):
  """(db1, db2): per-expert sums of dH and of s * dO rows (None for a bias not in use).

  Rows of tiles past the layout's used tiles are ignored (their row_expert is E)."""
  e_count = layout.num_experts
  db1 = db2 = None
  if with_b1:
    db1 = jax.ops.segment_sum(d_h.astype(_acc(d_h.dtype)), layout.row_expert, num_segments=e_count)
  if with_b2:
    s = jnp.where(layout.row_valid(), row_scores, 0.0)[:, None]
    scaled = s * d_out_rows.astype(_acc(d_out_rows.dtype))
    db2 = jax.ops.segment_sum(scaled, layout.row_expert, num_segments=e_count)
  return db1, db2


def weight_grads(x, d_out, d_out_rows, d_h, a_s, row_scores, layout: GroupedLayout, with_b1: bool,
                 with_b2: bool):
  """dw1 = gather(x)^T dH, dw2 = A_s^T gather(dO) per expert (varlen-K); db1, db2 when used.
  d_out_rows: what `dh_projection` returned (dO[row_token]), or None: then gathered here."""
  valid = layout.row_valid()[:, None]  # masked as in dh_projection
  x_rows = jnp.where(valid, x[layout.row_token], 0)
  if d_out_rows is None:
    d_out_rows = jnp.where(valid, d_out[layout.row_token], 0)
  dw1 = grouped_weight_grad(x_rows, d_h, layout)
  dw2 = grouped_weight_grad(a_s, d_out_rows, layout)
  db1, db2 = bias_grads(d_out_rows, d_h, row_scores, layout, with_b1, with_b2)
  return dw1, dw2, db1, db2


def dx_projection(d_h, w1, layout: GroupedLayout):
  """dX rows = dH @ w1_e^T, (R, d) in dH's dtype; `gather_sum` then reduces them per token."""
  return grouped_matmul_t(d_h, w1, layout).astype(d_h.dtype)
