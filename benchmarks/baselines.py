"""The layers sonic_jax is measured against, on the same inputs.

- `tokamax_moe`: the best MoE layer a JAX user can assemble from public parts: router, argsort,
  XLA gather of x, tokamax's Mosaic GPU `ragged_dot` (up), SwiGLU, `ragged_dot` (down), scaling by
  the scores, scatter-add back to tokens; autodiff for the backward.
- `uniform_upper_bound`: the same FLOPs as batched GEMMs with exactly T*K/E tokens per expert, no
  router, no gather, no aggregation: what a grouped GEMM with perfect routing could reach.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tokamax_available() -> bool:
  try:
    import tokamax  # noqa: F401
  except Exception:  # ImportError, or a missing transitive dependency
    return False
  return True


def tokamax_version():
  """tokamax's version where it imports, else None."""
  if not tokamax_available():
    return None
  import importlib.metadata
  try:
    return importlib.metadata.version("tokamax")
  except importlib.metadata.PackageNotFoundError:
    return "(version unknown)"


def tokamax_moe(x, router_weight, w1, w2, *, top_k):
  """SwiGLU (concat layout) MoE layer from tokamax.ragged_dot (its Mosaic GPU implementation).
  Returns y (T, d)."""
  import tokamax
  t_count, _ = x.shape
  e_count = router_weight.shape[1]
  n = w2.shape[1]
  logits = jnp.dot(x, router_weight, preferred_element_type=jnp.float32)
  top, ids = jax.lax.top_k(logits, top_k)
  scores = jax.nn.softmax(top, axis=-1)
  flat = ids.reshape(-1)
  order = jnp.argsort(flat)
  token = order // top_k
  group_sizes = jnp.bincount(flat, length=e_count).astype(jnp.int32)
  xs = x[token]
  h = tokamax.ragged_dot(xs, w1, group_sizes, implementation="mosaic")
  a = (jax.nn.silu(h[:, :n].astype(jnp.float32)) * h[:, n:].astype(jnp.float32)).astype(x.dtype)
  y = tokamax.ragged_dot(a, w2, group_sizes, implementation="mosaic")
  y = y * scores.reshape(-1)[order][:, None].astype(y.dtype)
  return jnp.zeros((t_count, x.shape[1]), x.dtype).at[token].add(y)


def uniform_upper_bound(x_per_expert, w1, w2):
  """Batched-GEMM SwiGLU experts: x_per_expert (E, T*K/E, d) -> (E, T*K/E, d)."""
  # bf16 GEMM outputs (float32 accumulation inside), so the backward's GEMMs are bf16 too.
  n = w2.shape[1]
  h = jnp.einsum("ecd,edf->ecf", x_per_expert, w1).astype(jnp.float32)
  a = (jax.nn.silu(h[..., :n]) * h[..., n:]).astype(x_per_expert.dtype)
  return jnp.einsum("ecn,end->ecd", a, w2)
