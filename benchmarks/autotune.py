r"""Autotuning: measures kernel configurations of the `mosaic_gpu` backend, writes a tuning table.

  python -m benchmarks.autotune --out=table.json [--thiek=T,d,n,E,K ...] [--roles=up,dh]
      [--fields=num_stages] [--nomerge]
  PJRT_NPROC=16 python -m benchmarks.autotune --interpret --thiek=256,256,128,4,2 --roles=dx \
      --fields=num_stages --repeats=1 --out=/tmp/table.json          # a CPU run (interpret mode)

On a GPU machine: `PYTHONPATH=$PWD python3 -m benchmarks.autotune --out=$OUT/tuned_configs.json`.
The table written has the packaged format's keys ({"device", "jax", "date", "entries"}) and this
run's "command" and "trials": pass it per call as `sonic_jax.Config(tuning=TuningTable.load(path))`
(`moe_bench --tuning=path` times the layer with it), or copy it over
sonic_jax/mosaic_gpu/tuned_configs.json to ship it. It holds this run's entries and the packaged
table's (or --base's) for the problems this run does not measure; --nomerge: this run's only. Each
entry records where it came from. One this run measured has its time ("ms", and the starting
configuration's "start_ms"), "date" and "command"; the packaged table's entries have the "date"
and "commit" that last changed them, and about half of them their times (docs/kernels.md).

Per configuration and role (up, down, dh, dx on the grouped-GEMM core, weight_grad on the
varlen-K kernel), through the backend's own entry points, a coordinate search from the defaults
over `SEARCH`: 2-CTA clusters (down, dx, weight_grad), the tile walk (`grid_band` and the band's
width; not weight_grad), the ring depth, the memory warpgroup's registers (up, dH), for dH how its
wide tile reads H and the pingpong schedule, for weight_grad when it loads its row indices.
`--fields=...` searches only those fields, starting from the base table's entry for the problem.
Each candidate runs under `Config(tuning=<a table of that one entry>)` and is timed against the
incumbent in alternating rounds (`timing.time_interleaved`: the clocks drift by more than the
gains sought); it replaces the incumbent only when at least `--min_gain` faster, and only when its
outputs equal the starting configuration's bit for bit on the rows in use (dH's dS, a float32 sum
over column blocks whose count follows the tile width, to 1e-5 of its scale).
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import sonic_jax
from benchmarks import grid, timing
from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import tuning

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: the tests call main in their process
  flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable; default: the "
                            "grid)")
  flags.DEFINE_string("out", "tuned_configs.json", "path of the tuning table written")
  flags.DEFINE_string("base", None, "the table to start from and merge into (default: packaged)")
  flags.DEFINE_integer("repeats", 5, "timed samples per candidate")
  flags.DEFINE_bool("merge", True, "also write the base table's entries that this run does not "
                    "measure")
  flags.DEFINE_list("roles", None, "roles to tune (default: all of tuning.ROLES)")
  flags.DEFINE_list("fields", None, "search only these fields, starting from the base table's "
                    "entry for the problem (default: every field of SEARCH, from the defaults)")
  flags.DEFINE_float("min_gain", 0.02, "relative speed-up a candidate needs to replace the "
                     "incumbent")
  flags.DEFINE_bool("interpret", False, "Mosaic GPU interpret mode (a CPU run)")

_CLUSTER = ("cluster_m", (2,))  # 1: the default
# Bands of column blocks over every row tile ("n", the default), or of row tiles across every
# column block ("m": fewer DRAM bytes at d = 4096).
_WALK = (("grid_band", "grid_tile_width"),
         (("n", 1), ("n", 2), ("n", 4), ("n", 8), ("m", 2), ("m", 4), ("m", 8)))
# Clusters are not searched for the up-projection and dH, where they measured slower
# (docs/decisions.md, "Up-projection", "dH").
SEARCH = {  # role: [(field or fields, candidate values)], searched one step at a time
    "up": [_WALK, ("num_stages", (3, 4)), ("memory_registers", (40, 56, 80))],
    "down": [_CLUSTER, _WALK, ("num_stages", (3, 4))],
    "dh": [_WALK, ("num_stages", (3, 4)), ("memory_registers", (40, 56, 80)),
           ("wide_h_loads", ("staged", "registers")),
           # Pingpong: a warpgroup a whole 128 x 128 tile, its epilogue under the other's mainloop.
           (("schedule", "num_stages"), (("pingpong", 4), ("pingpong", 6)))],
    "dx": [_CLUSTER, _WALK, ("num_stages", (3, 4))],
    "weight_grad": [("cluster", (2,)), ("num_stages", (3, 4)), ("indices_before_wait", (False,))],
}
_DH_DS_LEAF = 2  # backend.dh_projection returns (dH, A_s, dS, None)


def _problem(cfg):
  """({role: (fn(*args, config), args, the table's n of the problem)}, rows_in_use)."""
  _, _, n, _, _ = cfg
  act = acts.get_activation("swiglu")
  b = mosaic_backend
  x, rw, w1, w2, d_out = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg, b.ROW_TILE))(x, rw)
  row_scores = jnp.where(layout.row_valid(), 0.5, 0.0).astype(jnp.float32)
  default = sonic_jax.Config()
  h, a = jax.jit(lambda x, w1: b.up_projection(x, w1, None, layout, act, "concat",
                                               config=default))(x, w1)
  d_h, a_s, _, _ = jax.jit(lambda g, h, s, w2: b.dh_projection(
      g, h, s, w2, None, layout, act, "concat", config=default))(d_out, h, row_scores, w2)
  # Rows past the tiles in use are left unwritten: outputs are compared on the rows in use only.
  used = int(layout.num_tiles) * b.ROW_TILE
  rows_in_use = lambda v: v[:used] if v.ndim and v.shape[0] == layout.num_rows else v
  roles = {
      "up": (lambda x, w1, config: b.up_projection(x, w1, None, layout, act, "concat",
                                                   config=config), (x, w1), 2 * n),
      "down": (lambda a, w2, config: b.down_projection(a, w2, None, layout, config=config),
               (a, w2), n),
      "dh": (lambda g, h, s, w2, config: b.dh_projection(g, h, s, w2, None, layout, act, "concat",
                                                         config=config),
             (d_out, h, row_scores, w2), n),
      "dx": (lambda g, w1, config: b.dx_projection(g, w1, layout, config=config), (d_h, w1), 2 * n),
      "weight_grad": (lambda x, g, dh, a_s, s, config: b.weight_grads(
          x, g, None, dh, a_s, s, layout, False, False, config=config)[:2],
          (x, d_out, d_h, a_s, row_scores), n),
  }
  return roles, rows_in_use


def _compiled(fn, args, entry):
  """(compiled fn, its outputs) under a table of the one entry."""
  config = sonic_jax.Config(tuning=tuning.TuningTable.from_entries([entry]))
  compiled = timing.compile_fn(lambda *a: fn(*a, config), *args)[0]
  return compiled, jax.block_until_ready(compiled(*args))


def _same(got, want, reduced=False):
  """Bit for bit; `reduced`: to 1e-5 of its scale (dH's dS)."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if reduced:
    return bool(np.allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max()))
  return bool(np.array_equal(got, want, equal_nan=True))


def tune_role(cfg, role, fn, args, n_key, device, rows_in_use, base):
  """(the winning entry with its time and starting point, every trial)."""
  _, d, _, e, _ = cfg
  entry = lambda fields: {"role": role, "device": device, "d": d, "n": n_key, "E": e,
                          "config": fields}
  best_fields = {}
  if FLAGS.fields:  # the base table's entry for exactly this problem, if any
    target = tuning.Entry.from_dict(entry({}))
    best_fields = next((dict(x.fields) for x in base.entries if x.same_problem(target)), {})
  best, want = _compiled(fn, args, entry(best_fields))
  best_t = timing.time_interleaved({"": (best, args)}, repeats=FLAGS.repeats)[""][0]
  trials = [{"config": best_fields, "ms": best_t * 1e3}]
  for field, values in SEARCH[role]:
    names = field if isinstance(field, tuple) else (field,)
    if FLAGS.fields and not set(names) & set(FLAGS.fields):
      continue
    for value in values:
      fields = {**best_fields, **dict(zip(names, value if isinstance(field, tuple) else (value,)))}
      try:
        candidate, got = _compiled(fn, args, entry(fields))
      except Exception as err:  # a candidate that does not compile (e.g. shared memory) is skipped
        trials.append({"config": fields, "error": f"{type(err).__name__}: {str(err)[:200]}"})
        continue
      same = all(_same(rows_in_use(u), rows_in_use(v), role == "dh" and i == _DH_DS_LEAF)
                 for i, (u, v) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))))
      times = timing.time_interleaved({"incumbent": (best, args), "candidate": (candidate, args)},
                                      repeats=FLAGS.repeats)
      t, t_incumbent = times["candidate"][0], times["incumbent"][0]
      trials.append({"config": fields, "ms": t * 1e3, "incumbent_ms": t_incumbent * 1e3,
                     "same_outputs": same})
      print(f"  {role} {fields}: {t * 1e3:.3f} ms against {t_incumbent * 1e3:.3f}"
            f"{'' if same else ' (outputs differ: discarded)'}", flush=True)
      if same and t < t_incumbent * (1 - FLAGS.min_gain):
        best, best_t, best_fields = candidate, t, fields
  start = trials[0]
  print(f"{grid.config_name(cfg)} {role}: {best_fields or 'defaults'} {best_t * 1e3:.3f} ms "
        f"(start: {start['config'] or 'defaults'} {start['ms']:.3f} ms)", flush=True)
  return entry(best_fields) | {"ms": best_t * 1e3, "start": start["config"],
                               "start_ms": start["ms"]}, trials


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, grid.PAPER_GRID)
  with open(FLAGS.base or tuning.PACKAGED) as f:
    base_entries = json.load(f)["entries"]
  base = tuning.TuningTable.from_entries(base_entries)
  base_dicts = dict(zip(map(id, base.entries), base_entries))  # written back as they are
  out = grid.run_record("autotune", entries=[], trials=[])
  out["date"] = out["date"][:10]
  provenance = {"date": out["date"], "command": out["command"]}
  os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
  measured = []
  with grid.interpret_mode(FLAGS.interpret):
    device = tuning.target_device().device_kind
    for cfg in configs:
      roles, rows_in_use = _problem(cfg)
      for role, (fn, args, n_key) in roles.items():
        if FLAGS.roles and role not in FLAGS.roles:
          continue
        entry, trials = tune_role(cfg, role, fn, args, n_key, device, rows_in_use, base)
        measured.append(entry | provenance)
        new = tuning.TuningTable.from_entries(measured)
        table = base.merged(new) if FLAGS.merge else new
        written = base_dicts | {id(e): m for e, m in zip(new.entries, measured)}
        out["entries"] = [written[id(e)] for e in table.entries]
        out["trials"].append({"config": list(cfg), "role": role, "trials": trials})
        with open(FLAGS.out, "w") as f:
          json.dump(out, f, indent=1)
  print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
