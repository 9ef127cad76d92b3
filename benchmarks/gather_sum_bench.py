r"""The forward's gather-sum kernel (`sonic_jax.mosaic_gpu.gather_sum`) over its configurations:
every (block_columns, num_stages) that fits, and the default, against XLA's gather fusion.

  python -m benchmarks.gather_sum_bench [--case=32768,4096,16 ...] [--out=dir]

A case T,d,K is T tokens of K slot pairs over R = T * K grouped rows in random order (token
rounding's extra pairs are folded into slot 0 first, `sonic_jax.pallas.extras_sum`, so they add
no slot).
Each variant's output is checked against XLA's (relative error) before it is timed (median of
interleaved samples after warm-up, `benchmarks.timing`); GB/s counts the rows the tokens read
and the output written. Writes DIR/<device>_<date>_gather_sum.json and prints a table; the file
backs decisions (docs/decisions.md), not a BENCHMARKS.md table, so it stays out of
benchmarks/results/. Needs a Hopper GPU.
"""

from __future__ import annotations


from absl import app, flags
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: tests import the module's functions
  flags.DEFINE_multi_string("case", None, "case T,d,K: K slot pairs (repeatable; default: "
                            f"{' and '.join(DEFAULT_CASES)})")
  flags.DEFINE_integer("repeats", 10, "timed samples per variant (median reported)")
  flags.DEFINE_string("out", "bench_out", "output folder")


DEFAULT_CASES = ("32768,4096,16", "32768,4096,8")


def problem(t, d, k, seed=0):
  """(rows (R, d) bf16, pair_row (T, K) int32, weights (T, K) float32)."""
  rng = np.random.default_rng(seed)
  num_rows = t * k
  pair_row = rng.permutation(num_rows).reshape(t, k).astype(np.int32)
  weights = rng.random((t, k), dtype=np.float32)
  rows = rng.standard_normal((num_rows, d), dtype=np.float32)
  return jnp.asarray(rows, jnp.bfloat16), jnp.asarray(pair_row), jnp.asarray(weights)


def configs(d, s):
  """Every GatherSumConfig the kernel takes at (d, S) whose ring fits SMEM_BYTES."""
  from sonic_jax.mosaic_gpu import gather_sum as gs
  c = gs.view_columns(d)
  out = []
  for block in range(c, d + 1, c):
    if d % block:
      continue
    for stages in (2, 4, 6, 8):
      if gs.smem_bytes(block, s, stages) <= gs.SMEM_BYTES:
        out.append(gs.GatherSumConfig(block_columns=block, num_stages=stages))
  return out


def run_case(t, d, k, repeats):
  from sonic_jax.mosaic_gpu import gather_sum as gs
  rows, pair_row, weights = problem(t, d, k)
  s = k

  def ref(r, p, w):  # XLA's gather fusion; rows past R add nothing, as in the kernel
    picked = r[jnp.minimum(p, r.shape[0] - 1)].astype(jnp.float32)
    picked = jnp.where((p < r.shape[0])[..., None], picked, 0.0)
    return jnp.einsum("ts,tsd->td", w, picked).astype(jnp.bfloat16)

  args = (rows, pair_row, weights)
  calls = {"xla": (timing.compile_fn(ref, *args)[0], args)}
  want = np.asarray(calls["xla"][0](*args), np.float32)
  default = gs.default_config(d, s)
  names = {"xla": None}
  for config in configs(d, s):
    name = f"{config.block_columns} columns, {config.num_stages} stages"
    if config == default:
      name += " (default)"
    compiled = timing.compile_fn(
        lambda r, p, w, config=config: gs.gather_sum(r, p, w, jnp.bfloat16, config), *args)[0]
    got = np.asarray(compiled(*args), np.float32)
    err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    if not err < 1e-2:
      raise AssertionError(f"{name}: relative error {err:.2e} against XLA")
    calls[name] = (compiled, args)
    names[name] = config
  times = timing.time_interleaved(calls, repeats=repeats)
  nbytes = t * k * d * 2 + t * d * 2
  return [{"T": t, "d": d, "S": s, "variant": name,
           "block_columns": None if c is None else c.block_columns,
           "num_stages": None if c is None else c.num_stages,
           "us": times[name][0] * 1e6, "gbps": nbytes / times[name][0] / 1e9}
          for name, c in names.items()]


def table(results):
  return grid.variants_table(results, ("T", "d", "S"),
                             [("GB/s", lambda r: f"{r['gbps']:.0f}")])


def main(argv):
  del argv
  results = []
  for case in FLAGS.case or DEFAULT_CASES:
    t, d, k = (int(v) for v in case.split(","))
    results += run_case(t, d, k, FLAGS.repeats)
  record = grid.run_record("gather_sum_bench", results=results)
  path = grid.write_record(record, FLAGS.out, "gather_sum")
  print(table(results))
  print("wrote", path)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
