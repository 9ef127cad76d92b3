r"""The `mosaic_gpu` layer's training step under the backend's gather policies, side by side:
where the GEMMs get their gathered rows (`backend.GATHER`: "fused" inside the kernels, "dh": the
dO rows stored by dH for dw2, "xla": gathered by XLA first).

  python -m benchmarks.backward_policy_ab [--thiek=T,d,n,E,K ...] [--policies=name ...] [--out=dir]

Each policy's step (output and gradients, as moe_bench times it) is traced and compiled with the
backend's module settings it names, its gradients compared with the first policy's (relative
error per tensor: the policies compute the same sums in the same order), then all
are timed in interleaved rounds (`timing.time_interleaved`); each one's kernels are read from a
profiler trace (`timing.kernel_times`). Needs a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os

from absl import app, flags
import jax
import numpy as np

import sonic_jax
from benchmarks import grid, timing
from sonic_jax.mosaic_gpu import backend as mosaic_backend

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_multi_string("policies", None, "a name of POLICIES (repeatable; default: all)")
flags.DEFINE_integer("repeats", 9, "timed samples per policy")
flags.DEFINE_string("out", "bench_out", "output folder")
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(32768, 4096, 1024, 128, 8), (32768, 4096, 512, 128, 8),
                   (24576, 1536, 1024, 32, 2)]

# name: the backend module's settings while the step is traced.
POLICIES = {
    "backend defaults": {},
    "dO rows stored by dH": {"GATHER": "dh"},
    "rows gathered by XLA": {"GATHER": "xla"},
}


@contextlib.contextmanager
def _settings(values):
  old = {k: getattr(mosaic_backend, k) for k in values}
  try:
    for k, v in values.items():
      setattr(mosaic_backend, k, v)
    yield
  finally:
    for k, v in old.items():
      setattr(mosaic_backend, k, v)


def run_config(cfg):
  x, rw, w1, w2, d_out = grid.random_problem(cfg)
  args = (x, rw, w1, w2, d_out)
  fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4], backend="mosaic_gpu")[0]
  names = [p for p in POLICIES if not FLAGS.policies or p in FLAGS.policies]
  records, calls, reference = {}, {}, None
  for name in names:
    with _settings(POLICIES[name]):
      compiled = timing.compile_fn(timing.forward_and_backward(fwd), *args)[0]
    y, grads = jax.block_until_ready(compiled(*args))
    got = [np.asarray(t, np.float32) for t in (y, *grads)]
    reference = got if reference is None else reference
    rel = [float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
           for g, r in zip(got, reference)]
    records[name] = {"rel_err_vs_first": rel, "finite": bool(all(np.isfinite(g).all() for g in got)),
                     "kernels_us": timing.kernel_times(compiled, args)}
    calls[name] = (compiled, args)
  for name, (t, samples) in timing.time_interleaved(calls, repeats=FLAGS.repeats).items():
    records[name].update(ms=t * 1e3, samples_ms=[v * 1e3 for v in samples])
  return {"config": list(cfg), "policies": records}


def main(_):
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "configs": [run_config(c) for c in grid.parse_configs(FLAGS.thiek, DEFAULT_CONFIGS)]}
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(os.path.join(FLAGS.out, "backward_policy_ab.json"), "w") as f:
    json.dump(results, f, indent=1)
  for r in results["configs"]:
    print(",".join(map(str, r["config"])))
    for name, v in r["policies"].items():
      top = ", ".join(f"{k[:28]} {us:.0f}" for k, us in v["kernels_us"][:6])
      print(f"  {name:34s} {v['ms']:8.3f} ms  max rel {max(v['rel_err_vs_first']):.1e}"
            f"{'' if v['finite'] else ' NaN'}  | {top}")


if __name__ == "__main__":
  app.run(main)
