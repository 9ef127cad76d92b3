r"""Weight-gradient kernel variants on the GPU: dw2 = A_s^T gather(dO) and dw1 = gather(x)^T dH with
the fused gather (as the backend runs them, and with other configurations; dw2 also with the
gathered dO on the wgmma's N side), with the gather's machinery over rows gathered beforehand read
in order (what the cp.async path costs without scattered addresses), and on those rows through
TMA.

  python -m benchmarks.wgrad_variants [--thiek=T,d,n,E,K ...] [--out=dir]

Each variant starts from the tuning table's configuration for the problem. Every variant's output
is checked bit for bit against the first variant's of its product; then a product's variants are
timed in interleaved rounds (`timing.measure_variants`).
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import weight_grad as wgrad

grid.define_variant_flags()
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(32768, 4096, 512, 256, 16), (32768, 4096, 256, 256, 16),
                   (24576, 1536, 512, 64, 4), (40960, 768, 512, 64, 4)]

# name: (True: the fused gather, as the backend runs it (dw2: `dw2_gathering_d_out`, the dO rows
# on the wgmma's M side); "n side" (dw2 only): A_s^T dO with the gathered dO as the rhs, on the
# N side; "identity": the fused gather's machinery over the rows gathered beforehand, read in order
# (row_token = iota, no scattered addresses); "padded": the fused gather with each expert's
# reduction over its whole padded group, as before the twenty-ninth session (the layout's real-row
# counts replaced by its group sizes; padding rows add zero products); False: those rows through
# TMA; WeightGradConfig overrides)
VARIANTS = {
    "fused gather, table config": (True, {}),
    "fused gather, reduction over the padded groups": ("padded", {}),
    "identity gather of the grouped rows": ("identity", {}),
    "fused gather, indices after the stage wait": (True, {"indices_before_wait": False}),
    "fused gather, cluster 1": (True, {"cluster": 1}),
    "fused gather, cluster 2": (True, {"cluster": 2}),
    "fused gather, 3 stages": (True, {"num_stages": 3}),
    "fused gather, 4 stages": (True, {"num_stages": 4}),
    "dw2: gathered dO on the N side, blocks 256 x 128": ("n side", {"block_m": 256,
                                                                   "block_n": 128}),
    "dw2: gathered dO on the N side, blocks 128 x 256": ("n side", {}),
    "contiguous rows, table config": (False, {}),
}


def run_config(cfg):
  t_count, d, n, e, k = cfg
  x, rw, _, _, d_out = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  rows = layout.num_rows
  valid = layout.row_valid()[:, None]
  key = jax.random.split(jax.random.key(7), 2)
  # Padding rows of A_s and dH are zero in the layer (score 0): the same here.
  a_s = jnp.where(valid, jax.random.normal(key[0], (rows, n), jnp.bfloat16), 0)
  d_h = jnp.where(valid, jax.random.normal(key[1], (rows, 2 * n), jnp.bfloat16), 0)
  gather_rows = jax.jit(lambda v: v[layout.row_token])
  d_out_rows, x_rows = gather_rows(d_out), gather_rows(x)
  base = mosaic_backend.weight_grad_config(d, n, e)
  identity = layout._replace(row_token=jnp.arange(rows, dtype=jnp.int32))
  padded = layout._replace(expert_counts=layout.group_sizes)
  used = int(layout.num_tiles) * 128
  out = {}
  products = {  # name: (lhs, rhs, gathered side, its grouped rows, their source, flops)
      "dw2 = A_s^T dO": (a_s, d_out_rows, "rhs", d_out_rows, d_out, 2 * used * n * d),
      "dw1 = x^T dH": (x_rows, d_h, "lhs", x_rows, x, 2 * used * d * 2 * n),
  }
  for product, (lhs, rhs, side, grouped, source, flops) in products.items():
    variants = {}
    for name, (fused, overrides) in VARIANTS.items():
      if FLAGS.variants and name not in FLAGS.variants:
        continue
      if fused == "n side" and side != "rhs":
        continue
      config = dataclasses.replace(base, **overrides)
      lay = {"identity": identity, "padded": padded}.get(fused, layout)
      src = grouped if fused == "identity" else source
      if fused is False:
        variants[name] = (lambda l, r, config=config: wgrad.weight_grad(l, r, layout, config),
                          (lhs, rhs))
      elif side == "lhs":  # dw1 = x_rows^T dH
        variants[name] = (lambda s, r, config=config, lay=lay: wgrad.weight_grad(
            s, r, lay, config, gathered="lhs"), (src, rhs))
      elif fused == "n side":
        variants[name] = (lambda l, s, config=config: wgrad.weight_grad(
            l, s, layout, config, gathered="rhs"), (lhs, source))
      else:  # dw2 = A_s^T dO_rows as the backend runs it
        variants[name] = (lambda l, s, config=config, lay=lay: mosaic_backend.dw2_gathering_d_out(
            s, l, lay, config), (lhs, src))
    out[product] = timing.measure_variants(
        variants, lambda o: (np.asarray(o, np.float32),), flops, FLAGS.repeats, FLAGS.cool_calls)
    for name, record in out[product].items():
      print(cfg, product, name, record.get("ms", record.get("error")), flush=True)
  return {"config": list(cfg), "table_config": dataclasses.asdict(base), "variants": out}


def main(_):
  results = grid.run_variant_configs(run_config, FLAGS.thiek, DEFAULT_CONFIGS, FLAGS.out,
                                     "wgrad_variants.json")
  for r in results["configs"]:
    print(",".join(map(str, r["config"])), "table:", r["table_config"])
    for product, variants in r["variants"].items():
      for name, v in variants.items():
        cell = (f"{v['ms']:.3f} ms {v['tflops']:.0f} TF/s{'' if v['exact'] else ' (DIFFERS)'}"
                if "ms" in v else v["error"][:100])
        print(f"  {product:16s} {name:40s} {cell}")


if __name__ == "__main__":
  app.run(main)
