r"""Down-projection variants on the GPU: the layer's configuration (the tuning table's) against
128-column tiles (`DownProjectionConfig.block_n`: half the B block per stage, and a warpgroup's two
staging buffers hold its whole output, so a tile's Y stores drain under the next tile's mainloop
instead of waiting for each other) at several ring depths.

  python -m benchmarks.down_variants [--thiek=T,d,n,E,K ...] [--out=dir] [--variants=NAME ...]

Every variant's Y is checked bit for bit against the first variant's on the rows in use; then the
variants are timed in interleaved rounds (`timing.measure_variants`).
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import down_projection as down

grid.define_variant_flags()
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(40960, 768, 256, 128, 8), (24576, 1536, 512, 64, 4),
                   (32768, 4096, 256, 256, 16)]

VARIANTS = {  # name: (DownProjectionConfig.block_n, GroupedGemmConfig overrides)
    "table config": (256, {}),
    "128 cols": (128, {}),
    "128 cols, 5 stages": (128, {"num_stages": 5}),
    "128 cols, 6 stages": (128, {"num_stages": 6}),
    "128 cols, 3 buffers": (128, {"epilogue_buffers": 3}),
    "128 cols, cluster 2": (128, {"cluster_m": 2}),
    "pingpong, 2 stages": (128, {"schedule": "pingpong", "num_stages": 2, "cluster_m": 1}),
    "pingpong, 4 stages": (128, {"schedule": "pingpong", "num_stages": 4, "cluster_m": 1}),
    "pingpong, 5 stages": (128, {"schedule": "pingpong", "num_stages": 5, "cluster_m": 1}),
    "pingpong, 6 stages, 1 buffer": (128, {"schedule": "pingpong", "num_stages": 6,
                                           "epilogue_buffers": 1, "cluster_m": 1}),
    "pingpong, 5 stages, cluster 2": (128, {"schedule": "pingpong", "num_stages": 5,
                                            "cluster_m": 2}),
}


def run_config(cfg):
  _, d, n, e, _ = cfg
  x, rw, _, w2, _ = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  a = jax.random.normal(jax.random.key(1), (layout.num_rows, n), jnp.bfloat16)
  rows = int(layout.num_tiles) * 128
  flops = 2 * rows * n * d
  table = mosaic_backend.down_config(d, n, e).gemm  # the layer's configuration
  variants = {}
  for name, (block_n, overrides) in VARIANTS.items():
    if FLAGS.variants and name not in FLAGS.variants:
      continue
    config = down.DownProjectionConfig(dataclasses.replace(table, **overrides), block_n)
    fn = lambda a, w2, lay, config=config: down.down_projection(a, w2, None, lay, config=config)
    variants[name] = (fn, (a, w2, layout))
  out = timing.measure_variants(variants, lambda o: (np.asarray(o, np.float32)[:rows],), flops,
                                FLAGS.repeats, FLAGS.cool_calls)
  return {"config": list(cfg), "variants": out}


def main(_):
  grid.print_variant_table(grid.run_variant_configs(run_config, FLAGS.thiek, DEFAULT_CONFIGS,
                                                    FLAGS.out, "down_variants.json"))


if __name__ == "__main__":
  app.run(main)
