"""The pretraining example's parameter placement on its (data, ep) mesh: each tensor's mesh axes
from its logical axis names (`shard_spec`), and the model and optimizer state created in place,
sharded. No flags, so that tests can use it without train.py's command line."""

from __future__ import annotations

import math

from flax import nnx
import jax
from jax.sharding import NamedSharding, PartitionSpec as P


def shard_spec(names, shape, mesh, fsdp):
  """A tensor's mesh axes from its logical axis names: a leading "expert" axis over ep (the MoE
  layers' expert weights and their optimizer moments); with fsdp, its first "embed" axis over data,
  and for the tensors without an expert axis over (data, ep), the whole mesh (as MaxText's rules
  map "embed" onto the expert axis too), where that splits evenly (else over data alone where that
  does); the rest replicated. Each use gathers the sharded axes back (the model's `whole`, the MoE
  layer's own placement)."""
  axes = [None] * len(shape)
  names = tuple(names or ())
  lead = 1 if names[:1] == ("layers",) else 0  # --scan_layers stacks the blocks' tensors
  expert = names[lead:lead + 1] == ("expert",)
  if expert:
    axes[lead] = "ep"
  if fsdp and "embed" in names:
    i = names.index("embed")
    for over in ([("data",)] if expert else [("data", "ep"), ("data",)]):
      if shape[i] % math.prod(mesh.shape[a] for a in over) == 0:
        axes[i] = over if len(over) > 1 else over[0]
        break
  return P(*axes)


def shardings(tree, mesh, fsdp=False):
  """Model/optimizer state's (or its abstract shapes') shardings on the mesh by `shard_spec`."""
  specs = nnx.get_partition_spec(tree)
  return jax.tree.map(
      lambda names, leaf: NamedSharding(mesh, shard_spec(names, leaf.shape, mesh, fsdp)),
      specs, tree, is_leaf=lambda v: isinstance(v, P))


def create_sharded(create, mesh, fsdp=False):
  """`create()`'s modules, their state initialised by one compiled program: in place on the mesh,
  where each device computes its own shards, so none ever holds the whole state (a 7B model's
  float32 parameters and AdamW moments outgrow one GPU); with no mesh, on the default device
  (rather than eagerly, one small program per initializer op)."""
  graphdef, abstract = nnx.split(nnx.eval_shape(create))
  init = jax.jit(lambda: nnx.split(create())[1],
                 out_shardings=None if mesh is None else shardings(abstract, mesh, fsdp))
  total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract))
  return nnx.merge(graphdef, init()), total


def bytes_per_device(tree):
  """The largest per-device share of the tree's arrays, in bytes."""
  per = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
  return max(per.values())
