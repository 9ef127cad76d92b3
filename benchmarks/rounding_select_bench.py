r"""Token rounding's selection (`sonic_jax.pallas.rounding_select`: keys and kernel) against XLA's
(`round_tokens(method="xla")`: a sort and `lax.top_k`), over the kernel's warp counts and row
pieces.

  python -m benchmarks.rounding_select_bench [--case=40960,128,8 ...] [--mode=nearest]
      [--tile=128] [--warps=16,32] [--chunks=8192,16384] [--kernel_trace] [--out=dir]

A case T,E,K routes T tokens of random N(0, 1) logits to K of E experts (softmax top-K). Each
variant's (keep, added) is checked equal to XLA's before it is timed (median of interleaved
samples after warm-up, `benchmarks.timing`). Writes DIR/<device>_<date>_rounding_select.json and
prints a table; the file backs decisions (docs/decisions.md), not a BENCHMARKS.md table, so it
stays out of benchmarks/results/. Needs a GPU.
"""

from __future__ import annotations


from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing

FLAGS = flags.FLAGS
DEFAULT_CASES = ("40960,128,8", "24576,128,8", "16384,256,8", "32768,256,16")


def _define_flags():  # only when run as a script
  flags.DEFINE_multi_string("case", None, "case T,E,K (repeatable)")
  flags.DEFINE_enum("mode", "nearest", ["down", "up", "nearest"], "rounding mode")
  flags.DEFINE_integer("tile", 128, "rounding tile")
  flags.DEFINE_list("warps", [], "warp counts to time besides the kernel's own choice")
  flags.DEFINE_list("chunks", [], "row pieces (keys) to time besides the kernel's own choice")
  flags.DEFINE_integer("repeats", 10, "timed samples per variant (median reported)")
  flags.DEFINE_bool("kernel_trace", False, "each kernel variant's kernels (device us per call, "
                    "from a profiler trace)")
  flags.DEFINE_string("out", "bench_out", "output folder")


def selection_fn(t, tile, mode, per_expert, **kernel_kwargs):
  """(probs, ids, scores) -> (keep (T, K), added (E, J)) through the selection kernel
  (`rounding_select.select(..., **kernel_kwargs)`), as `round_tokens` calls it."""
  from sonic_jax.pallas import rounding_select

  def fn(probs, ids, scores):
    t_pad = rounding_select.padded_tokens(t, kernel_kwargs.get("chunk"))
    keys = rounding_select.selection_keys(probs, ids, scores, t_pad)
    keep_tc, added = rounding_select.select(keys, num_tokens=t, tile=tile, mode=mode,
                                            added_per_expert=per_expert, **kernel_kwargs)
    token = jax.lax.broadcasted_iota(jnp.int32, ids.shape, 0)
    return keep_tc[ids, token] > 0, added
  return fn


def run_case(t, e, k, mode, tile, repeats, variants, kernel_trace=False):
  """variants: {name: selection function of (probs, ids, scores)}, timed beside XLA's."""
  from sonic_jax import routing
  logits = jax.random.normal(jax.random.key(0), (t, e), jnp.float32)
  routed = routing.route(logits, k, "softmax_topk")
  per_expert = routing.extra_pairs_per_expert(mode, tile, t)
  args = (routed.probs, routed.expert_ids, routed.scores)

  def xla(probs, ids, scores):
    r = routing.RouterOutput(scores=scores, expert_ids=ids, probs=probs)
    return routing._select_by_xla(r, tile, mode, per_expert)  # the reference, same outputs

  calls = {"xla": (timing.compile_fn(xla, *args)[0], args)}
  want = [np.asarray(v) for v in calls["xla"][0](*args)]
  for name, make in variants.items():
    compiled = timing.compile_fn(make(t, tile, mode, per_expert), *args)[0]
    for part, got, ref in zip(("keep", "added"), compiled(*args), want):
      if not np.array_equal(np.asarray(got), ref):
        raise AssertionError(f"{name}: {part} differs from XLA's selection")
    calls[name] = (compiled, args)
  times = timing.time_interleaved(calls, repeats=repeats)
  out = [{"T": t, "E": e, "K": k, "mode": mode, "tile": tile, "variant": name,
          "us": times[name][0] * 1e6, "kernels_us": {}} for name in calls]
  if kernel_trace:
    for r in out:
      if r["variant"] != "xla":
        r["kernels_us"] = dict(timing.kernel_times(*calls[r["variant"]], top=12))
  return out


def table(results):
  return grid.variants_table(results, ("T", "E", "K"))


def default_variants(warps=(), chunks=()):
  """The kernel as configured, then at each given warp count and row piece."""
  variants = {"kernel": selection_fn}
  for w in warps:
    variants[f"warps={w}"] = lambda *a, w=int(w): selection_fn(*a, warps=w)
  for c in chunks:
    variants[f"chunk={c}"] = lambda *a, c=int(c): selection_fn(*a, chunk=c)
  return variants


def main(argv):
  del argv
  variants = default_variants(FLAGS.warps, FLAGS.chunks)
  results = []
  for case in FLAGS.case or DEFAULT_CASES:
    t, e, k = (int(v) for v in case.split(","))
    results += run_case(t, e, k, FLAGS.mode, FLAGS.tile, FLAGS.repeats, variants,
                        FLAGS.kernel_trace)
  record = grid.run_record("rounding_select_bench", results=results)
  path = grid.write_record(record, FLAGS.out, "rounding_select")
  print(table(results))
  grid.print_kernels(results, ("T", "E", "K"))
  print("wrote", path)


if __name__ == "__main__":
  _define_flags()
  app.run(main)
