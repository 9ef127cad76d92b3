"""Argument checks shared by `sonic_jax.moe`, `routed_experts`, `expert_mixture`, the
expert-parallel ops and the Flax layer: each error names the argument and what was expected,
before anything is traced."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

from sonic_jax import activations as acts
from sonic_jax import routing as routing_lib
from sonic_jax.layout import check_integer_array

_FLOATS = tuple(jnp.dtype(t) for t in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))


def compute_dtype(a):
  """a's dtype as JAX computes with it: a NumPy float64 input is float32 unless
  jax_enable_x64 is on, as under `jax.jit`."""
  return jax.dtypes.canonicalize_dtype(a.dtype)


def check_float(name, a):
  if a.dtype not in _FLOATS:
    raise TypeError(f"{name} must have a floating dtype of float16, bfloat16, float32 or "
                    f"float64, got {a.dtype}")


def check_rank(name, a, rank, shape_doc):
  if a.ndim != rank:
    raise ValueError(f"{name} must have shape {shape_doc}, got shape {tuple(a.shape)}")


def check_array(name, a):
  if not hasattr(a, "shape") or not hasattr(a, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(a).__name__}")
  check_float(name, a)


def check_experts(x, w1, w2, b1, b2, activation, gate_up_layout, e_count=None):
  """Checks x and the expert weights (E = e_count, or w1's first dim when None); returns the
  `Activation`."""
  for name, a in (("x", x), ("w1", w1), ("w2", w2)):
    check_array(name, a)
    if not all(isinstance(n, int) for n in a.shape):  # jax.export's symbolic dimensions
      raise ValueError(f"{name} has shape {tuple(a.shape)}: sonic_jax needs static shapes (its "
                       "grouped buffers are sized from T, E and K at trace time); export one "
                       "function per shape")
  act = acts.get_activation(activation)
  if gate_up_layout not in acts.GATE_UP_LAYOUTS:
    raise ValueError(f"gate_up_layout must be one of {acts.GATE_UP_LAYOUTS}, got "
                     f"{gate_up_layout!r}")
  check_rank("x", x, 2, "(T, d)")
  _, d = x.shape
  mult = act.width_multiplier()
  check_rank("w1", w1, 3, f"(E, d, {'2n' if act.is_glu else 'n'}) = "
                          f"({'E' if e_count is None else e_count}, {d}, ...)")
  e_count = w1.shape[0] if e_count is None else e_count
  if not e_count:
    raise ValueError(f"w1 must hold at least one expert (E >= 1), got shape {tuple(w1.shape)}")
  if w1.shape[0] != e_count or w1.shape[1] != d:
    raise ValueError(f"w1 must have shape (E, d, {'2n' if act.is_glu else 'n'}) with "
                     f"E = {e_count}, d = {d}, got {tuple(w1.shape)}")
  if w1.shape[2] % mult or w1.shape[2] == 0:
    what = "2n (even and > 0) for the GLU" if act.is_glu else "n (> 0) for the"
    raise ValueError(f"w1's last dim must be {what} activation {activation!r}, got {w1.shape[2]}")
  n = w1.shape[2] // mult
  check_rank("w2", w2, 3, f"(E, n, d) = ({e_count}, {n}, {d})")
  if tuple(w2.shape) != (e_count, n, d):
    hint = ""
    if w2.shape[1] == w1.shape[2] and act.is_glu:
      hint = (f" (w1 is (E, d, 2n) for the GLU activation {act.name!r}, so n = {n}; if n is "
              f"{w2.shape[1]}, w1 lacks its gate or up half: it must be (E, d, "
              f"{2 * w2.shape[1]}))")
    elif w2.shape[1] * 2 == w1.shape[2] and not act.is_glu:
      hint = f" (w1 looks 2n wide: is {activation!r} meant to be a GLU activation?)"
    raise ValueError(f"w2 must have shape (E, n, d) = ({e_count}, {n}, {d}), got "
                     f"{tuple(w2.shape)}{hint}")
  for name, a in (("w1", w1), ("w2", w2)):
    if compute_dtype(a) != compute_dtype(x):
      raise TypeError(f"{name} must have x's dtype {compute_dtype(x)}, got {compute_dtype(a)} "
                      "(cast the expert weights to the compute dtype; the Flax layer does this "
                      "for you)")
  for name, b, shape in (("b1", b1, (e_count, w1.shape[2])), ("b2", b2, (e_count, d))):
    if b is None:
      continue
    if not hasattr(b, "shape"):
      raise TypeError(f"{name} must be an array or None, got {type(b).__name__}")
    check_float(name, b)
    if tuple(b.shape) != shape:
      raise ValueError(f"{name} must have shape {shape}, got {tuple(b.shape)}")
    if compute_dtype(b) != compute_dtype(x):
      raise TypeError(f"{name} must have x's dtype {compute_dtype(x)}, got {compute_dtype(b)}")
  return act


def check_moe(x, router_weight, w1, w2, b1, b2, top_k, activation, gate_up_layout,
              num_local_experts=None, selection_bias=None, routing="softmax_topk",
              router_bias=None, router_input=None, expert_scale=None, expert_ids=None,
              token_rounding=None, capacity_factor=None):
  """Checks the arguments of `moe` and returns the `Activation`. The expert weights hold the
  router's E experts, or `num_local_experts` of them when experts are sharded
  (`sonic_jax.parallel`)."""
  for name, a in (("x", x), ("router_weight", router_weight)):
    check_array(name, a)
  check_rank("x", x, 2, "(T, d)")
  d = x.shape[1]
  check_rank("router_weight", router_weight, 2, f"(d, E) = ({d}, E)")
  if router_weight.shape[0] != d:
    if getattr(w1, "ndim", None) == 3 and w1.shape[1] == router_weight.shape[0]:
      # the router and the experts agree on d: x is the odd one
      raise ValueError(f"x must have shape (T, d) with d = {w1.shape[1]} (router_weight's and "
                       f"w1's), got {tuple(x.shape)}")
    raise ValueError(f"router_weight must have shape (d, E) with d = {d} (x's last dim), "
                     f"got {tuple(router_weight.shape)}")
  e_router = router_weight.shape[1]
  if (num_local_experts is None and getattr(w1, "ndim", None) == 3
      and w1.shape[0] != e_router):
    raise ValueError(f"router_weight has E = {e_router} experts (its last dim), but w1 holds "
                     f"{w1.shape[0]}: the router gives one logit per expert")
  act = check_experts(x, w1, w2, b1, b2, activation, gate_up_layout,
                      e_router if num_local_experts is None else num_local_experts)
  routing_lib.get_router(routing).check(e_router, top_k)  # top_k's type and range first
  for name, b in (("selection_bias", selection_bias), ("router_bias", router_bias),
                  ("expert_scale", expert_scale)):
    if b is None:
      continue
    check_array(name, b)
    if tuple(b.shape) != (e_router,):
      raise ValueError(f"{name} must have shape (E,) = ({e_router},), got {tuple(b.shape)}")
  if expert_ids is not None:
    check_integer_array("expert_ids", expert_ids)
    if tuple(expert_ids.shape) != (x.shape[0], top_k):
      raise ValueError(f"expert_ids must have shape (T, top_k) = ({x.shape[0]}, {top_k}), got "
                       f"{tuple(expert_ids.shape)}")
    excluded = routing_lib.fixed_selection_excludes(
        token_rounding, selection_bias is not None, routing_lib.get_router(routing),
        "selection_bias")
    if excluded:
      raise ValueError(f"expert_ids (a fixed selection) takes no {excluded}")
  if router_input is not None:
    check_array("router_input", router_input)
    if tuple(router_input.shape) != tuple(x.shape):
      raise ValueError(f"router_input must have x's shape {tuple(x.shape)}, got "
                       f"{tuple(router_input.shape)}")
  check_capacity(capacity_factor)
  check_rounding(token_rounding, routing, capacity_factor)
  return act


def check_capacity(capacity_factor):
  if capacity_factor is None:
    return
  if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
    raise TypeError(f"capacity_factor must be None or a real number, got "
                    f"{type(capacity_factor).__name__}")
  if not 0 < capacity_factor < math.inf:
    raise ValueError(f"capacity_factor must be finite and > 0, got {capacity_factor}")


def check_rounding(token_rounding, routing, capacity_factor=None) -> None:
  """token_rounding: None or a mode of `routing.TOKEN_ROUNDINGS` that the router takes, and not
  beside a capacity factor."""
  if token_rounding is None:
    return
  if token_rounding not in routing_lib.TOKEN_ROUNDINGS:
    raise ValueError(f"token_rounding must be None or one of {routing_lib.TOKEN_ROUNDINGS}, "
                     f"got {token_rounding!r}")
  reason = routing_lib.rounding_unsupported(routing)
  if reason is not None:
    raise ValueError(reason)
  if capacity_factor is not None:
    raise ValueError("token_rounding and capacity_factor exclude each other")
