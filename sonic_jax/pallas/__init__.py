"""Pallas (Triton) kernels for the routing step: the router's top-K and the layout's block ranks."""


def next_pow2(v: int) -> int:
  """The smallest power of two >= v (1 for v <= 1): Triton's block dimensions are powers of two."""
  return 1 << max(v - 1, 0).bit_length()
