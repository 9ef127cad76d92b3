r"""Expert parallelism's token movement over NVLink: NCCL (`jax.lax.all_gather`) against the Mosaic
GPU peer copies of `sonic_jax.mosaic_gpu.peer_copy`: the all-gather by TMA stores into the peers,
and the row gather by cp.async from the peers' memory (against NCCL's all-gather and an XLA gather).

  python -m benchmarks.nvlink_bench [--rows=16384,8192] [--d=4096] [--num_blocks=16,64,128]
      [--stages=2,4] [--out=dir]
  PJRT_NPROC=16 XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      python -m benchmarks.nvlink_bench --rows=256 --d=256 --num_blocks=2   # the harness on a CPU

(On a CPU only the NCCL variants run, the Mosaic GPU kernels are reported as refused; XLA:CPU's
collectives need more pool threads than two cores give, hence PJRT_NPROC.)

On a host of P >= 2 GPUs (all of `jax.devices()`). For each per-device row count: every variant's
output is checked bit for bit against its group's NCCL variant, then timed (median of
interleaved samples after warm-up, `benchmarks.timing`); GB/s is the bytes of the rows each device
needs from its peers over the time: (P - 1) * rows * d * 2 for the all-gather, (P - 1) * rows / 2
* d * 2 for the row gather (half of each peer's rows, in random order; its NCCL variant moves
twice that, all of the peers' rows). Writes
DIR/<device>x<P>_<date>_nvlink.json and prints a table.
"""

from __future__ import annotations

import functools

from absl import app, flags
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import grid, timing

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: benchmarks.report imports `table`
  flags.DEFINE_list("rows", ["16384", "8192"], "rows per device (T_local)")
  flags.DEFINE_integer("d", 4096, "row width")
  flags.DEFINE_list("num_blocks", ["16", "64", "128"], "CTAs of the peer-copy kernels")
  flags.DEFINE_list("stages", ["2", "4"], "SMEM stages of the row gather")
  flags.DEFINE_integer("repeats", 10, "timed samples per variant (median reported)")
  flags.DEFINE_string("out", "bench_out", "output folder")


def variants(mesh, num_blocks, stages):
  """{group: {name: (jitted fn, kind)}}: the all-gathers of a (P * rows, d) array sharded over
  "ep", and the row gathers (rows (P, R) replicated: every device takes rows[p] of device p's x),
  each group's first entry the reference the others must equal."""
  from sonic_jax.mosaic_gpu import peer_copy  # here, so that report can import `table` lightly
  sharded = lambda fn, specs=P("ep"): jax.jit(jax.shard_map(
      fn, mesh=mesh, in_specs=specs, out_specs=P("ep"), check_vma=False))
  all_gathers = {"nccl": sharded(lambda x: lax.all_gather(x, "ep", tiled=True))}
  for blocks in num_blocks:
    all_gathers[f"push {blocks} CTAs"] = sharded(functools.partial(
        peer_copy.all_gather, axis="ep", num_blocks=blocks))

  def nccl_take(x, rows):
    whole = lax.all_gather(x, "ep", tiled=True).reshape((rows.shape[0], -1) + x.shape[1:])
    return jnp.take_along_axis(whole, rows[:, :, None], axis=1)

  row_gathers = {"nccl all-gather + XLA gather": sharded(nccl_take, (P("ep"), P()))}
  for blocks in num_blocks:
    for n in stages:
      row_gathers[f"cp.async from peers {blocks} CTAs, {n} stages"] = sharded(functools.partial(
          peer_copy.gather_rows, axis="ep", num_blocks=blocks, stages=n), (P("ep"), P()))
  return {"all-gather": all_gathers, "row gather": row_gathers}


def table(results):
  """Markdown: one row per variant, with its group's NCCL reference's time over its own."""
  base = {(r["rows"], r["group"]): r.get("ms") for r in results
          if r["variant"].startswith("nccl")}
  lines = ["| rows per device | d | variant | ms | GB/s received per device | × NCCL |",
           "|---|---|---|---|---|---|"]
  for r in results:
    ref = base.get((r["rows"], r["group"]))
    cells = (f"{r['ms']:.3f} | {r['gbps']:.0f} | " + (f"{ref / r['ms']:.2f}" if ref else "–")
             if "ms" in r else f"– | {r['error']} | –")
    lines.append(f"| {r['rows']} | {r['d']} | {r['group']}: {r['variant']} | {cells} |")
  return "\n".join(lines)


def main(_):
  devices = jax.devices()
  p = len(devices)
  if p < 2:
    raise SystemExit(f"nvlink_bench needs at least 2 devices, found {p}")
  mesh = jax.make_mesh((p,), ("ep",), devices=devices,
                       axis_types=(jax.sharding.AxisType.Explicit,))
  results = []
  for rows in map(int, FLAGS.rows):
    x = jax.device_put(
        jax.random.normal(jax.random.key(rows), (p * rows, FLAGS.d), jnp.bfloat16),
        NamedSharding(mesh, P("ep")))
    # Half of each device's rows, in random order: what dispatch moves at K/E = 1/2 per device.
    rng = np.random.default_rng(rows)
    picked = jax.device_put(np.stack([rng.permutation(rows)[:rows // 2] for _ in range(p)]).astype(
        np.int32), NamedSharding(mesh, P()))
    groups = variants(mesh, [int(b) for b in FLAGS.num_blocks], [int(n) for n in FLAGS.stages])
    for group, calls in groups.items():
      args = (x,) if group == "all-gather" else (x, picked)
      received = (p - 1) * (rows if group == "all-gather" else rows // 2) * FLAGS.d * 2
      compiled, errors, want = {}, {}, None
      for name, fn in calls.items():
        try:
          compiled[name] = (timing.compile_fn(fn, *args)[0], args)
          got = np.asarray(compiled[name][0](*args))
        except Exception as e:  # a variant that fails is reported, not fatal
          errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
          compiled.pop(name, None)
          continue
        if want is None:
          want = got
        elif not np.array_equal(got.view(np.uint16), want.view(np.uint16)):
          errors[name] = f"output differs from {next(iter(calls))!r}"
          compiled.pop(name)
      times = timing.time_interleaved(compiled, repeats=FLAGS.repeats) if compiled else {}
      for name in calls:
        row = {"rows": rows, "d": FLAGS.d, "group": group, "variant": name}
        if name in times:
          row.update(ms=times[name][0] * 1e3, gbps=received / times[name][0] / 1e9)
        else:
          row["error"] = errors[name]
        results.append(row)
  print(table(results))
  path = grid.write_record(grid.run_record("nvlink_bench", devices, results=results), FLAGS.out,
                           "nvlink")
  print(f"wrote {path}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
