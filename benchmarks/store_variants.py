r"""How the GEMM roles' epilogues write their outputs: TMA stores against plain (LSU) global stores,
and SMs whose epilogues are staggered against each other.

  python -m benchmarks.store_variants [--thiek=T,d,n,E,K ...] [--out=dir]

Every role that writes through `epilogue.store_tiles` (up-projection, down-projection, dX and the
256-column dH) runs with the layer's tuned configuration ("tma") and with the same configuration
but `store_path="lsu"`; the up- and down-projection also with a 3-stage ring and a staging buffer
for every piece of the tile ("tma deferred": no store waits inside a tile, the stores drain under
the next tile's mainloop, off by default: --deferred); and with every other SM starting late by a
fraction of a tile's mainloop time (`stagger_ns`, --stagger_fractions; the time estimated at
5.3 TFLOP/s per SM), so that half of the SMs store while the other half compute. Each variant's outputs on the rows in use are checked bit for bit
against the first variant's; then the variants of a role are timed in interleaved rounds
(`timing.time_interleaved`). Writes store_variants.json under --out.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing
from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import dh_projection as dh
from sonic_jax.mosaic_gpu import down_projection as down
from sonic_jax.mosaic_gpu import dx_projection as dx
from sonic_jax.mosaic_gpu import up_projection as up

grid.define_variant_flags()
flags.DEFINE_bool("deferred", False, "add the 3-stage ring with a buffer per piece")
flags.DEFINE_list("stagger_fractions", ["0.25"], "stagger_ns as fractions of a tile's mainloop")
flags.DEFINE_list("stagger_groups", ["2"], "stagger_groups values (each with every fraction)")
flags.DEFINE_bool("lsu", True, "add store_path='lsu'")
flags.DEFINE_integer("baseline_twice", 0, "time the tma baseline again at the end (noise)")
FLAGS = flags.FLAGS
SM_FLOPS_PER_NS = 5300.0  # about 700 TFLOP/s over 132 SMs

DEFAULT_CONFIGS = [(40960, 768, 256, 128, 8), (24576, 1536, 512, 64, 4),
                   (32768, 4096, 1024, 128, 8)]


def _variants(gemm, deferred_buffers, tile_flops):
  out = {"tma": gemm}
  if FLAGS.lsu:
    out["lsu"] = dataclasses.replace(gemm, store_path="lsu")
  if deferred_buffers and FLAGS.deferred:
    out["tma deferred"] = dataclasses.replace(gemm, num_stages=3,
                                              epilogue_buffers=deferred_buffers)
  for groups in map(int, FLAGS.stagger_groups):
    for frac in map(float, FLAGS.stagger_fractions):
      ns = int(frac * tile_flops / SM_FLOPS_PER_NS)
      out[f"tma, stagger {groups} x {ns} ns"] = dataclasses.replace(
          gemm, stagger_ns=ns, stagger_groups=groups)
  if FLAGS.baseline_twice:
    out["tma again"] = gemm
  return out


def run_config(cfg):
  _, d, n, e, _ = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, d_out = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  used = int(layout.num_tiles) * 128
  h, a = jax.jit(lambda x, w1: mosaic_backend.up_projection(x, w1, None, layout, act,
                                                            "concat"))(x, w1)
  scores = jnp.where(layout.row_valid(), 0.5, 0.0).astype(jnp.float32)
  d_out_rows = jax.jit(lambda g: g[layout.row_token])(d_out)
  compared = lambda o: tuple(np.asarray(v[:used], np.float32) for v in
                             (o if isinstance(o, (tuple, list)) else (o,))[:2])
  up_cfg, down_cfg = mosaic_backend.up_config(d, 2 * n, e), mosaic_backend.down_config(d, n, e)
  dx_cfg, dh_cfg = mosaic_backend.dx_config(d, 2 * n, e), mosaic_backend.dh_config(d, n, e)
  # Pieces per warpgroup and tile: up 2 x 128 H columns + 128 A columns, down 256 Y columns.
  roles = {
      "up (gather)": (lambda g: lambda x, w1: up.up_projection(
          x, w1, None, layout, act, "concat", config=dataclasses.replace(up_cfg, gemm=g)),
          (x, w1), _variants(up_cfg.gemm, 5, 2 * 128 * 256 * d), 2 * used * d * 2 * n),
      "down": (lambda g: lambda a, w2: down.down_projection(
          a, w2, None, layout, config=dataclasses.replace(down_cfg, gemm=g)),
          (a, w2), _variants(down_cfg.gemm, 4, 2 * 128 * 256 * n), 2 * used * n * d),
      "dX": (lambda g: lambda dh_, w1: dx.dx_projection(
          dh_, w1, layout, config=dataclasses.replace(dx_cfg, gemm=g)),
          (h, w1), _variants(dx_cfg.gemm, 0, 2 * 128 * 256 * 2 * n), 2 * used * 2 * n * d),
  }
  if dh_cfg.block_n == dh.WIDE_BLOCK_N:  # the tile whose epilogue stores through store_tiles
    roles["dH (contiguous dO rows)"] = (lambda g: lambda rows, h, s, w2: dh.dh_projection(
        rows, h, s, w2, layout, act, config=dataclasses.replace(dh_cfg, gemm=g)),
        (d_out_rows, h, scores, w2), _variants(dh_cfg.gemm, 0, 2 * 128 * 256 * d), 2 * used * d * n)
  out = {}
  for role, (make, args, variants, flops) in roles.items():
    records, calls = timing.check_variants(
        {name: (make(gemm), args) for name, gemm in variants.items()}, compared)
    for name, (t, samples) in timing.time_interleaved(calls, repeats=FLAGS.repeats).items():
      records[name].update(ms=t * 1e3, tflops=flops / t / 1e12,
                           samples_ms=[v * 1e3 for v in samples])
    for name, record in records.items():
      out[f"{role}: {name}"] = record
      print(cfg, role, name, record.get("ms", record.get("error")), flush=True)
  return {"config": list(cfg), "variants": out}


def main(_):
  results = grid.run_variant_configs(run_config, FLAGS.thiek, DEFAULT_CONFIGS, FLAGS.out,
                                     "store_variants.json")
  for r in results["configs"]:
    print(",".join(map(str, r["config"])))
    for name, v in r["variants"].items():
      cell = (f"{v['ms']:.3f} ms {v['tflops']:.0f} TF/s{'' if v['exact'] else ' (DIFFERS)'}"
              if "ms" in v else v["error"][:100])
      print(f"  {name:34s} {cell}")


if __name__ == "__main__":
  app.run(main)
