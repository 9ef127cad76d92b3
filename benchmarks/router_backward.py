r"""The router GEMM's forward and backward: `routing.router_logits` (16-bit backward GEMMs when x
and the weight are 16-bit) against plain autodiff of the float32-result dot (the backward then
runs on float32 operands), timed in interleaved rounds, with the gradients' error against a
float64 computation.

  python -m benchmarks.router_backward [--thiek=T,d,n,E,K ...] [--out=dir]
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import grid, timing
from sonic_jax import routing

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable; default: the grid)")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_integer("repeats", 9, "timed samples per variant")
FLAGS = flags.FLAGS


def _autodiff_logits(x, w):
  return jnp.dot(x, w, preferred_element_type=jnp.float32)


def _step(logits_fn):
  def step(x, w, g):
    logits, vjp = jax.vjp(logits_fn, x, w)
    return logits, vjp(g)
  return step


def run_config(cfg):
  t, d, _, e, _ = cfg
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (t, d), jnp.bfloat16)
  w = (jax.random.normal(kw, (d, e), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (t, e), jnp.float32)
  args = (x, w, g)
  calls = {name: (timing.compile_fn(_step(fn), *args)[0], [args])
           for name, fn in (("16-bit backward", routing.router_logits),
                            ("float32 backward (autodiff)", _autodiff_logits))}
  times = timing.time_interleaved(calls, repeats=FLAGS.repeats)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in args)
  want = (g64 @ w64.T, x64.T @ g64)
  out = {"config": list(cfg)}
  for name, (compiled, _) in calls.items():
    _, grads = compiled(*args)
    errs = [float(np.linalg.norm(np.asarray(gr, np.float64) - wt) / np.linalg.norm(wt))
            for gr, wt in zip(grads, want)]
    out[name] = {"us": times[name][0] * 1e6, "rel_err_dx": errs[0], "rel_err_dw": errs[1]}
  return out


def main(_):
  configs = grid.parse_configs(FLAGS.thiek, grid.PAPER_GRID)
  results = [run_config(cfg) for cfg in configs]
  os.makedirs(FLAGS.out, exist_ok=True)
  with open(os.path.join(FLAGS.out, "router_backward.json"), "w") as f:
    json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": "python -m benchmarks.router_backward " + " ".join(sys.argv[1:]),
               "configs": results}, f, indent=1)
  for r in results:
    cells = " | ".join(f"{name}: {v['us']:.1f} us (dx {v['rel_err_dx']:.1e}, dw "
                       f"{v['rel_err_dw']:.1e})" for name, v in r.items() if name != "config")
    print(",".join(map(str, r["config"])), cells)


if __name__ == "__main__":
  app.run(main)
