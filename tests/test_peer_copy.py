"""The NVLink peer copies (`sonic_jax.mosaic_gpu.peer_copy`): Mosaic GPU's interpreter has no
semaphores or remote references, so on a CPU they are checked by lowering for an abstract mesh of
H100s (the Mosaic GPU kernel built, layouts inferred, SMEM fitted), and their arguments; on two or
more GPUs (`pytest -m gpu`, and `benchmarks.nvlink_bench`) the all-gather's output is compared
with NCCL's and the row gather's with a NumPy gather."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from cases import h100_abstract_mesh
from sonic_jax.mosaic_gpu import peer_copy


def _gpu_mesh():
  """An "ep" mesh over every GPU of the host; skips the test with fewer than two."""
  devices = jax.devices()
  if len(devices) < 2 or devices[0].platform != "gpu":
    pytest.skip("needs two or more GPUs")
  return jax.make_mesh((len(devices),), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,))


def _sharded(fn, mesh):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"),
                               check_vma=False))


@pytest.mark.parametrize("devices", [2, 4])
def test_peer_all_gather_lowers_for_h100s(devices):
  mesh = h100_abstract_mesh(axes={"ep": devices})
  fn = _sharded(functools.partial(peer_copy.all_gather, axis="ep"), mesh)
  x = jax.ShapeDtypeStruct((devices * 4096, 4096), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("ep")))
  with jax.sharding.use_abstract_mesh(mesh):
    text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("shape, kwargs, match", [
    ((1000, 256), {}, "rows=1000 must be a multiple of num_blocks"),
    ((4096, 200), {}, "d=200 must be a multiple of tile_n"),
    ((1024, 256), {"num_blocks": 16, "tile_m": 128}, "num_blocks \\* tile_m = 16 \\* 128"),
    ((4096, 256), {"max_concurrent_steps": 1}, "max_concurrent_steps must be >= 2"),
    ((4096, 256), {"num_blocks": 0}, "num_blocks must be >= 1"),
    ((1024,), {}, "x must be"),
])
def test_peer_all_gather_refuses_bad_arguments(shape, kwargs, match):
  mesh = h100_abstract_mesh(axes={"ep": 2})
  fn = _sharded(functools.partial(peer_copy.all_gather, axis="ep", **kwargs), mesh)
  x = jax.ShapeDtypeStruct((2 * shape[0],) + shape[1:], jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("ep", *([None] * (len(shape) - 1)))))
  with jax.sharding.use_abstract_mesh(mesh), pytest.raises(ValueError, match=match):
    fn.trace(x)


@pytest.mark.gpu
@pytest.mark.parametrize("num_blocks", [16, 64])
def test_peer_all_gather_equals_nccl(num_blocks):
  mesh = _gpu_mesh()
  x = jax.device_put(jax.random.normal(jax.random.key(0), (mesh.size * 4096, 1024),
                                       jnp.bfloat16), NamedSharding(mesh, P("ep")))
  got = _sharded(functools.partial(peer_copy.all_gather, axis="ep", num_blocks=num_blocks),
                 mesh)(x)
  want = _sharded(lambda v: jax.lax.all_gather(v, "ep", tiled=True), mesh)(x)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def _gather_rows_fn(mesh, **kwargs):
  return jax.jit(jax.shard_map(functools.partial(peer_copy.gather_rows, axis="ep", **kwargs),
                               mesh=mesh, in_specs=(P("ep"), P()), out_specs=P("ep"),
                               check_vma=False))


@pytest.mark.parametrize("devices, stages", [(2, 2), (4, 2), (4, 4)])
def test_peer_gather_rows_lowers_for_h100s(devices, stages):
  mesh = h100_abstract_mesh(axes={"ep": devices})
  x = jax.ShapeDtypeStruct((devices * 1024, 4096), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P("ep")))
  rows = jax.ShapeDtypeStruct((devices, 512), jnp.int32, sharding=NamedSharding(mesh, P()))
  fn = _gather_rows_fn(mesh, stages=stages)
  with jax.sharding.use_abstract_mesh(mesh):
    text = fn.trace(x, rows).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("rows_shape, kwargs, match", [
    ((3, 512), {}, "rows must be \\(2, R\\) int32"),
    ((2, 500), {}, "R=500 must be a multiple of tile_m=64"),
    ((2, 512), {"tile_n": 32}, "tile_n=32 must be a multiple of 64"),
    ((2, 512), {"stages": 1}, "stages must be >= 2"),
    ((2, 512), {"num_blocks": 48}, "the P \\* \\(R / tile_m\\) \\* \\(d / tile_n\\) = 256 tiles"),
])
def test_peer_gather_rows_refuses_bad_arguments(rows_shape, kwargs, match):
  mesh = h100_abstract_mesh(axes={"ep": 2})
  x = jax.ShapeDtypeStruct((2 * 1024, 4096), jnp.bfloat16, sharding=NamedSharding(mesh, P("ep")))
  rows = jax.ShapeDtypeStruct(rows_shape, jnp.int32, sharding=NamedSharding(mesh, P()))
  with jax.sharding.use_abstract_mesh(mesh), pytest.raises(ValueError, match=match):
    _gather_rows_fn(mesh, **kwargs).trace(x, rows)


@pytest.mark.gpu
@pytest.mark.parametrize("stages", [2, 4])
def test_peer_gather_rows_equals_the_gathered_rows(stages):
  mesh = _gpu_mesh()
  p = mesh.size
  x = jax.random.normal(jax.random.key(0), (p * 2048, 1024), jnp.bfloat16)
  rows = jax.random.randint(jax.random.key(1), (p, 512), 0, 2048, jnp.int32)
  # 8 CTAs: each takes several tiles, so the stages are reused.
  got = _gather_rows_fn(mesh, num_blocks=8, stages=stages)(
      jax.device_put(x, NamedSharding(mesh, P("ep"))),
      jax.device_put(rows, NamedSharding(mesh, P())))
  want = np.stack([np.asarray(x)[i * 2048 + np.asarray(rows[i])] for i in range(p)])
  # Every device gathers the same rows: the output holds P copies of (P, R, d).
  got = np.asarray(got).reshape(p, p, 512, 1024)
  for i in range(p):
    np.testing.assert_array_equal(got[i].view(np.uint16), want.view(np.uint16))
