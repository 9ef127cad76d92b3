r"""Up-projection variants on the GPU: the fused cp.async gather against the contiguous operand, with
the tuning knobs of `GroupedGemmConfig` (memory-warpgroup registers, ring depth) on top of the
layer's configuration for the problem (the tuning table's).

  python -m benchmarks.gather_variants [--thiek=T,d,n,E,K ...] [--out=dir] [--variants=NAME ...]

Also the same weights in the interleaved gate/up layout (its two 128-column B blocks adjacent,
concat's n columns apart; both layouts issue two N = 128 wgmmas a step, and differ in their
epilogues). And two probes of where the gather's cost comes from: the cp.async kernel gathering
the pre-gathered rows in order (the contiguous kernel's addresses, so only the copy mechanism
differs) and gathering from an L2-resident slice of x (its A differs: marked WRONG). Every
variant's A is checked bit for bit against the first variant's; then the variants are timed in
interleaved rounds (`timing.measure_variants`).
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
from sonic_jax.mosaic_gpu import up_projection as up

grid.define_variant_flags()
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(40960, 768, 256, 128, 8), (24576, 1536, 512, 64, 4),
                   (32768, 4096, 256, 256, 16)]

VARIANTS = {  # name: (gathered?, GroupedGemmConfig overrides, plus the gate/up layout)
    "contiguous": (False, {}),
    "cp_async, table config": (True, {}),
    "cp_async, interleaved w1": (True, {"gate_up_layout": "interleaved"}),
    "sigmoid by division": (True, {"activation": "sigmoid_by_division"}),
    "sigmoid by division, interleaved w1": (True, {"activation": "sigmoid_by_division",
                                                   "gate_up_layout": "interleaved"}),
    "pingpong": (True, {"schedule": "pingpong", "num_stages": 5, "cluster_m": 1}),
    "pingpong, 4 stages": (True, {"schedule": "pingpong", "num_stages": 4, "cluster_m": 1}),
    "pingpong, 3 stages": (True, {"schedule": "pingpong", "num_stages": 3, "cluster_m": 1}),
    "pingpong, 6 stages, 1 buffer": (True, {"schedule": "pingpong", "num_stages": 6,
                                            "epilogue_buffers": 1, "cluster_m": 1}),
    "pingpong, cluster 2": (True, {"schedule": "pingpong", "num_stages": 5, "cluster_m": 2}),
    "pingpong, interleaved w1": (True, {"schedule": "pingpong", "num_stages": 5, "cluster_m": 1,
                                        "gate_up_layout": "interleaved"}),

    "contiguous, memory regs 80": (False, {"memory_registers": 80}),
    "cp_async": (True, {"gather_impl": "cp_async"}),
    "cp_async, memory regs 56": (True, {"gather_impl": "cp_async", "memory_registers": 56}),
    "cp_async, memory regs 40": (True, {"gather_impl": "cp_async", "memory_registers": 40}),
    "cp_async, 3 stages": (True, {"gather_impl": "cp_async", "num_stages": 3}),
    # Where the gather's cost comes from: the same cp.async kernel reading the pre-gathered rows
    # in order (row r of the grouped buffer: the contiguous kernel's addresses), or gathering
    # from the first L2_RESIDENT_ROWS rows of x only (every source row in L2; A differs).
    "cp_async, identity rows": (True, {"source": "identity"}),
    "cp_async, L2-resident rows": (True, {"source": "l2_resident"}),
}

L2_RESIDENT_ROWS = 2048  # 16 MiB of x at d = 4096, a third of an H100's L2


def run_config(cfg):
  _, d, n, e, k = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, _, _ = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  x_rows = jax.jit(lambda x, lay: x[lay.row_token])(x, layout)
  rows = int(layout.num_tiles) * 128
  flops = 2 * rows * d * 2 * n
  valid = np.asarray(layout.row_valid())
  # The same weights in the interleaved layout: column 2i the gate of unit i, 2i + 1 its up.
  w1_interleaved = jax.jit(lambda w: w.reshape(e, d, 2, n).swapaxes(2, 3).reshape(e, d, 2 * n))(w1)
  variants = {}
  for name, (gathered, overrides) in VARIANTS.items():
    if FLAGS.variants and name not in FLAGS.variants:
      continue
    overrides = dict(overrides)
    gate_up = overrides.pop("gate_up_layout", "concat")
    source, lay = overrides.pop("source", None), layout
    src = x if gathered else x_rows
    if source == "identity":
      src = x_rows
      lay = layout._replace(row_token=jnp.arange(layout.num_rows, dtype=jnp.int32))
    elif source == "l2_resident":
      lay = layout._replace(row_token=layout.row_token % L2_RESIDENT_ROWS)
    variant_act = grid.variant_activation(overrides, act)
    table = mosaic_backend.up_config(d, 2 * n, e).gemm  # the layer's configuration
    config = up.UpProjectionConfig(dataclasses.replace(table, **overrides))
    fn = lambda src, w1, lay, config=config, gathered=gathered, gate_up=gate_up, a=variant_act: (
        up.up_projection(src, w1, None, lay, a, gate_up, config=config, gather=gathered))
    weights = w1 if gate_up == "concat" else w1_interleaved
    variants[name] = (fn, (src, weights, lay))
  # A is compared (the interleaved layout's H holds the same values in another column order).
  out = timing.measure_variants(variants, lambda o: (np.asarray(o[1], np.float32)[valid],),
                                flops, FLAGS.repeats, FLAGS.cool_calls)
  return {"config": list(cfg), "variants": out}


def main(_):
  grid.print_variant_table(grid.run_variant_configs(run_config, FLAGS.thiek, DEFAULT_CONFIGS,
                                                    FLAGS.out, "gather_variants.json"))


if __name__ == "__main__":
  app.run(main)
