r"""The router's forward on the GPU: the router GEMM followed by the top-K kernel (XLA's GEMM, then
`sonic_jax.pallas.router_topk.top_k`) against the fused kernel that selects the top-K in the GEMM's
epilogue (`routing.router_logits_and_ids`), alone, and the layer's forward and training step with
and without it.

  python -m benchmarks.router_variants [--thiek=T,d,n,E,K ...] [--out=dir] [--sweep]
      [--topk_sweep] [--device_times] [--nolayer]

The expert ids of every variant are checked bit for bit against the first's (the logits may differ
in their last bits: another summation order); the variants of each group are timed in
interleaved rounds (`timing.measure_variants`).
"""

from __future__ import annotations

from absl import app, flags
import numpy as np

import sonic_jax
from benchmarks import grid, timing
from sonic_jax import routing
from sonic_jax.pallas import router_topk

grid.define_variant_flags(repeats=9)
flags.DEFINE_bool("sweep", False, "also time the fused kernel's program shapes (tokens per "
                  "program, warps, pipelining stages), router alone")
flags.DEFINE_bool("device_times", False, "also each router variant's device time per call, from a "
                  "profiler trace (host-timed batches of work this short are dispatch-bound)")
flags.DEFINE_bool("topk_sweep", False, "also time the top-K kernel's program shapes (values per "
                  "program, warps) and selections (packed, exact) on the router's logits")
flags.DEFINE_bool("layer", True, "also time the layer's forward with and without the fused kernel")
FLAGS = flags.FLAGS

SHAPES = [(128, 8, 3), (128, 8, 2), (128, 4, 3), (64, 8, 3), (64, 4, 3), (64, 4, 4), (32, 4, 3),
          (256, 8, 3)]  # (tokens per program, warps, stages)

TOPK_SHAPES = [(2048, 4), (1024, 4), (4096, 8), (1024, 2), (1024, 1),
               (512, 1)]  # (values per program, warps) of router_topk.top_k

DEFAULT_CONFIGS = [(40960, 768, 256, 128, 8), (40960, 768, 1024, 32, 2),
                   (24576, 1536, 256, 128, 8), (24576, 1536, 1024, 32, 2),
                   (32768, 4096, 1024, 64, 4), (32768, 4096, 256, 256, 16)]


def _router(k, fused):
  def fn(x, rw):
    logits, ids = routing.router_logits_and_ids(x, rw, k, "softmax_topk", fused=fused)
    return logits, routing.route(logits, k, "softmax_topk", expert_ids=ids).expert_ids
  return fn


def _layer(k, fused, step=False):
  """The layer's forward (y, expert ids), or its training step (y, gradients) with step=True,
  with or without the fused router kernel."""
  def forward(x, rw, w1, w2):
    return sonic_jax.moe(x, rw, w1, w2, top_k=k, backend="mosaic_gpu")[0]

  def fn(*args):
    saved = routing.FUSED_TOP_K_MAX_EXPERTS  # read when the layer is traced
    if not fused:
      routing.FUSED_TOP_K_MAX_EXPERTS = 0
    try:
      if step:
        return timing.forward_and_backward(forward)(*args)
      y, aux = sonic_jax.moe(*args, top_k=k, backend="mosaic_gpu")
      return y, aux.expert_ids
    finally:
      routing.FUSED_TOP_K_MAX_EXPERTS = saved
  return fn


def run_config(cfg):
  _, _, _, _, k = cfg
  x, rw, w1, w2, d_out = grid.random_problem(cfg)
  ids = lambda out: (np.asarray(out[1]),)
  variants = {"router GEMM + top-K": (_router(k, False), (x, rw)),
              "fused": (_router(k, True), (x, rw))}
  if FLAGS.sweep:
    for bt, warps, stages in SHAPES:
      fn = lambda x, rw, bt=bt, warps=warps, stages=stages: router_topk.logits_top_k(
          x, rw, k, block_tokens=bt, num_warps=warps, num_stages=stages)
      variants[f"fused {bt} tokens, {warps} warps, {stages} stages"] = (fn, (x, rw))
  if FLAGS.topk_sweep:
    if routing.fused_top_k_unsupported(x, rw, k, "softmax_topk", gpu_only=False) is None:
      variants["fused, exact selection"] = (
          lambda x, rw: router_topk.logits_top_k(x, rw, k, selection="exact"), (x, rw))
    logits = routing.router_logits_and_ids(x, rw, k, "softmax_topk", fused=False)[0]
    for values, warps in TOPK_SHAPES:
      for selection in router_topk.SELECTIONS:
        fn = lambda lg, values=values, warps=warps, selection=selection: router_topk.top_k(
            lg, k, values_per_program=values, num_warps=warps, selection=selection)
        variants[f"top-K {values} values, {warps} warps, {selection}"] = (fn, (logits,))
  router = timing.measure_variants(variants, ids, 2 * x.size * rw.shape[1], FLAGS.repeats,
                                   FLAGS.cool_calls)
  if FLAGS.device_times:
    for name, (fn, args) in variants.items():
      if "error" not in router[name]:
        kernels = timing.kernel_times(timing.compile_fn(fn, *args)[0], args, calls=20, top=None)
        router[name]["device_us"] = sum(us for _, us in kernels)
        router[name]["kernels_us"] = kernels
    print("device us per call: " + ", ".join(f"{name}: {r.get('device_us', 0):.1f}"
                                             for name, r in router.items()))
  if not FLAGS.layer:
    return {"config": list(cfg), "variants": router}
  layer = timing.measure_variants(
      {"layer fwd, GEMM + top-K": (_layer(k, False), (x, rw, w1, w2)),
       "layer fwd, fused": (_layer(k, True), (x, rw, w1, w2))},
      ids, grid.forward_flops(cfg), FLAGS.repeats, FLAGS.cool_calls)
  step = timing.measure_variants(
      {"layer step, GEMM + top-K": (_layer(k, False, True), (x, rw, w1, w2, d_out)),
       "layer step, fused": (_layer(k, True, True), (x, rw, w1, w2, d_out))},
      lambda out: (), 3 * grid.forward_flops(cfg), FLAGS.repeats, FLAGS.cool_calls)
  return {"config": list(cfg), "variants": {**router, **layer, **step}}


def main(_):
  grid.print_variant_table(grid.run_variant_configs(run_config, FLAGS.thiek, DEFAULT_CONFIGS,
                                                    FLAGS.out, "router_variants.json"))


if __name__ == "__main__":
  app.run(main)
