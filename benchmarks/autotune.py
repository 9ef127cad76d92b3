r"""Autotuning: measures the kernel configurations the `mosaic_gpu` backend may run and writes the
table that `sonic_jax.mosaic_gpu.tuning` reads.

  python -m benchmarks.autotune [--thiek=T,d,n,E,K ...] [--out=dir] [--nomerge]
  # then: SONIC_JAX_TUNED_CONFIGS=dir/tuned_configs.json, or copy it over the packaged
  # sonic_jax/mosaic_gpu/tuned_configs.json to ship it

The table written holds this run's entries plus the current table's (the packaged one, or
SONIC_JAX_TUNED_CONFIGS) for the problems this run does not measure; --nomerge: this run's only.

Per configuration and role (up, down, dh, dx on the grouped-GEMM core, the weight gradients on the
varlen-K kernel), through the backend's own entry points (so with its gather policy), a coordinate
search from the defaults: 2-CTA clusters (`cluster_m`; `cluster` for the weight gradients), the
tile walk (`grid_band` and the band's width `grid_tile_width`), then the ring depth (`num_stages`,
for up and down together with the epilogue's staging buffers), then for roles that gather rows
the memory warpgroup's registers, and for dH how its wide tile reads H (`wide_h_loads`) and the
pingpong schedule (`schedule`, with 128-column blocks); `--fields=...` searches only those
fields, starting from the problem's current entry.
Each candidate is timed against the incumbent in alternating rounds (`timing.time_interleaved`: the
H100's clocks drift by more than the gains sought) and replaces it only when at least `--min_gain`
faster (timing noise must not churn the table); every candidate's outputs must equal the starting
configuration's bit for bit (dH's dS, a float32 sum over the tile's column blocks, to 1e-5 of its
scale: the tile width sets how many partials it adds), or it is discarded. Needs a GPU.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing
from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import tuning

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable; default: the grid)")
flags.DEFINE_string("out", "bench_out", "output folder (tuned_configs.json)")
flags.DEFINE_integer("repeats", 5, "timed samples per candidate")
flags.DEFINE_bool("merge", True, "write the current table's entries that this run does not "
                  "re-measure too (else only this run's)")
flags.DEFINE_list("roles", None, "roles to tune (default: all of up, down, dh, dx, weight_grad)")
flags.DEFINE_list("fields", None, "search only these configuration fields, starting from the "
                  "current table's entry for the problem (default: every field of SEARCH, "
                  "starting from the defaults)")
flags.DEFINE_float("min_gain", 0.02, "relative speed-up a candidate needs to replace the incumbent")
FLAGS = flags.FLAGS

# A shallower ring leaves SMEM for more epilogue buffers: tried together.
_RING_FOR_EPILOGUE = (("num_stages", "epilogue_buffers"), ((3, 2), (3, 3), (3, 4), (4, 2)))
_CLUSTER = ("cluster_m", (2,))  # 1: the default
# The tile walk: bands of column blocks over every row tile ("n", the default), or bands of row
# tiles across every column block ("m": fewer DRAM bytes at d = 4096, twenty-sixth session).
_WALK = (("grid_band", "grid_tile_width"),
         (("n", 1), ("n", 2), ("n", 4), ("n", 8), ("m", 2), ("m", 4), ("m", 8)))
SEARCH = {  # role: [(field or fields, candidate values)], searched one step at a time
    "up": [_CLUSTER, _WALK, _RING_FOR_EPILOGUE,
           ("memory_registers", (40, 56, 80))],
    "down": [_CLUSTER, _WALK, _RING_FOR_EPILOGUE,
             # 128-column tiles: a stage of two thirds the bytes, so a deeper ring fits.
             (("block_n", "num_stages"), ((128, 4), (128, 6)))],
    "dh": [_CLUSTER, _WALK, ("num_stages", (3, 4)),
           ("memory_registers", (40, 56, 80)), ("wide_h_loads", ("staged", "registers")),
           # Pingpong: 128 x 128 tiles a warpgroup, one's epilogue under the other's mainloop.
           (("schedule", "block_n", "cluster_m", "num_stages"),
            (("pingpong", 128, 1, 4), ("pingpong", 128, 1, 6)))],
    "dx": [_CLUSTER, _WALK, ("num_stages", (3, 4))],
    "weight_grad": [("cluster", (2,)), ("num_stages", (3, 4)), ("indices_before_wait", (False,))],
}


def _problem(cfg):
  _, _, n, e, k = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, d_out = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg, mosaic_backend.ROW_TILE))(x, rw)
  row_scores = jnp.where(layout.row_valid(), 0.5, 0.0).astype(jnp.float32)
  b = mosaic_backend
  h, a = jax.jit(lambda x, w1: b.up_projection(x, w1, None, layout, act, "concat"))(x, w1)
  d_h, a_s, _, d_out_rows = jax.jit(lambda g, h, s, w2: b.dh_projection(
      g, h, s, w2, None, layout, act, "concat"))(d_out, h, row_scores, w2)
  # Rows of tiles past the ones in use are left unwritten (whatever the buffer held): outputs are
  # compared on the rows in use only.
  used = int(layout.num_tiles) * mosaic_backend.ROW_TILE
  rows_in_use = lambda x: x[:used] if x.ndim and x.shape[0] == layout.num_rows else x
  roles = {  # role: (fn, args, the table's (d, n) of the problem)
      "up": (lambda x, w1: b.up_projection(x, w1, None, layout, act, "concat"), (x, w1), 2 * n),
      "down": (lambda a, w2: b.down_projection(a, w2, None, layout), (a, w2), n),
      "dh": (lambda g, h, s, w2: b.dh_projection(g, h, s, w2, None, layout, act, "concat"),
             (d_out, h, row_scores, w2), n),
      "dx": (lambda g, w1: b.dx_projection(g, w1, layout), (d_h, w1), 2 * n),
      # dw2 reads the dO rows that dH handed over (None: it gathers them), as in the layer.
      "weight_grad": (lambda x, g, g_rows, dh, a_s, s: b.weight_grads(
          x, g, g_rows, dh, a_s, s, layout, False, False)[:2],
          (x, d_out, d_out_rows, d_h, a_s, row_scores), n),
  }
  return roles, rows_in_use


def _compiled(fn, args, entries):
  """(compiled fn, its outputs) with the table set to `entries` (a fresh trace)."""
  tuning.set_table(entries)
  try:
    compiled = timing.compile_fn(lambda *a: fn(*a), *args)[0]
    return compiled, jax.block_until_ready(compiled(*args))
  finally:
    tuning.set_table(None)


_DH_DS_LEAF = 2  # backend.dh_projection returns (dH, A_s, dS, dO rows or None)


def _same(got, want, reduced=False):
  """Bit for bit; `reduced`: dH's dS, a float32 sum over column blocks whose count follows the
  tile width (`block_n`), so its rounding may move in the last bits (relative 1e-5)."""
  if reduced:
    return bool(np.allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(want).max()))
  return bool(np.array_equal(got, want, equal_nan=True))


def tune_role(cfg, role, fn, args, n_key, device, rows_in_use):
  _, d, _, e, _ = cfg
  entry = lambda fields: [{"role": role, "device": device, "d": d, "n": n_key, "E": e,
                           "config": fields}]
  best_fields = {}
  if FLAGS.fields:  # the current table's entry for exactly this problem, if any
    best_fields = next((dict(x["config"]) for x in tuning.table()
                        if tuning.same_problem(x, entry({})[0])), {})
  best, want = _compiled(fn, args, entry(best_fields))
  best_t = timing.time_interleaved({"": (best, args)}, repeats=FLAGS.repeats)[""][0]
  trials = [{"config": best_fields, "ms": best_t * 1e3}]
  for field, values in SEARCH[role]:
    names = field if isinstance(field, tuple) else (field,)
    if FLAGS.fields and not set(names) & set(FLAGS.fields):
      continue
    for value in values:
      step = dict(zip(field, value)) if isinstance(field, tuple) else {field: value}
      fields = {**best_fields, **step}
      try:
        candidate, got = _compiled(fn, args, entry(fields))
      except Exception as err:  # a candidate that does not compile (e.g. shared memory) is skipped
        trials.append({"config": fields, "error": f"{type(err).__name__}: {str(err)[:200]}"})
        continue
      same = all(_same(np.asarray(rows_in_use(u), np.float32),
                       np.asarray(rows_in_use(v), np.float32), reduced=role == "dh" and i == _DH_DS_LEAF)
                 for i, (u, v) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))))
      # Against the incumbent in alternating rounds: the clocks drift by more than min_gain.
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
  return entry(best_fields)[0] | {"ms": best_t * 1e3, "start": start["config"],
                                  "start_ms": start["ms"]}, trials


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, grid.PAPER_GRID)
  device = jax.devices()[0].device_kind
  out = {"device": device, "jax": jax.__version__,
         "command": "python -m benchmarks.autotune " + " ".join(sys.argv[1:]),
         "entries": [], "trials": []}
  os.makedirs(FLAGS.out, exist_ok=True)
  base = list(tuning.table()) if FLAGS.merge else []
  measured = []
  for cfg in configs:
    roles, rows_in_use = _problem(cfg)
    for role, (fn, args, n_key) in roles.items():
      if FLAGS.roles and role not in FLAGS.roles:
        continue
      entry, trials = tune_role(cfg, role, fn, args, n_key, device, rows_in_use)
      measured.append(entry)
      out["entries"] = tuning.merged(base, measured)
      out["trials"].append({"config": list(cfg), "role": role, "trials": trials})
      with open(os.path.join(FLAGS.out, "tuned_configs.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
  app.run(main)
