"""Per-problem kernel configurations: a small table, measured by `benchmarks/autotune.py`.

Each entry names a role ("up", "down", "dh", "dx" on the grouped-GEMM core, "weight_grad" on the
varlen-K kernel), the GPU it was measured on, the problem (d, n, E, where n is the width of the
role's expert weight: w1's (2n for GLU) for "up" and "dx", w2's n for "down", "dh" and
"weight_grad") and the configuration fields that won (`ROLE_FIELDS`). A problem takes the fields of
the entry of its role nearest to it in (log2 d, log2 n, log2 E), measured on the same kind of GPU
if the table has one, else on any; fields an entry does not name keep their defaults, and a role
without entries runs the defaults. An entry's other keys record where it came from (its time, the
date, and the autotune command or the commit that last changed it); lookups ignore them.

The table shipped with the package is `tuned_configs.json` (H100). A caller passes another one per
call as `sonic_jax.Config(tuning=TuningTable.load(path))` (what `python -m benchmarks.autotune
--out=...` writes). Pure data: no kernel is imported here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Iterable

import jax

ROLES = ("up", "down", "dh", "dx", "weight_grad")
GEMM_FIELDS = ("num_stages", "grid_tile_width", "grid_band", "memory_registers", "cluster_m",
               "schedule")
WEIGHT_GRAD_FIELDS = ("num_stages", "cluster", "indices_before_wait")
DH_FIELDS = ("wide_h_loads",)  # DhProjectionConfig's own, next to the GEMM fields
# Only dH runs the pingpong schedule: the other GEMM roles take the cooperative one only. The
# roles that gather their rows (up, dH) run unclustered: 2-CTA clusters measured slower there.
COOPERATIVE_FIELDS = tuple(f for f in GEMM_FIELDS if f != "schedule")
GATHERING_FIELDS = tuple(f for f in COOPERATIVE_FIELDS if f != "cluster_m")
ROLE_FIELDS = {"up": GATHERING_FIELDS, "down": COOPERATIVE_FIELDS,
               "dh": GATHERING_FIELDS + ("schedule",) + DH_FIELDS, "dx": COOPERATIVE_FIELDS,
               "weight_grad": WEIGHT_GRAD_FIELDS}
PACKAGED = os.path.join(os.path.dirname(__file__), "tuned_configs.json")


@dataclasses.dataclass(frozen=True)
class Entry:
  """One measured problem of one role: `fields` are (name, value) pairs of its configuration."""

  role: str
  device: str
  d: int
  n: int
  E: int
  fields: tuple[tuple[str, Any], ...]

  @classmethod
  def from_dict(cls, entry: dict[str, Any], where: str = "entry") -> "Entry":
    missing = {"role", "device", "d", "n", "E", "config"} - set(entry)
    if missing:
      raise ValueError(f"tuned config {where} lacks {sorted(missing)}")
    if entry["role"] not in ROLES:
      raise ValueError(f"tuned config {where}: role must be one of {ROLES}, got {entry['role']!r}")
    allowed = ROLE_FIELDS[entry["role"]]
    unknown = set(entry["config"]) - set(allowed)
    if unknown:
      raise ValueError(f"tuned config {where}: fields {sorted(unknown)} are not tunable for role "
                       f"{entry['role']!r} (tunable: {allowed})")
    made = cls(entry["role"], entry["device"], int(entry["d"]), int(entry["n"]), int(entry["E"]),
               tuple(sorted(entry["config"].items())))
    # Values too, by building the role's configuration: a value its config refuses would
    # otherwise fail every role's kernels, which build all the roles' configurations.
    from sonic_jax.config import Config  # pylint: disable=import-outside-toplevel
    from sonic_jax.mosaic_gpu import backend  # pylint: disable=import-outside-toplevel
    try:
      backend.role_configs(made.d, made.n, made.E, glu=True,
                           config=Config(tuning=TuningTable((made,))))
    except (ValueError, TypeError) as e:
      raise ValueError(f"tuned config {where} ({made.role}): {e}") from None
    return made

  def same_problem(self, other: "Entry") -> bool:
    """Whether both entries are for the same role, GPU and problem."""
    return (self.role, self.device, self.d, self.n, self.E) == (
        other.role, other.device, other.d, other.n, other.E)


@dataclasses.dataclass(frozen=True)
class TuningTable:
  """A tuning table: frozen and hashable, so it can sit in a `sonic_jax.Config`."""

  entries: tuple[Entry, ...]

  @classmethod
  def from_entries(cls, entries: Iterable[dict[str, Any] | Entry]) -> "TuningTable":
    return cls(tuple(e if isinstance(e, Entry) else Entry.from_dict(e, f"entry {i}")
                     for i, e in enumerate(entries)))

  @classmethod
  def load(cls, path: str) -> "TuningTable":
    """The table of a JSON file in the format of `tuned_configs.json` ({"entries": [...]})."""
    with open(path) as f:
      return cls.from_entries(json.load(f)["entries"])

  def merged(self, new: "TuningTable") -> "TuningTable":
    """This table's entries that `new` does not re-measure (same role, GPU, problem), then new's."""
    kept = [e for e in self.entries if not any(e.same_problem(f) for f in new.entries)]
    return TuningTable(tuple(kept) + new.entries)

  def fields(self, role: str, *, d: int, n: int, num_experts: int,
             device_kind: str | None = None) -> dict[str, Any]:
    """The configuration fields the table gives this problem (empty: the defaults)."""
    if role not in ROLES:
      raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    entries = [e for e in self.entries if e.role == role]
    device = device_kind if device_kind is not None else target_device().device_kind
    entries = [e for e in entries if e.device == device] or entries
    if not entries:
      return {}
    point = (math.log2(d), math.log2(n), math.log2(num_experts))
    nearest = min(entries, key=lambda e: math.dist(point, (math.log2(e.d), math.log2(e.n),
                                                           math.log2(e.E))))
    return dict(nearest.fields)


@functools.cache
def packaged() -> TuningTable:
  """The table shipped with the package (`tuned_configs.json`)."""
  return TuningTable.load(PACKAGED)


def target_device():
  """The GPU the kernels are built for: the abstract mesh's device (export, interpret mode), else
  the first device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is not None and getattr(mesh, "abstract_device", None) is not None:
    return mesh.abstract_device
  return jax.devices()[0]
