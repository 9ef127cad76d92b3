r"""dH kernel variants on the GPU: the 256-column tile (H streamed from GMEM in the epilogue) against
the 128-column tile (H TMA-prefetched into SMEM during the mainloop), on contiguous and gathered dO
rows (`DhProjectionConfig.block_n`; `default_block_n` picks between them).

  python -m benchmarks.dh_variants [--thiek=T,d,n,E,K ...] [--out=dir]

Every variant's dH and A_s are checked bit for bit against the first variant's before timing.
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

grid.define_variant_flags()
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(32768, 4096, 2048, 64, 4), (32768, 4096, 1024, 128, 8),
                   (32768, 4096, 512, 128, 8)]

VARIANTS = {  # name: DhProjectionConfig overrides
    "256 cols, streamed H": {"block_n": 256},
    "128 cols, prefetched H": {"block_n": 128},
}


def run_config(cfg):
  _, d, n, e, _ = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, d_out = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  h, _ = jax.jit(lambda x, w1: mosaic_backend.up_projection(x, w1, None, layout, act,
                                                            "concat"))(x, w1)
  scores = jnp.where(layout.row_valid(), 0.5, 0.0).astype(jnp.float32)
  d_out_rows = jax.jit(lambda g: g[layout.row_token])(d_out)
  used = int(layout.num_tiles) * 128
  flops = 2 * used * d * n
  base = mosaic_backend.dh_config(d, n, e)
  # dH and A_s on the rows in use (the dS partials' shape depends on the tile width)
  compared = lambda o: tuple(np.asarray(v[:used], np.float32) for v in o[:2])
  out = {}
  for gathered in (False, True):
    want = None
    for name, overrides in VARIANTS.items():
      label = f"{name}, {'gathered' if gathered else 'contiguous'}"
      config = dataclasses.replace(base, **overrides)
      fn = lambda g, h, s, w2, config=config, gathered=gathered: dh.dh_projection(
          g, h, s, w2, layout, act, config=config, gather=gathered)
      args = (d_out if gathered else d_out_rows, h, scores, w2)
      out[label], want = timing.measure_variant(fn, args, compared, want, flops, FLAGS.repeats)
      print(cfg, label, out[label], flush=True)
  return {"config": list(cfg), "variants": out}


def main(_):
  results = grid.run_variant_configs(run_config, FLAGS.thiek, DEFAULT_CONFIGS, FLAGS.out,
                                     "dh_variants.json")
  names = list(results["configs"][0]["variants"])
  for r in results["configs"]:
    print(",".join(map(str, r["config"])))
    for name in names:
      v = r["variants"][name]
      cell = (f"{v['ms']:.3f} ms {v['tflops']:.0f} TF/s{'' if v['exact'] else ' (DIFFERS)'}"
              if "ms" in v else v["error"][:100])
      print(f"  {name:40s} {cell}")


if __name__ == "__main__":
  app.run(main)
