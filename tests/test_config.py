"""`sonic_jax.Config`: validation, hashability (a static value under jit), and that the op, the
Flax layer and the parallel ops take it per call."""

from __future__ import annotations

import dataclasses

from flax import nnx
import jax
import numpy as np
import jax.numpy as jnp
import pytest

import sonic_jax
from sonic_jax.layers import MoE


def _args(T=32, d=64, n=32, E=4):
  k = jax.random.split(jax.random.key(0), 4)
  return (jax.random.normal(k[0], (T, d)), jax.random.normal(k[1], (d, E)) * 0.1,
          jax.random.normal(k[2], (E, d, 2 * n)) * 0.1, jax.random.normal(k[3], (E, n, d)) * 0.1)


@pytest.mark.parametrize("field,value,error", [
    ("router_kernel_max_experts", -1, ValueError), ("layout_kernel_max_experts", 1.5, TypeError),
    ("gather_sum_kernel_min_d", True, TypeError), ("gather_sum_kernel", 1, TypeError),
    ("tuning", {"entries": []}, TypeError)])
def test_bad_fields_are_named(field, value, error):
  with pytest.raises(error, match=field):
    sonic_jax.Config(**{field: value})


def test_numpy_integers_and_bools_are_taken_as_python_ones():
  config = sonic_jax.Config(layout_kernel_max_experts=np.int64(64), gather_sum_kernel=np.True_)
  assert config == sonic_jax.Config(layout_kernel_max_experts=64, gather_sum_kernel=True)
  assert type(config.layout_kernel_max_experts) is int and hash(config) == hash(
      sonic_jax.Config(layout_kernel_max_experts=64, gather_sum_kernel=True))
  router = sonic_jax.Router("softmax", n_group=np.int32(2), topk_group=np.int64(1),
                            renormalize=np.False_)
  assert router == sonic_jax.Router("softmax", n_group=2, topk_group=1, renormalize=False)


def test_config_is_frozen_and_hashable():
  a, b = sonic_jax.Config(), sonic_jax.Config()
  assert a == b and hash(a) == hash(b)
  assert sonic_jax.Config(gather_sum_kernel=False) != a
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.gather_sum_kernel = False


def test_the_op_takes_a_config_per_call_and_refuses_anything_else():
  args = _args()
  run = jax.jit(lambda *a, config=None: sonic_jax.moe(*a, top_k=2, config=config)[0],
                static_argnames="config")
  assert jnp.allclose(run(*args, config=sonic_jax.Config(layout_kernel_max_experts=0)), run(*args))
  with pytest.raises(TypeError, match="config must be a sonic_jax.Config"):
    sonic_jax.moe(*args, top_k=2, config={"gather_sum_kernel": False})


def test_a_config_is_static_under_jit():
  """Equal configs share one trace; a different config is another trace."""
  traces = []

  def f(x, rw, w1, w2, config):
    traces.append(config)
    return sonic_jax.moe(x, rw, w1, w2, top_k=2, config=config)[0]

  g = jax.jit(f, static_argnames="config")
  args = _args()
  g(*args, config=sonic_jax.Config())
  g(*args, config=sonic_jax.Config())
  g(*args, config=sonic_jax.Config(router_kernel_max_experts=0))
  assert len(traces) == 2


def test_the_layer_keeps_its_config():
  config = sonic_jax.Config(gather_sum_kernel=False)
  layer = MoE(64, 4, 32, 2, config=config, rngs=nnx.Rngs(0))
  assert layer.config is config
  y, _ = layer(_args()[0])
  assert y.shape == (32, 64)
  with pytest.raises(TypeError, match="config"):
    MoE(64, 4, 32, 2, config="fast", rngs=nnx.Rngs(0))
