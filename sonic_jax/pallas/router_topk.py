"""Router top-K: the K largest of each token's E routing values and their expert ids, in one pass.

XLA's GPU top-K reads the (T, E) routing values at about 0.1 TB/s on an H100 (0.33 ms for
T = 32768, E = 256, K = 16: a third of the whole routing-metadata pass). Here one Pallas (Triton)
program takes a block of tokens, keeps their E values in registers and picks the K experts one at a
time on order-preserving int32 keys (max, then the lowest id holding it, then that expert drops
out), so the values are read once from HBM. It uses Pallas's Triton lowering, deprecated in jax
0.11 but present in 0.11.2; `AVAILABLE` is False where it is gone, and routing calls `lax.top_k`.

Same result as `jax.lax.top_k`: values in descending order, ties to the lower expert id, every id
distinct (also with -inf values), NaN above every number. Reference: `jax.lax.top_k`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax.pallas import next_pow2

try:  # Pallas's Triton lowering is deprecated in jax 0.11; without it routing uses lax.top_k.
  from jax.experimental.pallas import triton as pltriton
  AVAILABLE = True
except ImportError:  # pragma: no cover
  pltriton = None
  AVAILABLE = False

MAX_EXPERTS = 1024
MAX_K = 32  # the selection loop is unrolled k times
VALUES_PER_PROGRAM = 2048  # (tokens, E) values per program: 16 per thread of 4 warps, no spills


def block_tokens(e: int, values_per_program: int = VALUES_PER_PROGRAM) -> int:
  return max(1, min(64, values_per_program // e))


def supports(values: jax.Array, k: int) -> str | None:
  """None when the kernel handles this problem, else the reason it does not."""
  if values.ndim != 2:
    return f"values must be (T, E), got shape {values.shape}"
  e = values.shape[1]
  if e & (e - 1) or not 2 <= e <= MAX_EXPERTS:
    return f"E={e} is not a power of two in [2, {MAX_EXPERTS}]"
  if not 1 <= k <= min(e, MAX_K):
    return f"k={k} is not in [1, min(E, {MAX_K})]"
  if values.dtype != jnp.float32:
    return f"values dtype {values.dtype} (the kernel takes float32)"
  return None


def _order_keys(v):
  """int32 keys with the float order of v (NaN above +inf, as lax.top_k ranks it)."""
  bits = lax.bitcast_convert_type(v, jnp.int32)
  keys = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
  return jnp.where(v != v, jnp.int32(0x7FFFFFFF), keys)


def _kernel(values_ref, ids_ref, *, k: int):
  keys = _order_keys(values_ref[...])
  e = keys.shape[1]
  expert = lax.broadcasted_iota(jnp.int32, keys.shape, 1)
  slot = lax.broadcasted_iota(jnp.int32, ids_ref.shape, 1)
  ids = jnp.zeros(ids_ref.shape, jnp.int32)
  for j in range(k):
    best = jnp.max(keys, axis=1)
    pick = jnp.min(jnp.where(keys == best[:, None], expert, e), axis=1)  # ties: lowest id
    # A taken expert drops below every key; if all that is left is that low (E - j values of
    # -inf), the lowest id not yet taken still wins the tie among them.
    keys = jnp.where(expert == pick[:, None], jnp.iinfo(jnp.int32).min, keys)
    ids = jnp.where(slot == j, pick[:, None], ids)
  ids_ref[...] = ids


@functools.partial(jax.jit, static_argnames=("k", "interpret", "values_per_program"))
def top_k(values: jax.Array, k: int, interpret: bool = False,
          values_per_program: int = VALUES_PER_PROGRAM):
  """(top values (T, k) descending, expert ids (T, k) int32) of float32 values (T, E)."""
  reason = supports(values, k)
  if reason is not None:
    raise ValueError(f"router top-K kernel: {reason}")
  t, e = values.shape
  bt = block_tokens(e, values_per_program)
  padded = jnp.pad(values, ((0, -t % bt), (0, 0))) if t % bt else values  # whole blocks only
  k_block = next_pow2(k)  # Triton blocks are powers of two; the extra slots are sliced off
  rows = padded.shape[0]
  ids = pl.pallas_call(
      functools.partial(_kernel, k=k),
      out_shape=jax.ShapeDtypeStruct((rows, k_block), jnp.int32),
      grid=(rows // bt,),
      in_specs=[pl.BlockSpec((bt, e), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((bt, k_block), lambda i: (i, 0)),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
  )(padded)[:t, :k]
  return jnp.take_along_axis(values, ids, axis=1), ids
