r"""Down-projection variants on the GPU: the layer's configuration (the tuning table's) against
128-column tiles (`DownProjectionConfig.block_n`: half the B block per stage, and a warpgroup's two
staging buffers hold its whole output, so a tile's Y stores drain under the next tile's mainloop
instead of waiting for each other) at several ring depths.

  python -m benchmarks.down_variants [--thiek=T,d,n,E,K ...] [--out=dir] [--variants=NAME ...]

Every variant's Y is checked bit for bit against the first variant's on the rows in use; then the
variants are timed in interleaved rounds (`timing.measure_variants`). The "probe" variants run the
table's configuration with a lighter epilogue (their Y is WRONG by design: timing only): "no
stores" (the accumulators are read, nothing is stored: the mainloop, the tile walk and the
per-tile drain alone) and "one piece" (one 64-column piece of a warpgroup's output stored).
A variant named with " (wait for all first)" appended (asked for by --variants only) runs with
`store_tiles(..., wait_all_first=True)`, the store rule before the twenty-first session.
"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import down_projection as down
from sonic_jax.mosaic_gpu import epilogue as epi

grid.define_variant_flags()
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(40960, 768, 256, 128, 8), (24576, 1536, 512, 64, 4),
                   (32768, 4096, 256, 256, 16)]

# name: (DownProjectionConfig.block_n (None: the table's), GroupedGemmConfig overrides)
VARIANTS = {
    "table config": (None, {}),
    "128 cols": (128, {}),
    "128 cols, 5 stages": (128, {"num_stages": 5}),
    "128 cols, 6 stages": (128, {"num_stages": 6}),
    "128 cols, 3 buffers": (128, {"epilogue_buffers": 3}),
    "128 cols, cluster 2": (128, {"cluster_m": 2}),
    "128 cols, 6 stages, cluster 2": (128, {"num_stages": 6, "cluster_m": 2}),
    # 256-column tiles (wgmma N = 256: the fewest shared-memory operand bytes per FLOP).
    "256 cols, 4 stages": (256, {"num_stages": 4, "cluster_m": 1}),
    "256 cols, 4 stages, band 8": (256, {"num_stages": 4, "cluster_m": 1, "grid_tile_width": 8}),
    "256 cols, 4 stages, cluster 2": (256, {"num_stages": 4, "cluster_m": 2}),
    "256 cols, 3 stages, cluster 2": (256, {"num_stages": 3, "cluster_m": 2}),
    "256 cols, 4 stages, cluster 2, band 8": (256, {"num_stages": 4, "cluster_m": 2,
                                                    "grid_tile_width": 8}),
    # A buffer for each of a warpgroup's pieces: a tile's stores drain under the next mainloop.
    "256 cols, 3 stages, 4 buffers": (256, {"num_stages": 3, "epilogue_buffers": 4}),
    "128 cols, 5 stages, 4 buffers": (128, {"num_stages": 5, "epilogue_buffers": 4}),
    "pingpong, 2 stages": (128, {"schedule": "pingpong", "num_stages": 2, "cluster_m": 1}),
    "pingpong, 4 stages": (128, {"schedule": "pingpong", "num_stages": 4, "cluster_m": 1}),
    "pingpong, 5 stages": (128, {"schedule": "pingpong", "num_stages": 5, "cluster_m": 1}),
    "pingpong, 6 stages, 1 buffer": (128, {"schedule": "pingpong", "num_stages": 6,
                                           "epilogue_buffers": 1, "cluster_m": 1}),
    "pingpong, 5 stages, cluster 2": (128, {"schedule": "pingpong", "num_stages": 5,
                                            "cluster_m": 2}),
}


_store_tiles = epi.store_tiles  # the real one, while a probe patches it


def _no_stores(stores, staging, transposed=False):
  del stores, staging, transposed


def _one_piece(stores, staging, transposed=False):
  (value, dst), = stores[:1]
  _store_tiles([(value[:, :epi.STORE_COLS], dst.at[:, :epi.STORE_COLS])], staging, transposed)


_wait_all_first = functools.partial(_store_tiles, wait_all_first=True)


PROBES = {"probe: no stores": _no_stores, "probe: one piece": _one_piece}
# The variants again with the store rule of before the twenty-first session: each tile's epilogue
# first waits until every earlier store has read its buffer (outputs equal: timing the rule).
WAIT_ALL_FIRST = " (wait for all first)"


def _patched(store, config):
  """The down-projection with `store` in place of `epilogue.store_tiles` while it is traced."""
  def fn(a, w2, lay):
    with mock.patch.object(epi, "store_tiles", store):
      return down.down_projection(a, w2, None, lay, config=config)
  return fn


def run_config(cfg):
  _, d, n, e, _ = cfg
  x, rw, _, w2, _ = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  a = jax.random.normal(jax.random.key(1), (layout.num_rows, n), jnp.bfloat16)
  rows = int(layout.num_tiles) * 128
  flops = 2 * rows * n * d
  table_config = mosaic_backend.down_config(d, n, e)  # the layer's configuration
  table = table_config.gemm
  variants = {}
  for name, (block_n, overrides) in VARIANTS.items():
    if FLAGS.variants and name not in FLAGS.variants:
      continue
    config = down.DownProjectionConfig(dataclasses.replace(table, **overrides),
                                       block_n or table_config.block_n)
    fn = lambda a, w2, lay, config=config: down.down_projection(a, w2, None, lay, config=config)
    variants[name] = (fn, (a, w2, layout))
    if FLAGS.variants and name + WAIT_ALL_FIRST in FLAGS.variants:
      variants[name + WAIT_ALL_FIRST] = (_patched(_wait_all_first, config), (a, w2, layout))
  for name, store in PROBES.items():
    if FLAGS.variants and name not in FLAGS.variants:
      continue
    variants[name] = (_patched(store, table_config), (a, w2, layout))
  out = timing.measure_variants(variants, lambda o: (np.asarray(o, np.float32)[:rows],), flops,
                                FLAGS.repeats, FLAGS.cool_calls)
  return {"config": list(cfg), "variants": out}


def main(_):
  grid.print_variant_table(grid.run_variant_configs(run_config, FLAGS.thiek, DEFAULT_CONFIGS,
                                                    FLAGS.out, "down_variants.json"))


if __name__ == "__main__":
  app.run(main)
