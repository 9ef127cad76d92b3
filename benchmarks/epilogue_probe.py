r"""Where the forward's GEMM time goes: the mainloop or the epilogue; and what the expert sort costs.

  python -m benchmarks.epilogue_probe [--thiek=T,d,n,E,K ...] [--out=dir]

Up- and down-projection kernels of the layer (SwiGLU, concat gate/up, the tuning table's
configuration) against the same grouped GEMM with lighter epilogues:
- "H only": stores H, no activation and no A;
- "direct to GMEM": stores from registers with plain global stores (no SMEM staging, no TMA and
  so no waiting for a staging buffer), H and SwiGLU's A, H only, or the down-projection's Y;
- "one piece": stores one 64-column piece per tile (the mainloop, the tile walk and the ring alone);
  "identity gather": the same through the gather path over the contiguous grouped rows in order;
  "one 256-column block": one B block and one N = 256 wgmma per step (the kernel, for either
  layout, reads two 128-column blocks into two N = 128 wgmmas);
- "(gather, IMPL)": the up-projection with another `gather_impl` (its outputs must equal the
  layer's kernel's on the rows in use).
The gap between the full kernel and "one piece" is what the epilogue costs while the tensor cores
wait (the cooperative schedule runs it after the tile's mainloop, not under the next one).

Routing metadata: the expert sort of a packed int32 key (`id << b | pair`, sorted keys-only: the
layout's sort until the seventh session) against stable (key, index) pair sorts with uint8 /
uint16 / int32 keys, and the whole layout with its sort of now and with the packed key.
Prints a table; writes `epilogue_probe.json` under --out.

--ring_study instead runs `ring_study`: the up- and down-projection (full, H only, one piece) on a
4-stage ring with 2 staging buffers against a 3-stage ring with a buffer per piece, in interleaved
rounds; writes `ring_study.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from unittest import mock

from absl import app, flags
import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
import numpy as np

from benchmarks import grid, timing
from sonic_jax import activations as acts
from sonic_jax import routing
from sonic_jax import layout as layout_module
from sonic_jax.layout import build_grouped_layout
from sonic_jax.mosaic_gpu import backend as mosaic_backend
from sonic_jax.mosaic_gpu import down_projection as down
from sonic_jax.mosaic_gpu import epilogue as epi
from sonic_jax.mosaic_gpu import up_projection as up
from sonic_jax.mosaic_gpu.grouped_gemm import GemmRole, grouped_gemm

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_integer("repeats", 10, "timed samples per kernel")
flags.DEFINE_bool("ring_study", False,
                  "instead of the table: the ring-depth study (see ring_study)")
flags.DEFINE_list("gather_impls", [], "GroupedGemmConfig.gather_impl values "
                  "to add as up-projection rows (outputs checked equal to the layer's kernel)")
FLAGS = flags.FLAGS


def _light_role(width, bn, blocks, column, out_types, store, tm, dtype, buffers=2):
  """A GemmRole reading B blocks like the real role, with a lighter epilogue `store`: "h" (the
  accumulators as bf16 through the staging buffers), "piece" (one 64-column piece per tile),
  "h_direct" / "full_direct" (H, or H and SwiGLU's A, stored from registers)."""

  def rhs_copy(w_ref, expert, k_slice, nb, j):
    return w_ref.at[expert, k_slice, pl.ds(column(nb, j), bn)]

  def epilogue(accs, ctx):
    rows = pl.ds(ctx.row0, ctx.rows)
    out = ctx.outputs[0]
    if store in ("h_direct", "full_direct"):  # registers straight to GMEM: no staging buffer
      h = [acc.astype(dtype) for acc in accs]
      for j, hj in enumerate(h):
        out[rows, pl.ds(column(ctx.column_block, j), bn)] = hj
      if store == "full_direct":  # SwiGLU's A too, as the real epilogue computes it
        a = jax.nn.sigmoid(h[0].astype(jnp.float32)) * h[0].astype(jnp.float32)
        a = a * h[1].astype(jnp.float32)
        ctx.outputs[1][rows, pl.ds(ctx.column_block * bn, bn)] = a.astype(dtype)
      return
    if store == "h":
      stores = [(acc.astype(dtype), out.at[rows, pl.ds(column(ctx.column_block, j), bn)])
                for j, acc in enumerate(accs)]
    else:  # one 64-column piece of the first block, the rest of the accumulators dropped
      piece = accs[0][:, :epi.STORE_COLS]
      for acc in accs[1:]:
        piece = piece + acc[:, :epi.STORE_COLS]
      stores = [(piece.astype(dtype),
                 out.at[rows, pl.ds(column(ctx.column_block, 0), epi.STORE_COLS)])]
    epi.store_tiles(stores, ctx.scratch)

  return GemmRole(block_n=bn, num_rhs_blocks=blocks, num_column_blocks=width // (bn * blocks),
                  rhs_copy=rhs_copy, epilogue=epilogue,
                  epilogue_scratch=epi.staging_buffers(tm // 2, dtype, buffers),
                  out_types=out_types)


def run_config(cfg):
  t_count, d, n, e, k = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, _ = grid.random_problem(cfg)

  r, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  expert_ids = r.expert_ids
  up_cfg, down_cfg = mosaic_backend.up_config(d, 2 * n, e), mosaic_backend.down_config(d, n, e)
  rows_total = layout.num_rows
  x_rows = jax.jit(lambda v, lay: v[lay.row_token])(x, layout)
  _, a = jax.jit(lambda x, w1, lay: up.up_projection(x, w1, None, lay, act, "concat",
                                                     config=up_cfg))(x, w1, layout)
  tm, dt = 128, x.dtype
  up_bn, down_bn = up.GLU_BLOCK_N, down.BLOCK_N
  up_column = lambda nb, j: j * n + nb * up_bn
  down_column = lambda nb, j: nb * down_bn

  def up_light(store, gathered, gemm=None):
    """gathered: False (contiguous rows), True (the layout's gather) or "identity" (the gather
    path reading the contiguous grouped rows in order: the cp.async machinery without the
    scattered addresses)."""
    role = _light_role(2 * n, up_bn, 2, up_column,
                       (jax.ShapeDtypeStruct((rows_total, 2 * n), dt),
                        jax.ShapeDtypeStruct((rows_total, n), dt)), store, tm, dt)
    def fn(src, w1, lay):
      if gathered == "identity":
        index = lax.iota(jnp.int32, rows_total)
      else:
        index = lay.row_token if gathered else None
      return grouped_gemm(src, w1, lay.tile_expert, lay.num_tiles, index, role, (),
                          gemm or up_cfg.gemm)
    return fn

  def up_light_one_block(store):
    """The up-projection's mainloop with one 256-column B block and one N = 256 wgmma per step
    (over 256 consecutive columns of w1: the kernel reads two 128-column blocks, for either
    layout)."""
    role = _light_role(2 * n, 2 * up_bn, 1, lambda nb, j: nb * 2 * up_bn,
                       (jax.ShapeDtypeStruct((rows_total, 2 * n), dt),
                        jax.ShapeDtypeStruct((rows_total, n), dt)), store, tm, dt)
    return lambda src, w1, lay: grouped_gemm(src, w1, lay.tile_expert, lay.num_tiles,
                                             lay.row_token, role, (), up_cfg.gemm)

  def down_light(store):
    role = _light_role(d, down_bn, 1, down_column,
                       (jax.ShapeDtypeStruct((rows_total, d), dt),), store, tm, dt)
    return lambda a, w2, lay: grouped_gemm(a, w2, lay.tile_expert, lay.num_tiles, None, role, (),
                                           down_cfg.gemm)

  flat = expert_ids.reshape(-1)
  bits = max(1, (flat.shape[0] - 1).bit_length())
  iota = lambda f: lax.iota(jnp.int32, f.shape[0])
  kernels = {
      "up: full (gather)": (lambda x, w1, lay: up.up_projection(x, w1, None, lay, act, "concat",
                                                                config=up_cfg), (x, w1, layout)),
      "up: H only (gather)": (up_light("h", True), (x, w1, layout)),
      "up: H+A direct to GMEM (gather)": (up_light("full_direct", True), (x, w1, layout)),
      "up: H only direct to GMEM (gather)": (up_light("h_direct", True), (x, w1, layout)),
      "up: one piece (gather)": (up_light("piece", True), (x, w1, layout)),
      "up: one piece, one 256-column block (gather)": (up_light_one_block("piece"),
                                                       (x, w1, layout)),
      "up: H only, one 256-column block (gather)": (up_light_one_block("h"), (x, w1, layout)),
      "up: full (contiguous)": (lambda xr, w1, lay: up.up_projection(
          xr, w1, None, lay, act, "concat", config=up_cfg, gather=False), (x_rows, w1, layout)),
      "up: one piece (contiguous)": (up_light("piece", False), (x_rows, w1, layout)),
      "up: one piece (identity gather of the grouped rows)": (up_light("piece", "identity"),
                                                              (x_rows, w1, layout)),
      "down: full": (lambda a, w2, lay: down.down_projection(a, w2, None, lay, config=down_cfg),
                     (a, w2, layout)),
      "down: Y direct to GMEM": (down_light("h_direct"), (a, w2, layout)),
      "down: one piece": (down_light("piece"), (a, w2, layout)),
      "sort: packed int32 key": (lambda f: jnp.sort((f << bits) | iota(f)), (flat,)),
      "sort: (uint8 id, index)": (lambda f: lax.sort((f.astype(jnp.uint8), iota(f)), num_keys=1,
                                                     is_stable=True), (flat,)),
      "sort: (uint16 id, index)": (lambda f: lax.sort((f.astype(jnp.uint16), iota(f)),
                                                      num_keys=1, is_stable=True), (flat,)),
      "sort: (int32 id, index)": (lambda f: lax.sort((f, iota(f)), num_keys=1, is_stable=True),
                                  (flat,)),
      "layout (build_grouped_layout)": (lambda f: build_grouped_layout(f.reshape(t_count, k), e,
                                                                       128), (flat,)),
      "layout with the packed int32 key sort": (_layout_with_packed_key_sort(t_count, k, e),
                                                (flat,)),
      "router GEMM + top-K": (lambda x, rw: routing.route(routing.router_logits(x, rw), k,
                                                           "softmax_topk"), (x, rw)),
  }
  res = {"config": list(cfg), "ms": {}, "device_ms": {}, "equal_to_layer_kernel": {}}
  if FLAGS.gather_impls:
    ref = jax.jit(kernels["up: full (gather)"][0])(x, w1, layout)
    valid = layout.row_valid()
  for impl in FLAGS.gather_impls:
    gemm = dataclasses.replace(up_cfg.gemm, gather_impl=impl)
    fn = functools.partial(lambda x, w1, lay, c: up.up_projection(x, w1, None, lay, act, "concat",
                                                                 config=c),
                           c=up.UpProjectionConfig(gemm))
    kernels[f"up: full (gather, {impl})"] = (fn, (x, w1, layout))
    got = jax.jit(fn)(x, w1, layout)
    res["equal_to_layer_kernel"][impl] = all(
        bool(jnp.all(jnp.where(valid[:, None], g == r, True))) for g, r in zip(got, ref))
    kernels[f"up: one piece (gather, {impl})"] = (up_light("piece", True, gemm), (x, w1, layout))
    kernels[f"up: one piece (identity gather, {impl})"] = (up_light("piece", "identity", gemm),
                                                           (x_rows, w1, layout))
  kernels["up: full interleaved (gather)"] = (
      lambda x, w1, lay: up.up_projection(x, w1, None, lay, act, "interleaved", config=up_cfg),
      (x, w1, layout))
  for name, (fn, args) in kernels.items():
    compiled, _ = timing.compile_fn(fn, *args)
    res["ms"][name] = timing.time_compiled(compiled, [args], repeats=FLAGS.repeats)[0] * 1e3
    # The sum of the kernels' device times: what a small function costs inside a jitted step,
    # without the host's dispatch that a wall-clock time of it alone includes.
    res["device_ms"][name] = sum(us for _, us in timing.kernel_times(compiled, args,
                                                                      top=None)) / 1e3
  return res


def ring_study(cfg):
  """What an epilogue handed off to other warps could gain: up- (gather) and down-projection with
  the full epilogue, H only, and one piece (the mainloop alone), each on a 4-stage ring with 2
  staging buffers and on a 3-stage ring with a buffer for every piece of the tile (no store waits
  inside a tile: what a 128 x 256 tile leaves room for next to a bf16 hand-over buffer). Timed in
  interleaved rounds; outputs of the full kernels checked against the layer's."""
  t_count, d, n, e, k = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, _ = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  up_cfg, down_cfg = mosaic_backend.up_config(d, 2 * n, e), mosaic_backend.down_config(d, n, e)
  _, a = jax.jit(lambda x, w1: up.up_projection(x, w1, None, layout, act, "concat",
                                                config=up_cfg))(x, w1)
  rows_total, tm, dt = layout.num_rows, 128, x.dtype
  used = int(layout.num_tiles) * tm
  rings = {"4 stages, 2 buffers": (4, 2), "3 stages, every piece buffered": (3, None)}
  res = {"config": list(cfg)}
  for kernel, pieces, cfg_gemm, flops in (("up", {"full": 6, "h": 4, "piece": 1}, up_cfg.gemm,
                                           2 * used * d * 2 * n),
                                          ("down", {"full": 4, "piece": 1}, down_cfg.gemm,
                                           2 * used * n * d)):
    variants = {}
    for ring, (stages, buffers) in rings.items():
      for store, count in pieces.items():
        gemm = dataclasses.replace(cfg_gemm, num_stages=stages,
                                   epilogue_buffers=buffers or max(2, count))
        if kernel == "up" and store == "full":
          fn = functools.partial(lambda x, w1, c: up.up_projection(x, w1, None, layout, act,
                                                                   "concat", config=c),
                                 c=up.UpProjectionConfig(gemm))
          args = (x, w1)
        elif kernel == "down" and store == "full":
          fn = functools.partial(lambda a, w2, c: down.down_projection(a, w2, None, layout,
                                                                       config=c),
                                 c=down.DownProjectionConfig(gemm))
          args = (a, w2)
        elif kernel == "up":
          role = _light_role(2 * n, up.GLU_BLOCK_N, 2, lambda nb, j: j * n + nb * up.GLU_BLOCK_N,
                             (jax.ShapeDtypeStruct((rows_total, 2 * n), dt),), store, tm, dt,
                             gemm.epilogue_buffers)
          fn = functools.partial(lambda x, w1, role, g: grouped_gemm(
              x, w1, layout.tile_expert, layout.num_tiles, layout.row_token, role, (), g),
              role=role, g=gemm)
          args = (x, w1)
        else:
          role = _light_role(d, down.BLOCK_N, 1, lambda nb, j: nb * down.BLOCK_N,
                             (jax.ShapeDtypeStruct((rows_total, d), dt),), store, tm, dt,
                             gemm.epilogue_buffers)
          fn = functools.partial(lambda a, w2, role, g: grouped_gemm(
              a, w2, layout.tile_expert, layout.num_tiles, None, role, (), g), role=role, g=gemm)
          args = (a, w2)
        variants[f"{kernel} {store}, {ring}"] = (fn, args)
    # Only the full kernels compute the same outputs: those are checked, all are timed together.
    full = {name: v for name, v in variants.items() if " full," in name}
    records, calls = timing.check_variants(
        full, lambda o: tuple(np.asarray(v[:used], np.float32) for v in jax.tree.leaves(o)))
    light_records, light_calls = timing.check_variants(
        {name: v for name, v in variants.items() if name not in full}, lambda o: ())
    records.update({name: {k: v for k, v in r.items() if k != "exact"}
                    for name, r in light_records.items()})
    calls.update(light_calls)
    for name, (t, samples) in timing.time_interleaved(calls, repeats=FLAGS.repeats).items():
      records[name].update(ms=t * 1e3, tflops=flops / t / 1e12,
                           samples_ms=[v * 1e3 for v in samples])
    res[kernel] = records
    for name, r in records.items():
      print(cfg, name, r.get("ms"), r.get("exact", ""), flush=True)
  return res


def _layout_with_packed_key_sort(t_count, k, e):
  """build_grouped_layout with the expert sort of before (one int32 key id << b | pair, sorted
  keys-only), for the comparison."""
  def sort_packed(flat, e_count):
    bits = max(1, (flat.shape[0] - 1).bit_length())
    keys = jnp.sort((flat << bits) | lax.iota(jnp.int32, flat.shape[0]))
    return keys & ((1 << bits) - 1), keys >> bits

  def fn(f):
    with mock.patch.object(layout_module, "_sort_by_expert", sort_packed):
      return build_grouped_layout(f.reshape(t_count, k), e, 128)
  return fn


def main(_):
  cfgs = grid.parse_configs(FLAGS.thiek, [(40960, 768, 256, 128, 8), (32768, 4096, 1024, 128, 8)])
  os.makedirs(FLAGS.out, exist_ok=True)
  if FLAGS.ring_study:
    results = [ring_study(cfg) for cfg in cfgs]
    with open(os.path.join(FLAGS.out, "ring_study.json"), "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "results": results}, f, indent=1)
    for r in results:
      print(",".join(map(str, r["config"])))
      for kernel in ("up", "down"):
        for name, v in r[kernel].items():
          cell = (f"{v['ms']:.3f} ms{'' if v.get('exact', True) else ' (DIFFERS)'}"
                  if "ms" in v else v.get("error", "")[:100])
          print(f"  {name:45s} {cell}")
    return
  results = []
  for cfg in cfgs:
    results.append(run_config(cfg))
    with open(os.path.join(FLAGS.out, "epilogue_probe.json"), "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                 "results": results}, f, indent=1)
  print("outputs equal to the layer's kernel:", [r["equal_to_layer_kernel"] for r in results])
  names = list(results[0]["ms"])
  print("ms per call: wall clock (median) / sum of device kernel times")
  print("| kernel | " + " | ".join(",".join(map(str, r["config"])) for r in results) + " |")
  print("|---|" + "---|" * len(results))
  for name in names:
    print(f"| {name} | " + " | ".join(f"{r['ms'][name]:.3f} / {r['device_ms'][name]:.3f}"
                                      for r in results) + " |")


if __name__ == "__main__":
  app.run(main)
