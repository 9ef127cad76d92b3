"""Expert activations and their hand-written derivatives.

Every backend evaluates activations through these functions, in float32 (float64 for float64): the
forward epilogue (H -> A), and the backward epilogue that recomputes A from the stored
pre-activation H and forms dH from dA (SonicMoE stores neither A nor Y). The derivatives are written
out rather than taken with `jax.vjp` so that kernels can call the same elementwise code inside an
epilogue; the Mosaic GPU kernels call them with `kernel=True`, the same functions written with what
an epilogue lowers cheaply (a tanh for the sigmoid, a polynomial for erf, no IEEE division).

GLU activations split H (2n wide) into a gate and an up half: A = act(gate) * up (gpt-oss's clamped
form: `clamped_swiglu`). Where the halves
sit is the gate/up layout: "concat" (gate = H[:, :n], up = H[:, n:], Hugging Face order) or
"interleaved" (gate = H[:, 0::2], up = H[:, 1::2], SonicMoE's order).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array

GATE_UP_LAYOUTS = ("concat", "interleaved")

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _sigmoid_kernel(g):
  # sigmoid(g) = (1 + tanh(g / 2)) / 2: one tanh (tanh.approx.f32 in a Mosaic GPU epilogue, whose
  # kernels use approximate math) and an FMA, where 1 / (1 + exp(-g)), the lowering of
  # jax.nn.sigmoid, adds an exp and an IEEE division (a dozen instructions) per element.
  return 0.5 + 0.5 * jnp.tanh(0.5 * g)


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


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


def _silu(g, alpha, kernel):  # g * sigmoid(alpha * g)
  sig = _sigmoid_kernel(alpha * g) if kernel else jax.nn.sigmoid(alpha * g)
  return g * sig


def _silu_grad(g, alpha, kernel):
  sig = _sigmoid_kernel(alpha * g) if kernel else jax.nn.sigmoid(alpha * g)
  return sig * (1.0 + alpha * g * (1.0 - sig))


def _gelu(g, alpha, kernel):  # exact (erf) form
  del alpha
  erf = _erf_kernel if kernel else jax.lax.erf
  return 0.5 * g * (1.0 + erf(g * _INV_SQRT2))


def _gelu_grad(g, alpha, kernel):
  del alpha
  erf = _erf_kernel if kernel else jax.lax.erf
  cdf = 0.5 * (1.0 + erf(g * _INV_SQRT2))
  return cdf + g * (_INV_SQRT_2PI * jnp.exp(-0.5 * g * g))


def _gelu_tanh(g, alpha, kernel):  # tanh approximation (jax.nn.gelu(approximate=True))
  del alpha, kernel  # tanh lowers to one instruction in the kernels
  return 0.5 * g * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (g + _GELU_TANH_C * g * g * g)))


def _gelu_tanh_grad(g, alpha, kernel):
  del alpha, kernel
  t = jnp.tanh(_SQRT_2_OVER_PI * (g + _GELU_TANH_C * g * g * g))
  return 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (
      1.0 + 3.0 * _GELU_TANH_C * g * g)


def _relu(g, alpha, kernel):
  del alpha, kernel
  return jnp.maximum(g, 0.0)


def _relu_grad(g, alpha, kernel):
  del alpha, kernel
  return (g > 0).astype(g.dtype)


def _relu_sq(g, alpha, kernel):
  del alpha, kernel
  r = jnp.maximum(g, 0.0)
  return r * r


def _relu_sq_grad(g, alpha, kernel):
  del alpha, kernel
  return 2.0 * jnp.maximum(g, 0.0)


_FUNCTIONS = {
    "silu": (_silu, _silu_grad),
    "gelu": (_gelu, _gelu_grad),
    "gelu_tanh": (_gelu_tanh, _gelu_tanh_grad),
    "relu": (_relu, _relu_grad),
    "relu_sq": (_relu_sq, _relu_sq_grad),
}


@dataclasses.dataclass(frozen=True)
class Activation:
  """An expert activation: frozen and hashable (a static value under `jax.jit`).

  name: its label in messages and part of its identity (equal activations share a jit trace); the
    presets' is their key in `ACTIVATIONS`, `clamped_swiglu`'s names its parameters.
  function: the elementwise function, one of "silu" (g * sigmoid(alpha * g)), "gelu" (exact erf
    form), "gelu_tanh" (tanh approximation), "relu", "relu_sq".
  is_glu: A = function(gate) * (up + up_offset) on the two halves of H, else A = function(H).
  alpha: the sigmoid's slope in "silu" (1: SiLU; gpt-oss uses 1.702).
  limit: GLU only, None or > 0: the gate is clamped to at most `limit` and the up half to
    [-limit, limit] before they combine (gpt-oss); gradients pass where the clamp is inactive
    (bounds included, as torch.clamp's).
  up_offset: GLU only: added to the (clamped) up half (gpt-oss: 1).
  """

  name: str
  function: str
  is_glu: bool
  alpha: float = 1.0
  limit: float | None = None
  up_offset: float = 0.0

  def __post_init__(self):
    # Python values only: a jax scalar would make the activation unhashable as a static
    # argument, and an int limit would name a different activation than the same float's.
    if not isinstance(self.name, str):
      raise TypeError(f"Activation.name must be a str, got {type(self.name).__name__}")
    if not isinstance(self.is_glu, (bool, np.bool_)):
      raise TypeError(f"Activation.is_glu must be a bool, got {self.is_glu!r}")
    object.__setattr__(self, "is_glu", bool(self.is_glu))
    for field in ("alpha", "limit", "up_offset"):
      value = getattr(self, field)
      if value is None and field == "limit":
        continue
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"Activation.{field} must be a real number, got {value!r}")
      if not math.isfinite(value):
        raise ValueError(f"Activation.{field} must be finite, got {value}")
      object.__setattr__(self, field, float(value))
    if self.function not in _FUNCTIONS:
      raise ValueError(f"Activation.function must be one of {sorted(_FUNCTIONS)}, got "
                       f"{self.function!r}")
    if self.alpha != 1.0 and self.function != "silu":
      raise ValueError(f"Activation.alpha applies to the 'silu' function only, got alpha="
                       f"{self.alpha} for {self.function!r}")
    if not self.is_glu and (self.limit is not None or self.up_offset):
      raise ValueError("Activation.limit and up_offset apply to GLU activations only")
    if self.limit is not None and not self.limit > 0:
      raise ValueError(f"Activation.limit must be None or > 0, got {self.limit}")

  def width_multiplier(self) -> int:
    """Columns of H (and w1) per column of A: 2 for GLU activations, else 1."""
    return 2 if self.is_glu else 1

  def fn(self, g: Array, kernel: bool = False) -> Array:
    """The elementwise function. kernel=True: written with what a Mosaic GPU epilogue lowers
    cheaply (float32; no erf instruction, no IEEE division: tanh and rsqrt, approximate there)."""
    return _FUNCTIONS[self.function][0](g, self.alpha, kernel)

  def grad(self, g: Array, kernel: bool = False) -> Array:
    """The function's derivative (kernel: as in `fn`)."""
    return _FUNCTIONS[self.function][1](g, self.alpha, kernel)

  def glu(self, gate: Array, up: Array, kernel: bool = False) -> Array:
    """A = fn(gate) * (up + up_offset), gate and up clamped first when `limit` is set."""
    if self.limit is not None:
      gate = jnp.minimum(gate, self.limit)
      up = jnp.minimum(jnp.maximum(up, -self.limit), self.limit)
    if self.up_offset:
      up = up + self.up_offset
    return self.fn(gate, kernel) * up

  def glu_backward(self, gate: Array, up: Array, d_a: Array,
                   kernel: bool = False) -> tuple[Array, Array, Array]:
    """(A, dgate, dup) for the cotangent dA of `glu`."""
    gate_in, up_in = gate, up
    if self.limit is not None:
      gate = jnp.minimum(gate, self.limit)
      up = jnp.minimum(jnp.maximum(up, -self.limit), self.limit)
    if self.up_offset:
      up = up + self.up_offset
    act_gate = self.fn(gate, kernel)
    d_gate = d_a * up * self.grad(gate, kernel)
    d_up = d_a * act_gate
    if self.limit is not None:  # zero where the clamp is active
      zero = jnp.zeros_like(d_gate)
      d_gate = jnp.where(gate_in > self.limit, zero, d_gate)
      d_up = jnp.where(up_in > self.limit, zero, jnp.where(up_in < -self.limit, zero, d_up))
    return act_gate * up, d_gate, d_up


def clamped_swiglu(alpha: float = 1.702, limit: float | None = 7.0,
                   up_offset: float = 1.0) -> Activation:
  """gpt-oss's expert activation: gate = min(gate, limit), up = clip(up, -limit, limit),
  A = gate * sigmoid(alpha * gate) * (up + up_offset); limit None: no clamp. The defaults are
  gpt-oss's constants."""
  # Activation checks the values by field name; its name needs them as floats first.
  as_float = lambda v: float(v) if isinstance(v, numbers.Real) and not isinstance(
      v, (bool, np.bool_)) else v
  alpha, limit, up_offset = as_float(alpha), as_float(limit), as_float(up_offset)
  name = "clamped_swiglu"
  if (alpha, limit, up_offset) != (1.702, 7.0, 1.0):
    name = f"clamped_swiglu(alpha={alpha}, limit={limit}, up_offset={up_offset})"
  return Activation(name, "silu", is_glu=True, alpha=alpha, limit=limit, up_offset=up_offset)


# Read-only: a jitted function keyed on a preset's name must not see it change.
ACTIVATIONS: Mapping[str, Activation] = types.MappingProxyType({
    "swiglu": Activation("swiglu", "silu", is_glu=True),
    "geglu": Activation("geglu", "gelu", is_glu=True),
    "geglu_tanh": Activation("geglu_tanh", "gelu_tanh", is_glu=True),
    "reglu": Activation("reglu", "relu", is_glu=True),
    "clamped_swiglu": clamped_swiglu(),
    "gelu": Activation("gelu", "gelu", is_glu=False),
    "gelu_tanh": Activation("gelu_tanh", "gelu_tanh", is_glu=False),
    "relu": Activation("relu", "relu", is_glu=False),
    "relu_sq": Activation("relu_sq", "relu_sq", is_glu=False),
    "silu": Activation("silu", "silu", is_glu=False),
})


def get_activation(activation: str | Activation) -> Activation:
  """An `Activation` by name (a key of `ACTIVATIONS`), or the one given."""
  if isinstance(activation, Activation):
    return activation
  if not isinstance(activation, str) or activation not in ACTIVATIONS:
    raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)} or a "
                     f"sonic_jax.activations.Activation, got {activation!r}")
  return ACTIVATIONS[activation]


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
  if not hasattr(w, "shape") or not hasattr(w, "dtype"):
    raise TypeError(f"w must be an array, got {type(w).__name__}")
  if w.ndim < 1 or w.shape[-1] % 2:
    raise ValueError(f"w must have an even last dimension (gate and up columns), got shape "
                     f"{w.shape}")
  return merge_gate_up(*split_gate_up(w, source), target)


def compute_dtype(dtype):
  """Epilogue arithmetic dtype: float32, or float64 for float64 inputs."""
  return jnp.promote_types(dtype, jnp.float32)


def apply_activation(h: Array, act: Activation, layout: str) -> Array:
  """A = act(H) in float32, float64 for float64 H (H: (..., 2n) for GLU, (..., n) otherwise)."""
  h = h.astype(compute_dtype(h.dtype))
  if act.is_glu:
    return act.glu(*split_gate_up(h, layout))
  return act.fn(h)


def activation_backward(h: Array, d_a: Array, act: Activation, layout: str) -> tuple[Array, Array]:
  """Recomputes A from H and returns (A, dH) for the cotangent dA, all float32 (float64 for
  float64 H)."""
  h = h.astype(compute_dtype(h.dtype))
  d_a = d_a.astype(h.dtype)
  if act.is_glu:
    a, d_gate, d_up = act.glu_backward(*split_gate_up(h, layout), d_a)
    return a, merge_gate_up(d_gate, d_up, layout)
  return act.fn(h), d_a * act.grad(h)
