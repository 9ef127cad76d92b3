"""Operands split over Explicit mesh axes: replicated for a call (`whole`) or refused by name
(`unsplit`, from `split_axes`), and indexing a shared operand by a batched routing under
`jax.vmap` of a batch split over an Explicit mesh axis (`take_shared`, `split_batch_refusal`).

Vmapping the op over a batch whose leading axis an Explicit mesh axis splits batches its routing
(expert ids, tiles' experts) but not the weights, biases and per-expert vectors it indexes. JAX
0.11.2's gather batching rule cannot place such a gather's output (it asks for `out_sharding`);
`take_shared`'s own batching rule gives it the indices' sharding. Pallas kernels fail on such a
batch too (their batching and lowering, inside JAX): `split_batch_refusal` names the option that
runs them instead.

Both take their custom path only where the values' type has an Explicit mesh axis: custom_vmap
has no transpose and custom_vjp no forward mode, so elsewhere (no mesh, Auto axes, inside a
shard_map) they are the plain gather and the identity, which every transformation takes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sonic_jax.varying import like_primal

Array = jax.Array


def _explicit_mesh(a) -> bool:
  mesh = getattr(jax.typeof(a).sharding, "mesh", None)
  return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def split_axes(a) -> tuple[str, ...]:
  """The mesh axes that split a's leading dim in its type (Explicit axes; those of size 1 too:
  JAX's gather batching fails on them as well); () for None or a replicated a."""
  spec = () if a is None else tuple(getattr(jax.typeof(a).sharding, "spec", ()))
  if not spec or spec[0] is None:
    return ()
  return spec[0] if isinstance(spec[0], tuple) else (spec[0],)


_SPLIT_REFUSALS = {
    "experts": ("{fn} runs every expert on each device; split experts need expert parallelism "
                "(moe_all_gather or moe_all_to_all inside a shard_map, or the layer's "
                "expert_parallel_axis), or replicate the weights"),
    "tokens": ("{fn} takes all of its tokens together (one routing, one grouping of their pairs "
               "by expert). For data parallelism (each shard routed on its own) call it inside a "
               "jax.shard_map over those axes (sonic_jax.layers.MoE under jax.set_mesh does so), "
               "or replicate them"),
}


def unsplit(fn: str, what: str, **arrays) -> tuple:
  """The arrays, each `whole`, in order; refused by name where an Explicit mesh axis of size > 1
  (in their type) splits their dim 0, their experts or tokens (`what`): the function `fn` runs
  every expert on each device (JAX would fail inside the experts' loop) and sorts its tokens'
  pairs all together (JAX would refuse the sort). A size-1 axis splits nothing: replicated. Auto
  axes and those a surrounding shard_map made manual are not in types."""
  for name, a in arrays.items():
    axes = split_axes(a)
    if axes := tuple(ax for ax in axes if jax.typeof(a).sharding.mesh.shape[ax] > 1):
      raise ValueError(f"{name} is split over its {what} on the mesh axes {axes}: "
                       + _SPLIT_REFUSALS[what].format(fn=fn))
  return tuple(whole(a) for a in arrays.values())


def whole(a):
  """a replicated where its type splits it over Explicit mesh axes, else a as it is (NumPy arrays
  too): x over d, the expert weights over a size-1 expert axis (as `unsplit` allows) or FSDP's
  other dims, the router and the per-expert vectors over d or E. Every device runs all of each
  expert, and the experts' custom_vjp returns whole gradients (the reshard's transpose splits
  them again)."""
  sharding = None if a is None else jax.typeof(a).sharding
  if sharding is None or all(p is None for p in getattr(sharding, "spec", ())):
    return a
  return jax.sharding.reshard(a, jax.sharding.NamedSharding(sharding.mesh,
                                                            jax.sharding.PartitionSpec()))


@jax.custom_batching.custom_vmap
def _take(a: Array, index: Array) -> Array:
  return a[index]


@_take.def_vmap
def _take_batched(axis_size, in_batched, a, index):
  del axis_size
  a_batched, index_batched = in_batched
  if a_batched:
    return jax.vmap(lambda a, i: a[i], in_axes=(0, 0 if index_batched else None))(a, index), True
  if not split_axes(index):  # an outer vmap's batch may be split: its rule places that one
    return _take(a, index), True
  spec = tuple(jax.typeof(index).sharding.spec)
  spec += (None,) * (index.ndim - len(spec) + a.ndim - 1)
  out = jax.sharding.NamedSharding(jax.typeof(index).sharding.mesh,
                                   jax.sharding.PartitionSpec(*spec))
  return a.at[index].get(out_sharding=out), True


# custom_vmap has no reverse mode of its own: the gradient is the gather's, a scatter-add. The
# forward rule calls the custom_vjp itself, so that a second-order gradient differentiates it.
@jax.custom_vjp
def _take_differentiable(a: Array, index: Array) -> Array:
  return _take(a, index)


def _take_fwd(a, index):
  return _take_differentiable(a, index), (a, index)  # a for its shape: the caller holds it


def _take_bwd(residuals, g):
  a, index = residuals
  # Under shard_map a replicated a's cotangent sums over the axes the routing varies over.
  return like_primal(jnp.zeros_like(a).at[index].add(g.astype(a.dtype)), a), None


_take_differentiable.defvjp(_take_fwd, _take_bwd)


def take_shared(a: Array, index: Array) -> Array:
  """a[index] along a's first axis (a: a weight, bias or per-expert vector; index: a routing's)."""
  if not _explicit_mesh(index):
    return a[index]
  return _take_differentiable(a, index)


@functools.cache
def split_batch_refusal(what: str):
  """A function x -> x that refuses, by name, `jax.vmap` of a batch split over Explicit mesh axes:
  `what` (e.g. "backend='mosaic_gpu'") runs Pallas kernels whose batching fails deep inside JAX
  0.11.2 on such a batch (sharded operands indexed by integers, or closed over by the lowering)."""

  @jax.custom_batching.custom_vmap
  def unsplit(x):
    return x

  @unsplit.def_vmap
  def _unsplit_batched(axis_size, in_batched, x):
    del axis_size
    (batched,) = in_batched
    if batched and (axes := split_axes(x)):
      raise ValueError(
          f"{what} cannot run under jax.vmap of a batch split over the mesh axes {axes}: its "
          "Pallas kernels' batching fails on sharded operands (JAX 0.11.2). Map that batch with "
          "jax.shard_map (each device vmapping its own part), or call sonic_jax.layers.MoE under "
          "jax.set_mesh")
    return (unsplit(x) if batched else x), batched  # an outer vmap's batch may be split

  refuse = jax.custom_vjp(unsplit)
  refuse.defvjp(lambda x: (refuse(x), None), lambda _, g: (g,))
  return lambda x: refuse(x) if _explicit_mesh(x) else x
