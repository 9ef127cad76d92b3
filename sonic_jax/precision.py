"""Mixed-precision dense products: a @ b with a float32 result whose backward stays 16-bit.

`jnp.dot(a, b, preferred_element_type=float32)` of bfloat16 operands is what a mixed-precision
layer wants forward (16-bit operands, float32 accumulation and result), but its autodiff transpose
multiplies the float32 cotangent with float32 copies of the operands: the backward's GEMMs run on
float32 inputs, at up to twice the time (docs/decisions.md). `dot_f32` casts the cotangent to the
operands' dtype instead, as a 16-bit GEMM's backward does in mixed-precision training (float32
accumulation throughout).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sonic_jax.varying import like_primal

Array = jax.Array

_16BIT = (jnp.bfloat16, jnp.float16)


def dot_f32(a: Array, b: Array) -> Array:
  """(..., k) @ (k, n) with float32 (float64 for float64 inputs) accumulation and result. When a
  and b share a 16-bit dtype the backward's two GEMMs take the cotangent in that dtype too."""
  if a.ndim < 1 or b.ndim != 2 or a.shape[-1] != b.shape[0]:
    raise ValueError(f"dot_f32 takes a (..., k) and b (k, n), got shapes {a.shape} and {b.shape}")
  if a.dtype == b.dtype and a.dtype in _16BIT:
    lead = a.shape[:-1]
    return _dot_16bit(a.reshape(-1, a.shape[-1]), b).reshape(*lead, b.shape[1])
  acc = jnp.promote_types(jnp.promote_types(a.dtype, b.dtype), jnp.float32)
  return jnp.dot(a, b, preferred_element_type=acc)


@jax.custom_vjp
def _dot_16bit(a: Array, b: Array) -> Array:
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _dot_16bit_fwd(a, b):
  return _dot_16bit(a, b), (a, b)


def _dot_16bit_bwd(residuals, g):
  return dot_16bit_grads(*residuals, g)


def dot_16bit_grads(a: Array, b: Array, g: Array) -> tuple[Array, Array]:
  """(d_a, d_b) of a @ b (16-bit a, b; float32 result) for the result's cotangent g: both GEMMs
  on g cast to a's dtype, with float32 accumulation; each in its operand's shard_map type."""
  g = g.astype(a.dtype)
  d_a = jax.lax.dot_general(g, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  d_b = jax.lax.dot_general(a, g, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  # In the operands' shard_map types: a router weight replicated over a data axis gets its
  # gradient summed over it (`varying.like_primal`).
  return like_primal(d_a.astype(a.dtype), a), like_primal(d_b.astype(b.dtype), b)


_dot_16bit.defvjp(_dot_16bit_fwd, _dot_16bit_bwd)
