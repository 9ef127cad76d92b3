"""Per-problem kernel configurations: a small table, measured by `benchmarks/autotune.py`.

Each entry names a role ("up", "down", "dh", "dx" on the grouped-GEMM core, "weight_grad" on the
varlen-K kernel), the GPU it was measured on, the problem (d, n, E, where n is the width of the
role's expert weight: w1's (2n for GLU) for "up" and "dx", w2's n for "down", "dh" and
"weight_grad") and the configuration fields that won (`GroupedGemmConfig`'s `num_stages`,
`grid_tile_width`, `grid_band`, `memory_registers`, `epilogue_buffers`, `cluster_m`, `schedule`;
for "dh" also `DhProjectionConfig.wide_h_loads` and `block_n`, for "down"
`DownProjectionConfig.block_n`;
`WeightGradConfig`'s `num_stages`, `cluster`, `indices_before_wait`).
A problem takes the fields of the entry of its role nearest to it in (log2 d, log2 n, log2 E),
measured on the same kind of GPU if the table has one, else on any; fields an entry does not name
keep their defaults, and a role without entries runs the defaults.

The table shipped with the package is `tuned_configs.json` (H100). `SONIC_JAX_TUNED_CONFIGS=path`
replaces it with another file of the same format (what `python -m benchmarks.autotune --out=...`
writes); `set_table(entries)` replaces it in-process (before tracing: a jitted function keeps the
configuration it was traced with).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any

from sonic_jax.mosaic_gpu.grouped_gemm import GroupedGemmConfig, target_device

ROLES = ("up", "down", "dh", "dx", "weight_grad")
GEMM_FIELDS = ("num_stages", "grid_tile_width", "grid_band", "memory_registers",
               "epilogue_buffers", "cluster_m", "schedule")
WEIGHT_GRAD_FIELDS = ("num_stages", "cluster", "indices_before_wait")
DH_FIELDS = ("wide_h_loads", "block_n")  # DhProjectionConfig's own, next to the GEMM fields
DOWN_FIELDS = ("block_n",)  # DownProjectionConfig's own
ROLE_FIELDS = {"up": GEMM_FIELDS, "down": GEMM_FIELDS + DOWN_FIELDS, "dh": GEMM_FIELDS + DH_FIELDS,
               "dx": GEMM_FIELDS, "weight_grad": WEIGHT_GRAD_FIELDS}
_PACKAGED = os.path.join(os.path.dirname(__file__), "tuned_configs.json")
_override: list[dict[str, Any]] | None = None


def validate(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """Checks the table's format; returns it."""
  for i, entry in enumerate(entries):
    missing = {"role", "device", "d", "n", "E", "config"} - set(entry)
    if missing:
      raise ValueError(f"tuned config entry {i} lacks {sorted(missing)}")
    if entry["role"] not in ROLES:
      raise ValueError(f"tuned config entry {i}: role must be one of {ROLES}, got {entry['role']!r}")
    allowed = ROLE_FIELDS[entry["role"]]
    unknown = set(entry["config"]) - set(allowed)
    if unknown:
      raise ValueError(f"tuned config entry {i}: fields {sorted(unknown)} are not tunable for "
                       f"role {entry['role']!r} (tunable: {allowed})")
  return entries


@functools.cache
def _load(path: str) -> tuple[dict[str, Any], ...]:
  with open(path) as f:
    return tuple(validate(json.load(f)["entries"]))


def table() -> tuple[dict[str, Any], ...]:
  if _override is not None:
    return tuple(_override)
  return _load(os.environ.get("SONIC_JAX_TUNED_CONFIGS", _PACKAGED))


def _key(entry: dict[str, Any]) -> tuple:
  return entry["role"], entry["device"], entry["d"], entry["n"], entry["E"]


def same_problem(a: dict[str, Any], b: dict[str, Any]) -> bool:
  """Whether two entries are for the same role, GPU and problem."""
  return _key(a) == _key(b)


def merged(base: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """`base`'s entries that `new` does not re-measure (same role, GPU and problem), then `new`'s."""
  fresh = {_key(e) for e in new}
  return [e for e in base if _key(e) not in fresh] + list(new)


def set_table(entries: list[dict[str, Any]] | None):
  """Uses `entries` (the format of `tuned_configs.json`'s "entries") from now on; None restores
  the packaged (or SONIC_JAX_TUNED_CONFIGS) table."""
  global _override
  _override = None if entries is None else validate(list(entries))


def _device_kind() -> str:
  return target_device().device_kind


def tuned_fields(role: str, *, d: int, n: int, num_experts: int) -> dict[str, Any]:
  """The configuration fields the table gives this problem (empty: the defaults)."""
  if role not in ROLES:
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")
  entries = [e for e in table() if e["role"] == role]
  device = _device_kind()
  same_gpu = [e for e in entries if e["device"] == device]
  entries = same_gpu or entries
  if not entries:
    return {}
  point = (math.log2(d), math.log2(n), math.log2(num_experts))
  nearest = min(entries, key=lambda e: math.dist(point, (math.log2(e["d"]), math.log2(e["n"]),
                                                         math.log2(e["E"]))))
  return dict(nearest["config"])


def gemm_config(role: str, *, d: int, n: int, num_experts: int,
                base: GroupedGemmConfig = GroupedGemmConfig()) -> GroupedGemmConfig:
  """`base` with the grouped-GEMM fields the table gives this problem and role."""
  fields = tuned_fields(role, d=d, n=n, num_experts=num_experts)
  return dataclasses.replace(base, **{k: v for k, v in fields.items() if k in GEMM_FIELDS})


def role_fields(role: str, *, d: int, n: int, num_experts: int) -> dict[str, Any]:
  """The fields the table gives this problem that belong to the role's own configuration (e.g.
  dH's `wide_h_loads`, the down-projection's `block_n`), not to its grouped-GEMM core."""
  fields = tuned_fields(role, d=d, n=n, num_experts=num_experts)
  return {k: v for k, v in fields.items() if k not in GEMM_FIELDS}
