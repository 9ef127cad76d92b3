"""The MoE layer the example trains sonic_jax against: MaxText's GPU path, built on ragged_dot.

`RaggedDotMoE` routes as sonic_jax's default ("softmax_topk": the top-K logits, a softmax over
them), sorts the (token, expert) pairs by expert, gathers their rows of x with XLA, runs both
expert projections as `jax.lax.ragged_dot` (SwiGLU between them, gate and up concatenated as
sonic_jax stores them), weights each row by its score and scatter-adds the rows back to their
tokens; autodiff gives the backward. This is what MaxText does on GPUs when its configs set
`megablox: false`. `ragged_dot="tokamax"` runs both projections as `tokamax.ragged_dot` instead
(tokamax's Mosaic GPU grouped GEMM on Hopper, its XLA path elsewhere; where tokamax is
installed). Its parameters (router (d, E), w1 (E, d, 2n), w2 (E, n, d), with the same
logical axis names and initialisation) and its losses (the Switch balance loss and the z-loss)
are those of `sonic_jax.layers.MoE`, so `--moe_impl` swaps the layer in the same model.

Under a mesh (`sharded=True`, the example's `--expert_parallel=1`), the layer runs as a
`jax.shard_map` over every axis of the mesh set by `jax.set_mesh`: each device routes and computes
its own tokens with whole expert weights (with `--fsdp` they are stored sharded and gathered per
layer, as MaxText's FSDP does); counts are summed and losses averaged over the devices, as
sonic_jax's layer does. It has no expert parallelism.
"""

from __future__ import annotations

from typing import NamedTuple

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sonic_jax import routing as routing_lib


class RaggedDotStats(NamedTuple):
  expert_counts: jax.Array  # (E,) int32: pairs per expert
  dropped_pairs: jax.Array  # () int32: always 0 (dropless)


class RaggedDotAux(NamedTuple):
  loss: jax.Array  # load_balance_coef * balance loss + z_loss_coef * z-loss
  stats: RaggedDotStats


RAGGED_DOTS = ("lax", "tokamax")


def _grouped_matmul(kind: str):
  """(rows, weights, group_sizes) -> float32 rows @ each group's weight."""
  if kind == "lax":
    return lambda a, w, sizes: jax.lax.ragged_dot(a, w, sizes,
                                                  preferred_element_type=jnp.float32)
  if kind != "tokamax":
    raise ValueError(f"ragged_dot must be one of {RAGGED_DOTS}, got {kind!r}")
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ValueError("moe_impl='tokamax_ragged_dot' needs the tokamax package (pip install "
                     "tokamax)") from e
  # Output in the operands' dtype (float32 accumulation inside), as tokamax's GPU kernel gives it.
  return lambda a, w, sizes: tokamax.ragged_dot(a, w, sizes).astype(jnp.float32)


class RaggedDotMoE(nnx.Module):
  """A dropless top-K MoE layer of SwiGLU experts on `jax.lax.ragged_dot` (module doc)."""

  def __init__(self, d_model: int, num_experts: int, expert_dim: int, top_k: int, *,
               init_std: float, load_balance_coef: float, z_loss_coef: float,
               dtype=jnp.float32, sharded: bool = False, ragged_dot: str = "lax",
               rngs: nnx.Rngs):
    normal = nnx.initializers.normal(init_std)
    param = lambda shape, *names: nnx.Param(normal(rngs.params(), shape, jnp.float32),
                                            out_sharding=names, eager_sharding=False)
    self.router = param((d_model, num_experts), "embed", None)
    self.w1 = param((num_experts, d_model, 2 * expert_dim), "expert", "embed", "mlp")
    self.w2 = param((num_experts, expert_dim, d_model), "expert", "mlp", "embed")
    self.top_k = top_k
    self.dtype = jnp.dtype(dtype)
    self.load_balance_coef = load_balance_coef
    self.z_loss_coef = z_loss_coef
    self.sharded = sharded
    _grouped_matmul(ragged_dot)  # refuses an unknown kind or a missing tokamax at construction
    self.ragged_dot = ragged_dot

  def __call__(self, x):
    lead, d = x.shape[:-1], x.shape[-1]
    h = x.reshape(-1, d).astype(self.dtype)
    weights = tuple(w[...].astype(self.dtype) for w in (self.router, self.w1, self.w2))
    if not self.sharded:
      y, loss, counts = self._local(h, *weights, ())
    else:
      mesh = jax.sharding.get_abstract_mesh()
      if mesh.empty:
        raise ValueError("RaggedDotMoE(sharded=True) runs under jax.set_mesh(mesh)")
      axes = tuple(mesh.axis_names)
      tokens, whole = P(axes), P()
      y, loss, counts = jax.shard_map(
          lambda h, *w: self._local(h, *w, axes), mesh=mesh,
          in_specs=(tokens, whole, whole, whole), out_specs=(tokens, whole, whole),
          check_vma=False)(jax.lax.with_sharding_constraint(h, tokens),
                           *(jax.lax.with_sharding_constraint(w, whole) for w in weights))
    stats = RaggedDotStats(expert_counts=counts, dropped_pairs=jnp.zeros((), jnp.int32))
    return y.reshape(*lead, d), RaggedDotAux(loss, stats)

  def _local(self, h, router, w1, w2, axes):
    """(y, loss, expert counts) of tokens h (T, d); over `axes` (inside a shard_map) the counts
    are summed and the losses averaged."""
    d = h.shape[1]
    t_count, k = h.shape[0], self.top_k
    e_count, n = w2.shape[0], w2.shape[1]
    logits = jnp.dot(h, router, preferred_element_type=jnp.float32)
    top, ids = jax.lax.top_k(logits, k)
    scores = jax.nn.softmax(top, axis=-1)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // k
    group_sizes = jnp.bincount(flat, length=e_count).astype(jnp.int32)
    rows = h[token]
    matmul = _grouped_matmul(self.ragged_dot)
    up = matmul(rows, w1, group_sizes)
    a = (jax.nn.silu(up[:, :n]) * up[:, n:]).astype(self.dtype)
    down = matmul(a, w2, group_sizes)
    weighted = down * scores.reshape(-1)[order][:, None]
    y = jnp.zeros((t_count, d), jnp.float32).at[token].add(weighted).astype(self.dtype)
    probs = jax.nn.softmax(logits, axis=-1)
    loss = (self.load_balance_coef * routing_lib.load_balance_loss(probs, group_sizes)
            + self.z_loss_coef * routing_lib.z_loss(logits))
    if axes:
      return y, jax.lax.pmean(loss, axes), jax.lax.psum(group_sizes, axes)
    return y, loss, group_sizes

  def update_selection_bias(self, expert_counts):
    """No selection bias: the baseline routes by plain top-K (kept for the model's interface)."""
    del expert_counts
