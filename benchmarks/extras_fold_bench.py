r"""Token rounding's extras fold (`sonic_jax.pallas.extras_sum.fold_extras`) against its XLA
reference (a segment sum over the whole extra-pair list), on the layout of a real rounding.

  python -m benchmarks.extras_fold_bench [--case=24576,1536,128,8 ...] [--out=dir]

A case T,d,E,K routes T tokens of random N(0, 1) logits to K of E experts (softmax top-K), rounds
them to tiles of 128 rows ("nearest") and folds the extra pairs into slot 0 of a (rows, d) bfloat16
buffer of random rows. Each variant's output is checked against the reference (relative error)
before it is timed (median of interleaved samples after warm-up, `benchmarks.timing`);
--kernel_trace (on by default) adds the fold's kernels (device us per call): the fold is a few
microseconds of latency-bound work (about a fifth of the X = E * J list entries are in use at these
shapes), which the kernels' device time shows better than the wall time of one small call.
Writes DIR/<device>_<date>_extras_fold.json and prints a table; the file backs decisions
(docs/decisions.md), not a BENCHMARKS.md table, so it stays out of benchmarks/results/. Needs a
GPU.
"""

from __future__ import annotations


from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing

FLAGS = flags.FLAGS
DEFAULT_CASES = ("24576,1536,128,8", "40960,768,128,8", "16384,4096,256,8", "32768,4096,256,16")
TILE = 128


def _define_flags():  # only when run as a script
  flags.DEFINE_multi_string("case", None, "case T,d,E,K (repeatable)")
  flags.DEFINE_integer("repeats", 10, "timed samples per variant (median reported)")
  flags.DEFINE_bool("kernel_trace", True, "the fold's kernels (device us per call)")
  flags.DEFINE_string("out", "bench_out", "output folder")


def problem(t, d, e, k, tile=TILE):
  """fold_extras' arguments for a "nearest" rounding of random logits: (rows, slot_row,
  slot_weight, extra_token, extra_row, extra_weight), and the count of extra pairs in use."""
  from sonic_jax import routing
  from sonic_jax.layout import build_grouped_layout
  logits = jax.random.normal(jax.random.key(0), (t, e), jnp.float32)
  rounded = routing.round_tokens(routing.route(logits, k, "softmax_topk"), tile, "nearest",
                                 logits=logits)
  layout = build_grouped_layout(rounded.expert_ids, e, tile, rounded.extra_tokens,
                                rounded.extra_experts, extras_by_expert=True)
  rows = jax.random.normal(jax.random.key(1), (layout.num_rows, d), jnp.bfloat16)
  args = (rows, layout.pair_row[:, 0], rounded.scores[:, 0], layout.extra_token,
          layout.extra_row, rounded.extra_scores)
  return args, int(jnp.sum(layout.extra_valid()))


def run_case(t, d, e, k, repeats, tile=TILE, interpret=False, kernel_trace=False):
  from sonic_jax.pallas import extras_sum
  args, used = problem(t, d, e, k, tile)
  fns = {"xla": extras_sum.reference,
         "kernel": lambda *a: extras_sum.fold_extras(*a, interpret=interpret)}
  calls = {name: (timing.compile_fn(fn, *args)[0], args) for name, fn in fns.items()}
  want = np.asarray(calls["xla"][0](*args)[0], np.float32)
  got = np.asarray(calls["kernel"][0](*args)[0], np.float32)
  error = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
  if not error <= 1e-2:
    raise AssertionError(f"{t},{d},{e},{k}: the fold differs from the reference by {error:.2e}")
  times = timing.time_interleaved(calls, repeats=repeats)
  out = [{"T": t, "d": d, "E": e, "K": k, "variant": name, "us": times[name][0] * 1e6,
          "extras_used": used, "extras": args[3].shape[0], "error": error if name != "xla"
          else 0.0, "kernels_us": {}} for name in calls]
  if kernel_trace:
    for r in out:
      r["kernels_us"] = dict(timing.kernel_times(*calls[r["variant"]], top=8))
  return out


def table(results):
  return grid.variants_table(results, ("T", "d", "E", "K"), (
      ("extras in use", lambda r: f"{r['extras_used']} / {r['extras']}"),))


def main(argv):
  del argv
  results = []
  for case in FLAGS.case or DEFAULT_CASES:
    t, d, e, k = (int(v) for v in case.split(","))
    results += run_case(t, d, e, k, FLAGS.repeats, kernel_trace=FLAGS.kernel_trace)
  record = grid.run_record("extras_fold_bench", results=results)
  path = grid.write_record(record, FLAGS.out, "extras_fold")
  print(table(results))
  grid.print_kernels(results, ("T", "d", "E", "K"))
  print("wrote", path)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
