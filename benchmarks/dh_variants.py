r"""dH kernel variants on the GPU: the 256-column tile (H staged through SMEM a piece at a time, or
loaded from GMEM into registers, in the epilogue) against the 128-column tile (H TMA-prefetched into
SMEM during the mainloop), with and without 2-CTA clusters, and the pingpong schedule (each
compute warpgroup a whole 128 x 128 tile in turn, H in registers), on dO rows gathered or not as
the backend's policy says (`gather_source`); plus a
mainloop probe: the same GEMM (dO rows times w2_e^T, same tile and ring) whose epilogue only stores
dA' in bfloat16, which bounds what any overlap of dH's epilogue with the mainloop could gain.

  python -m benchmarks.dh_variants [--thiek=T,d,n,E,K ...] [--out=dir]
      [--gate_up_layout=interleaved] [--variants=NAME ...]

Every dH variant's dH and A_s are checked bit for bit against the first variant's (the probes
against the first probe's dA'); then each kind's variants are timed in interleaved rounds
(`timing.measure_variants`).
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np

from benchmarks import grid, timing
from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import dh_projection as dh
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu.grouped_gemm import GemmRole, GroupedGemmConfig, grouped_gemm

grid.define_variant_flags()
flags.DEFINE_enum("gate_up_layout", "concat", list(acts.GATE_UP_LAYOUTS),
                  "where the gate and up columns sit in H and dH")
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(32768, 4096, 2048, 64, 4), (32768, 4096, 1024, 128, 8),
                   (32768, 4096, 512, 128, 8)]

# name: (kind, block_n, GroupedGemmConfig overrides, plus DhProjectionConfig's wide_h_loads);
# kind "dh" runs dh_projection, "probe" the mainloop probe.
VARIANTS = {  # block_n None: the layer's table configuration for the problem
    "dH table config": ("dh", None, {}),
    "dH table config, sigmoid by division": ("dh", None, {"activation": "sigmoid_by_division"}),
    "dH 256 cols, staged H": ("dh", 256, {}),
    "dH 256 cols, staged H, cluster 2": ("dh", 256, {"cluster_m": 2}),
    "dH 256 cols, H in registers": ("dh", 256, {"wide_h_loads": "registers"}),
    "dH 256 cols, H in registers, 3 stages": ("dh", 256, {"wide_h_loads": "registers",
                                                          "num_stages": 3}),
    # Pingpong: each compute warpgroup a whole 128 x 128 tile in turn, H read into registers, so
    # one warpgroup's epilogue runs under the other's mainloop (decoupled where a tile's k-steps
    # use every ring slot an even number of times).
    "dH pingpong, 3 stages": ("dh", 128, {"schedule": "pingpong", "num_stages": 3,
                                           "cluster_m": 1}),
    "dH pingpong, 4 stages": ("dh", 128, {"schedule": "pingpong", "num_stages": 4,
                                           "cluster_m": 1}),
    "dH pingpong, 6 stages": ("dh", 128, {"schedule": "pingpong", "num_stages": 6,
                                           "cluster_m": 1}),
    "dH pingpong, 4 stages, cluster 2": ("dh", 128, {"schedule": "pingpong", "num_stages": 4,
                                                     "cluster_m": 2}),
    "dH 128 cols, prefetched H": ("dh", 128, {}),
    "dH 128 cols, prefetched H, cluster 2": ("dh", 128, {"cluster_m": 2}),
    "probe 256 cols": ("probe", 256, {}),
    "probe 256 cols, cluster 2": ("probe", 256, {"cluster_m": 2}),
    "probe 128 cols, cluster 2": ("probe", 128, {"cluster_m": 2}),
}


def mainloop_probe(d_out, w2, layout, block_n, gemm_config, gathered):
  """dA' = dO_rows @ w2_e^T on dH's tile and ring, stored as bfloat16 (R, n): no H read."""
  n = w2.shape[1]

  def rhs_copy(w2_ref, expert, k_slice, nb, j):
    del j
    return w2_ref.at[expert, pl.ds(nb * block_n, block_n), k_slice]

  def epilogue(accs, ctx):
    (acc,) = accs
    dst = ctx.outputs[0].at[pl.ds(ctx.row0, ctx.rows), pl.ds(ctx.column_block * block_n, block_n)]
    epi.store_tiles([(acc.astype(d_out.dtype), dst)], ctx.scratch)

  role = GemmRole(
      name="dh_mainloop_probe", block_n=block_n, num_rhs_blocks=1,
      num_column_blocks=n // block_n, rhs_copy=rhs_copy, epilogue=epilogue,
      epilogue_scratch=epi.staging_buffers(gemm_config.tile_m // 2, d_out.dtype,
                                           gemm_config.epilogue_buffers),
      out_types=(jax.ShapeDtypeStruct((layout.num_rows, n), d_out.dtype),), rhs_transposed=True)
  return grouped_gemm(d_out, w2, layout.tile_expert, layout.num_tiles,
                      layout.row_token if gathered else None, role, (), gemm_config)


def run_config(cfg):
  _, d, n, e, _ = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, d_out = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  layout_name = FLAGS.gate_up_layout
  h, _ = jax.jit(lambda x, w1: mosaic_backend.up_projection(x, w1, None, layout, act,
                                                            layout_name))(x, w1)
  scores = jnp.where(layout.row_valid(), 0.5, 0.0).astype(jnp.float32)
  gathered = mosaic_backend.gather_source("d_out") != "xla"
  rows = d_out if gathered else jax.jit(lambda g: g[layout.row_token])(d_out)
  used = int(layout.num_tiles) * 128
  flops = 2 * used * d * n
  base = mosaic_backend.dh_config(d, n, e, layout_name)
  # The rows in use of dH and A_s (the dS partials' shape depends on the tile width), or dA'.
  compared = lambda o: tuple(np.asarray(v[:used], np.float32) for v in o[:2])
  by_kind = {"dh": {}, "probe": {}}  # each kind checked against its own first variant
  for name, (kind, block_n, overrides) in VARIANTS.items():
    if FLAGS.variants and name not in FLAGS.variants:
      continue
    overrides = dict(overrides)
    h_loads = overrides.pop("wide_h_loads", "staged" if block_n else base.wide_h_loads)
    # A variant that names its tile starts from the cooperative defaults where the table's
    # configuration is a pingpong one (whose ring depth a cooperative tile may not fit).
    table_gemm = base.gemm
    if block_n and table_gemm.schedule == "pingpong" and "schedule" not in overrides:
      table_gemm = GroupedGemmConfig()
    block_n = block_n or base.block_n
    variant_act = grid.variant_activation(overrides, act)
    gemm = dataclasses.replace(table_gemm, **overrides)
    if kind == "dh":
      config = dh.DhProjectionConfig(gemm, block_n, h_loads)
      fn = lambda g, h, s, w2, config=config, a=variant_act: dh.dh_projection(
          g, h, s, w2, layout, a, config=config, gather=gathered, gate_up_layout=layout_name)
    else:
      fn = lambda g, h, s, w2, gemm=gemm, block_n=block_n: mainloop_probe(
          g, w2, layout, block_n, gemm, gathered)
    by_kind[kind][name] = (fn, (rows, h, scores, w2))
  out = {"gathered dO rows": gathered}
  for variants in filter(None, by_kind.values()):
    out.update(timing.measure_variants(variants, compared, flops, FLAGS.repeats, FLAGS.cool_calls))
  return {"config": list(cfg), "variants": out}


def main(_):
  results = grid.run_variant_configs(run_config, FLAGS.thiek, DEFAULT_CONFIGS, FLAGS.out,
                                     "dh_variants.json")
  for r in results["configs"]:
    print(",".join(map(str, r["config"])),
          "(gathered dO)" if r["variants"]["gathered dO rows"] else "(contiguous dO)")
    for name in VARIANTS:
      if name not in r["variants"]:
        continue
      v = r["variants"][name]
      cell = (f"{v['ms']:.3f} ms {v['tflops']:.0f} TF/s{'' if v['exact'] else ' (DIFFERS)'}"
              if "ms" in v else v["error"][:100])
      print(f"  {name:40s} {cell}")


if __name__ == "__main__":
  app.run(main)
