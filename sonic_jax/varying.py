"""shard_map's varying-axes types, for the custom VJPs' cotangents.

Under `jax.shard_map` with its type check (check_vma, the default) every value records the manual
axes it varies over, and a custom VJP's cotangent must have its primal's type. A weight replicated
over a data axis but multiplied by tokens split over it gets a cotangent that varies over that
axis: the weight's gradient is the sum over the axis (every device used the same weight), which
JAX's own transposes would insert and a custom backward must add itself. Without the check the
types are empty and nothing changes.
"""

from __future__ import annotations

import jax

Array = jax.Array


def varying_axes(a) -> frozenset:
  """The manual axes over which shard_map types `a` as varying (empty without its check)."""
  return frozenset(jax.typeof(a).manual_axis_type.varying)


def like_primal(ct: Array | None, primal) -> Array | None:
  """The cotangent `ct` typed as `primal` (an array of the primal's type, or the primal itself):
  summed over the axes it varies over and the primal does not, cast to varying over those where
  the primal varies and it does not."""
  if ct is None:
    return None
  want, have = varying_axes(primal), varying_axes(ct)
  if have - want:
    ct = jax.lax.psum(ct, tuple(sorted(have - want)))
  if want - have:
    ct = jax.lax.pcast(ct, tuple(sorted(want - have)), to="varying")
  return ct
