r"""Runs dw2 = A_s^T dO once with the fused gather and once on rows gathered beforehand, for a
profiler to look at (one launch of each weight-gradient kernel, after compilation):

  ncu --kernel-name regex:weight_grad --set basic --section MemoryWorkloadAnalysis \
      --section WarpStateStats python -m benchmarks.wgrad_profile --thiek=40960,768,512,64,4
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp

from benchmarks import grid
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import weight_grad as wgrad

flags.DEFINE_string("thiek", "40960,768,512,64,4", "configuration T,d,n,E,K")
FLAGS = flags.FLAGS


def main(_):
  cfg = grid.parse_configs([FLAGS.thiek], [])[0]
  _, d, n, e, _ = cfg
  x, rw, _, _, d_out = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  a_s = jnp.where(layout.row_valid()[:, None],
                  jax.random.normal(jax.random.key(7), (layout.num_rows, n), jnp.bfloat16), 0)
  d_out_rows = jax.jit(lambda v: v[layout.row_token])(d_out)
  config = mosaic_backend.weight_grad_config(d, n, e)
  fused = jax.jit(lambda a, g: wgrad.weight_grad(a, g, layout, config, gathered="rhs"))
  contiguous = jax.jit(lambda a, g: wgrad.weight_grad(a, g, layout, config))
  fused_c = fused.lower(a_s, d_out).compile()
  contiguous_c = contiguous.lower(a_s, d_out_rows).compile()
  jax.block_until_ready(fused_c(a_s, d_out))
  jax.block_until_ready(contiguous_c(a_s, d_out_rows))
  print("ran dw2 fused gather, then contiguous rows:", cfg, config)


if __name__ == "__main__":
  app.run(main)
