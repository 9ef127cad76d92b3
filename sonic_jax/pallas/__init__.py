"""Pallas (Triton) kernels for the routing step: the router's top-K, the layout's block ranks, and
token rounding's selection and extra-pair fold.

Pallas's Triton lowering is deprecated in jax 0.11 but present in 0.11.2; `TRITON_AVAILABLE` is
False where it is gone, and each caller takes its XLA path instead.
"""

try:
  from jax.experimental.pallas import triton as pltriton
  TRITON_AVAILABLE = True
except ImportError:  # pragma: no cover
  pltriton = None
  TRITON_AVAILABLE = False


def next_pow2(v: int) -> int:
  """The smallest power of two >= v (1 for v <= 1): Triton's block dimensions are powers of two."""
  return 1 << max(v - 1, 0).bit_length()
