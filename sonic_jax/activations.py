"""Expert activations and their hand-written derivatives.

Every backend evaluates activations through these functions, in float32: the forward epilogue
(H -> A), and the backward epilogue that recomputes A from the stored pre-activation H and forms dH
from dA (SonicMoE stores neither A nor Y). The derivatives are written out rather than taken with
`jax.vjp` so that kernels can call the same elementwise code inside an epilogue; the Mosaic GPU
kernels take them through `kernel_fn` / `kernel_grad`, the same functions written with what an
epilogue lowers cheaply (a tanh for the sigmoid, a polynomial for erf, no IEEE division).

GLU activations split H (2n wide) into a gate and an up half: A = act(gate) * up. Where the halves
sit is the gate/up layout: "concat" (gate = H[:, :n], up = H[:, n:], Hugging Face order) or
"interleaved" (gate = H[:, 0::2], up = H[:, 1::2], SonicMoE's order).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

Array = jax.Array

GATE_UP_LAYOUTS = ("concat", "interleaved")

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _silu(g):
  return g * jax.nn.sigmoid(g)


def _silu_grad(g):
  sig = jax.nn.sigmoid(g)
  return sig * (1.0 + g * (1.0 - sig))


def _gelu(g):  # exact (erf) form
  return 0.5 * g * (1.0 + jax.lax.erf(g * _INV_SQRT2))


def _gelu_grad(g):
  cdf = 0.5 * (1.0 + jax.lax.erf(g * _INV_SQRT2))
  pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * g * g)
  return cdf + g * pdf


def _relu(g):
  return jnp.maximum(g, 0.0)


def _relu_grad(g):
  return (g > 0).astype(g.dtype)


def _relu_sq(g):
  r = jnp.maximum(g, 0.0)
  return r * r


def _relu_sq_grad(g):
  return 2.0 * jnp.maximum(g, 0.0)


@dataclasses.dataclass(frozen=True)
class Activation:
  """An expert activation: the elementwise function `fn`, its derivative `grad`, GLU or not."""

  name: str
  fn: Callable[[Array], Array]
  grad: Callable[[Array], Array]
  is_glu: bool

  def width_multiplier(self) -> int:
    """Columns of H (and w1) per column of A: 2 for GLU activations, else 1."""
    return 2 if self.is_glu else 1


ACTIVATIONS: dict[str, Activation] = {
    "swiglu": Activation("swiglu", _silu, _silu_grad, is_glu=True),
    "geglu": Activation("geglu", _gelu, _gelu_grad, is_glu=True),
    "reglu": Activation("reglu", _relu, _relu_grad, is_glu=True),
    "gelu": Activation("gelu", _gelu, _gelu_grad, is_glu=False),
    "relu": Activation("relu", _relu, _relu_grad, is_glu=False),
    "relu_sq": Activation("relu_sq", _relu_sq, _relu_sq_grad, is_glu=False),
    "silu": Activation("silu", _silu, _silu_grad, is_glu=False),
}


def get_activation(name: str) -> Activation:
  if not isinstance(name, str) or name not in ACTIVATIONS:
    raise ValueError(
        f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
  return ACTIVATIONS[name]


def split_gate_up(h: Array, layout: str) -> tuple[Array, Array]:
  """Splits a GLU pre-activation (..., 2n) into (gate, up), each (..., n)."""
  if layout == "concat":
    n = h.shape[-1] // 2
    return h[..., :n], h[..., n:]
  if layout == "interleaved":
    return h[..., 0::2], h[..., 1::2]
  raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {layout!r}")


def merge_gate_up(gate: Array, up: Array, layout: str) -> Array:
  """Inverse of `split_gate_up`."""
  if layout == "concat":
    return jnp.concatenate([gate, up], axis=-1)
  if layout == "interleaved":
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
  raise ValueError(f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {layout!r}")


def convert_gate_up_layout(w: Array, source: str, target: str) -> Array:
  """The GLU weights or bias `w` (..., 2n), gate and up columns in the `source` layout, rearranged
  into the `target` layout: for permuting a checkpoint's w1 and b1 once, at load time (the
  interleaved layout is the faster one for the mosaic_gpu up-projection)."""
  for name, layout in (("source", source), ("target", target)):
    if layout not in GATE_UP_LAYOUTS:
      raise ValueError(f"{name} must be one of {GATE_UP_LAYOUTS}, got {layout!r}")
  if w.ndim < 1 or w.shape[-1] % 2:
    raise ValueError(f"w must have an even last dimension (gate and up columns), got shape "
                     f"{w.shape}")
  return merge_gate_up(*split_gate_up(w, source), target)


def compute_dtype(dtype):
  """Epilogue arithmetic dtype: float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def apply_activation(h: Array, act: Activation, layout: str) -> Array:
  """A = act(H) in float32 (H: (..., 2n) for GLU, (..., n) otherwise)."""
  h = h.astype(compute_dtype(h.dtype))
  if act.is_glu:
    gate, up = split_gate_up(h, layout)
    return act.fn(gate) * up
  return act.fn(h)


def activation_backward(h: Array, d_a: Array, act: Activation, layout: str) -> tuple[Array, Array]:
  """Recomputes A from H and returns (A, dH) for the cotangent dA, all float32."""
  h = h.astype(compute_dtype(h.dtype))
  d_a = d_a.astype(h.dtype)
  if act.is_glu:
    gate, up = split_gate_up(h, layout)
    act_gate = act.fn(gate)
    d_gate = d_a * up * act.grad(gate)
    d_up = d_a * act_gate
    return act_gate * up, merge_gate_up(d_gate, d_up, layout)
  return act.fn(h), d_a * act.grad(h)


def _sigmoid_kernel(g):
  # sigmoid(g) = (1 + tanh(g / 2)) / 2: one tanh (tanh.approx.f32 in a Mosaic GPU epilogue, whose
  # kernels use approximate math) and an FMA, where 1 / (1 + exp(-g)), the lowering of
  # jax.nn.sigmoid, adds an exp and an IEEE division (a dozen instructions) per element.
  return 0.5 + 0.5 * jnp.tanh(0.5 * g)


def _silu_kernel(g):
  return g * _sigmoid_kernel(g)


def _silu_grad_kernel(g):
  sig = _sigmoid_kernel(g)
  return sig * (1.0 + g * (1.0 - sig))


def _reciprocal_kernel(x):
  # 1 / x for x > 0 as rsqrt(x)^2: rsqrt.approx.f32 and a multiply instead of an IEEE division.
  r = jax.lax.rsqrt(x)
  return r * r


def _erf_kernel(x):
  # Abramowitz & Stegun 7.1.26, |error| < 1.5e-7: Mosaic GPU kernels have no erf instruction.
  ax = jnp.abs(x)
  t = _reciprocal_kernel(1.0 + 0.3275911 * ax)
  poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                          + t * 1.061405429))))
  y = 1.0 - poly * jnp.exp(-ax * ax)
  return jnp.where(x < 0, -y, y)


def _gelu_kernel(g):
  return 0.5 * g * (1.0 + _erf_kernel(g * _INV_SQRT2))


def kernel_fn(act: Activation) -> Callable[[Array], Array]:
  """`act.fn` written with the operations a Mosaic GPU epilogue lowers cheaply (float32): no erf
  instruction, and no IEEE division (tanh and rsqrt, approximate in the kernels)."""
  return {_gelu: _gelu_kernel, _silu: _silu_kernel}.get(act.fn, act.fn)


def _gelu_grad_kernel(g):
  cdf = 0.5 * (1.0 + _erf_kernel(g * _INV_SQRT2))
  return cdf + g * (_INV_SQRT_2PI * jnp.exp(-0.5 * g * g))


def kernel_grad(act: Activation) -> Callable[[Array], Array]:
  """`act.grad` written with the operations a Mosaic GPU epilogue lowers cheaply (float32)."""
  return {_gelu_grad: _gelu_grad_kernel, _silu_grad: _silu_grad_kernel}.get(act.grad, act.grad)
