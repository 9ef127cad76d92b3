"""Random MoE problems at unit scale, for tests and the oracle; what tests read off a jaxpr."""

from __future__ import annotations

import numpy as np

GLU = {"swiglu", "geglu", "reglu", "geglu_tanh", "clamped_swiglu"}


def make_problem(rng, T=48, d=32, n=16, E=8, K=2, activation="swiglu", bias=False, skew=False):
  """Inputs as float64 NumPy arrays, scaled so x, H, A, Y and y are all of order one.

  With skew=True most of the routing goes to expert 0 and experts 5, 6, 7 receive no token.
  """
  width = 2 * n if activation in GLU else n
  x = rng.standard_normal((T, d))
  router_weight = rng.standard_normal((d, E)) / np.sqrt(d) * 2.0
  if skew:
    u = rng.standard_normal(d)
    u /= np.linalg.norm(u)
    x = x - np.outer(x @ u, u) + 3.0 * u  # every token leans the same way
    push = np.zeros(E)
    push[0] = 4.0
    push[5:] = -10.0
    router_weight = router_weight + np.outer(u, push)
  p = {
      "x": x,
      "router_weight": router_weight,
      "w1": rng.standard_normal((E, d, width)) / np.sqrt(d),
      "w2": rng.standard_normal((E, n, d)) / np.sqrt(n),
      "b1": rng.standard_normal((E, width)) * 0.5 if bias else None,
      "b2": rng.standard_normal((E, d)) * 0.5 if bias else None,
  }
  d_y = rng.standard_normal((T, d))
  return p, d_y


def gemm_operand_dtypes(jaxpr):
  """The operand dtypes of every GEMM (a dot_general without batch dimensions; the gather-sums'
  per-token weighted sums over K are batched ones) in a jaxpr and its sub-jaxprs (custom_vjp,
  pjit, ...)."""
  from jax.extend.core import jaxprs_in_params
  out = set()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general" and not eqn.params["dimension_numbers"][1][0]:
      out |= {v.aval.dtype for v in eqn.invars}
    for sub in jaxprs_in_params(eqn.params):
      out |= gemm_operand_dtypes(sub)
  return out


def h100_abstract_mesh(num_cores: int = 132, axes: dict[str, int] | None = None):
  """A mesh of no devices whose abstract device is an H100 (with `axes`, {name: size}, of
  explicit axes): under it, jax lowers (and Mosaic GPU interprets) for sm90 on a machine without
  a GPU."""
  import jax
  from jax._src.mesh import AbstractDevice
  axes = axes or {}
  return jax.sharding.AbstractMesh(
      tuple(axes.values()), tuple(axes), abstract_device=AbstractDevice(
          device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=num_cores),
      axis_types=(jax.sharding.AxisType.Explicit,) * len(axes))


def export_for_h100(fn, *args) -> str:
  """The MLIR module of `jax.export` of jit(fn) for 'cuda' on an H100, lowered on this machine
  (Pallas Triton calls allowed). Each Pallas Triton module is verified as it is built: Pallas
  leaves that to the GPU compiler, and an ill-typed op (e.g. an integer op given a bool operand)
  would otherwise pass here and fail only on a GPU."""
  import jax
  from unittest import mock
  from jax._src.pallas.triton import lowering
  lower = lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*a, **k):
    result = lower(*a, **k)
    result.module.operation.verify()  # raises MLIRError naming the op
    return result

  with jax.sharding.use_abstract_mesh(h100_abstract_mesh()), mock.patch.object(
      lowering, "lower_jaxpr_to_triton_module", lower_and_verify):
    return jax.export.export(
        jax.jit(fn), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
            *args).mlir_module()
