"""Router top-K: the K largest of each token's E routing values and their expert ids, in one pass.

XLA's GPU top-K reads the (T, E) routing values at a small fraction of HBM bandwidth (on an H100
about 30% of the whole routing-metadata pass at T = 32768, E = 256, K = 16). Here one Pallas (Triton)
program takes a block of tokens, keeps their E values in registers and picks the K experts one at a
time on order-preserving int32 keys, so the values are read once from HBM. A key packs the
value's upper bits with the expert id (one max per pick gives both), and a program in which two
of a row's K + 1 largest values come too close for that falls back to the exact selection (max,
then the lowest id holding it, then that expert drops out): `_select_ids_packed`. It uses Pallas's
Triton lowering, deprecated in jax 0.11 but present in 0.11.2; `AVAILABLE` is False where it is
gone, and routing calls `lax.top_k`.

Same result as `jax.lax.top_k`: values in descending order, ties to the lower expert id, every id
distinct (also with -inf values), NaN above every number. Reference: `jax.lax.top_k`.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from sonic_jax.pallas import TRITON_AVAILABLE, next_pow2, pltriton

AVAILABLE = TRITON_AVAILABLE  # without the Triton lowering routing uses lax.top_k

MAX_EXPERTS = 1024
MAX_K = 32  # the selection loop is unrolled k times
# The programs' shape: (tokens, E) values per program and warps, 16 values per thread (the
# fastest of the shapes measured, docs/decisions.md).
VALUES_PER_PROGRAM = 512
NUM_WARPS = 1


def block_tokens(e: int) -> int:
  return max(1, min(64, VALUES_PER_PROGRAM // e))


def _selection_unsupported(e: int, k: int, max_experts: int) -> str | None:
  """Why the selection cannot pick k of E per token (E a power of two: Triton blocks), or None."""
  if e & (e - 1) or not 2 <= e <= max_experts:
    return f"E={e} is not a power of two in [2, {max_experts}]"
  if not 1 <= k <= min(e, MAX_K):
    return f"k={k} is not in [1, min(E, {MAX_K})]"
  return None


def supports(values: jax.Array, k: int) -> str | None:
  """None when the kernel handles this problem, else the reason it does not."""
  if values.ndim != 2:
    return f"values must be (T, E), got shape {values.shape}"
  reason = _selection_unsupported(values.shape[1], k, MAX_EXPERTS)
  if reason is not None:
    return reason
  if values.dtype != jnp.float32:
    return f"values dtype {values.dtype} (the kernel takes float32)"
  return None


def _order_keys(v):
  """int32 keys with the float order of v (NaN above +inf, as lax.top_k ranks it)."""
  bits = lax.bitcast_convert_type(v, jnp.int32)
  keys = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)
  return jnp.where(v != v, jnp.int32(0x7FFFFFFF), keys)


def _select_ids(values, k: int, k_block: int):
  """(tokens, k_block) int32: the ids of each row's k largest values (lax.top_k's order and ties);
  slots past k hold 0."""
  keys = _order_keys(values)
  e = keys.shape[1]
  expert = lax.broadcasted_iota(jnp.int32, keys.shape, 1)
  slot = lax.broadcasted_iota(jnp.int32, (keys.shape[0], k_block), 1)
  ids = jnp.zeros((keys.shape[0], k_block), jnp.int32)
  for j in range(k):
    best = jnp.max(keys, axis=1)
    pick = jnp.min(jnp.where(keys == best[:, None], expert, e), axis=1)  # ties: lowest id
    # A taken expert drops below every key; if all that is left is that low (E - j values of
    # -inf), the lowest id not yet taken still wins the tie among them.
    keys = jnp.where(expert == pick[:, None], jnp.iinfo(jnp.int32).min, keys)
    ids = jnp.where(slot == j, pick[:, None], ids)
  return ids


def _select_ids_packed(values, k: int, k_block: int):
  """`_select_ids` with half the operations per pick where no two of a row's k + 1 largest values
  are close.

  Each key keeps its upper 32 - log2(E) bits (its bucket) and takes E - 1 - id as its low bits,
  so one max per round gives both the value and the id (no second reduction for the lowest id
  holding the maximum), and masking the pick is one compare. The order of these keys is the
  exact one wherever the k + 1 largest fall in k + 1 distinct buckets (values within about
  2^(log2(E) - 23) of each other share one); a program with a row where two of them share a
  bucket (near-ties, exact ties, NaNs, repeated -inf) runs the exact selection instead, so the
  ids are always `jax.lax.top_k`'s."""
  keys = _order_keys(values)
  e = keys.shape[1]
  low = e - 1  # e is a power of two
  expert = lax.broadcasted_iota(jnp.int32, keys.shape, 1)
  packed = (keys & jnp.int32(~low)) | (low - expert)
  slot = lax.broadcasted_iota(jnp.int32, (keys.shape[0], k_block), 1)
  ids = jnp.zeros((keys.shape[0], k_block), jnp.int32)
  close = jnp.zeros((keys.shape[0],), jnp.int32)
  prev = None
  for j in range(k + 1 if k < e else k):  # round k only compares the (k+1)-th with the k-th
    best = jnp.max(packed, axis=1)
    if prev is not None:
      close = close | ((best & jnp.int32(~low)) == (prev & jnp.int32(~low))).astype(jnp.int32)
    if j < k:
      ids = jnp.where(slot == j, (low - (best & low))[:, None], ids)
      packed = jnp.where(packed == best[:, None], jnp.iinfo(jnp.int32).min, packed)
    prev = best
  return lax.cond(jnp.max(close) > 0, lambda: _select_ids(values, k, k_block), lambda: ids)


def _kernel(values_ref, ids_ref, *, k: int):
  ids_ref[...] = _select_ids_packed(values_ref[...], k, ids_ref.shape[1])


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def top_k(values: jax.Array, k: int, interpret: bool = False):
  """(top values (T, k) descending, expert ids (T, k) int32) of float32 values (T, E); programs of
  `block_tokens(E)` tokens on NUM_WARPS warps."""
  reason = supports(values, k)
  if reason is not None:
    raise ValueError(f"router top-K kernel: {reason}")
  t, e = values.shape
  bt = block_tokens(e)
  padded = jnp.pad(values, ((0, -t % bt), (0, 0))) if t % bt else values  # whole blocks only
  k_block = next_pow2(k)  # Triton blocks are powers of two; the extra slots are sliced off
  rows = padded.shape[0]
  ids = pl.pallas_call(
      functools.partial(_kernel, k=k),
      out_shape=jax.ShapeDtypeStruct((rows, k_block), jnp.int32),
      grid=(rows // bt,),
      in_specs=[pl.BlockSpec((bt, e), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((bt, k_block), lambda i: (i, 0)),
      compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      name="router_top_k",
      interpret=interpret,
  )(padded)[:t, :k]
  return jnp.take_along_axis(values, ids, axis=1), ids


# The router GEMM with the top-K in its epilogue (`logits_top_k`).
LOGITS_BLOCK_D = 64  # reduction step of the router GEMM
LOGITS_MAX_EXPERTS = 256


def logits_block_tokens(e: int) -> int:
  """Tokens per program of `logits_top_k`: 64 (every program reads all of the router weight, from
  L2), fewer where the (tokens, E) logits would not stay in the registers of 4 warps: the fastest
  of the shapes measured (docs/decisions.md)."""
  return max(16, min(64, 8192 // e))


def logits_supports(x: jax.Array, w: jax.Array, k: int) -> str | None:
  """None when `logits_top_k` handles x (T, d) @ w (d, E) with top-k, else the reason."""
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    return f"x (T, d) and w (d, E) expected, got shapes {x.shape} and {w.shape}"
  if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
    return f"dtypes {x.dtype}, {w.dtype} (the kernel takes bfloat16 or float16, both the same)"
  reason = _selection_unsupported(w.shape[1], k, LOGITS_MAX_EXPERTS)
  if reason is not None:
    return reason
  if x.shape[1] % LOGITS_BLOCK_D:
    return f"d={x.shape[1]} is not a multiple of {LOGITS_BLOCK_D}"
  if x.shape[0] < 1:
    return "no tokens"
  return None


def _logits_kernel(x_ref, w_ref, *refs, k: int, bt: int, num_tokens: int, has_bias: bool):
  bias_ref = refs[0] if has_bias else None
  logits_ref, ids_ref = refs[-2:]
  t0 = pl.program_id(0) * bt
  token = t0 + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
  in_range = token < num_tokens  # the last block's rows past T are masked, not padded
  e = w_ref.shape[1]
  bd = LOGITS_BLOCK_D

  def step(i, acc):
    d0 = pl.multiple_of(i * bd, bd)
    xs = pltriton.load(x_ref.at[pl.ds(t0, bt), pl.ds(d0, bd)],
                       mask=jnp.broadcast_to(in_range, (bt, bd)), other=0.0)
    return acc + jnp.dot(xs, w_ref[pl.ds(d0, bd), :], preferred_element_type=jnp.float32)

  logits = lax.fori_loop(0, x_ref.shape[1] // bd, step, jnp.zeros((bt, e), jnp.float32))
  pltriton.store(logits_ref.at[pl.ds(t0, bt), :], logits, mask=jnp.broadcast_to(in_range, (bt, e)))
  values = logits + bias_ref[...] if has_bias else logits  # as routing adds the selection bias
  k_block = ids_ref.shape[1]
  pltriton.store(ids_ref.at[pl.ds(t0, bt), :], _select_ids_packed(values, k, k_block),
                 mask=jnp.broadcast_to(in_range, (bt, k_block)))


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def logits_top_k(x: jax.Array, w: jax.Array, k: int, bias: jax.Array | None = None,
                 interpret: bool = False):
  """(logits (T, E) float32, ids (T, k) int32): logits = x @ w with float32 accumulation, ids the
  experts of each token's k largest logits (+ bias (E,) float32, which moves the selection only),
  as `jax.lax.top_k` picks them from these logits.

  One Pallas (Triton) program per block of tokens runs the router GEMM over d in steps of
  LOGITS_BLOCK_D and selects the top-k from the logits in its registers: one kernel instead of a
  GEMM and the top-K kernel, and the logits are not read back. x is read once; every program reads
  all of w (from L2). A program takes `logits_block_tokens(E)` tokens on 4 warps
  (docs/decisions.md), its GEMM loop pipelined 3 deep.
  """
  reason = logits_supports(x, w, k)
  if reason is not None:
    raise ValueError(f"router logits + top-K kernel: {reason}")
  t, e = x.shape[0], w.shape[1]
  bt = logits_block_tokens(e)
  k_block = next_pow2(k)
  blocks = pl.cdiv(t, bt)
  has_bias = bias is not None
  operands = (x, w) + ((bias.astype(jnp.float32).reshape(1, e),) if has_bias else ())
  logits, ids = pl.pallas_call(
      functools.partial(_logits_kernel, k=k, bt=bt, num_tokens=t, has_bias=has_bias),
      out_shape=(jax.ShapeDtypeStruct((t, e), jnp.float32),
                 jax.ShapeDtypeStruct((t, k_block), jnp.int32)),
      grid=(blocks,),
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=3),
      name="router_logits_top_k",
      interpret=interpret,
  )(*operands)
  return logits, ids[:, :k] if k_block != k else ids
