r"""Registers and spills of the layer's kernels, from ptxas (on a GPU machine, where they compile).

  python -m tools.ptxas_report [--thiek=T,d,n,E,K ...] [--out=dir] [--ptx_opcodes=tanh,...]
      [--keep_ptx=down,...]

On a GPU machine: `PYTHONPATH=$PWD python3 -m tools.ptxas_report --out=$OUT`.

Compiles the forward kernels of each configuration (the up-projection in both gate/up layouts,
the down-projection) and the backward ones (dH in both layouts, dX, the weight gradients), as the
backend configures them, with Mosaic GPU's `MOSAIC_GPU_DUMP_PTXAS` / `MOSAIC_GPU_DUMP_TO`, and
prints each kernel's ptxas summary lines (registers used, spill stores and loads). A kernel that
spills is a kernel whose epilogue or mainloop waits on local memory. Writes the lines to
`ptxas_report.txt` under --out. With --ptx_opcodes, also dumps each kernel's PTX
(`MOSAIC_GPU_DUMP_PTX`; the device image has no nvdisasm for SASS) and counts the static
instructions whose opcode starts with one of the given prefixes (e.g. tanh, ex2, rcp, div: what an
epilogue, unrolled as it is, issues per tile).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile

from absl import app, flags
import jax
import jax.numpy as jnp

import sonic_jax
from benchmarks import grid
from sonic_jax import activations as acts
from sonic_jax.mosaic_gpu import backend as mb

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_string("out", "bench_out", "output folder")
flags.DEFINE_list("ptx_opcodes", [], "PTX opcode prefixes to count per kernel (e.g. tanh,div)")
flags.DEFINE_list("keep_ptx", [], "kernels (names as printed, e.g. down) whose PTX is copied to "
                  "--out (ptx_<config>_<kernel>_<i>.ptx), to read what the compiler made of them")
FLAGS = flags.FLAGS

DEFAULT_CONFIGS = [(40960, 768, 256, 128, 8), (32768, 4096, 1024, 128, 8)]


def kernels(cfg):
  """{name: (fn, args)} of the layer's Mosaic GPU kernels for configuration `cfg`."""
  _, _, n, _, _ = cfg
  act = acts.get_activation("swiglu")
  x, rw, w1, w2, d_out = grid.random_problem(cfg)
  _, layout = jax.jit(grid.route_fn(cfg))(x, rw)
  rows = layout.num_rows
  h = jnp.zeros((rows, 2 * n), jnp.bfloat16)
  a = jnp.zeros((rows, n), jnp.bfloat16)
  scores = jnp.zeros((rows,), jnp.float32)
  c = sonic_jax.Config()
  out = {}
  for gate_up in acts.GATE_UP_LAYOUTS:
    out[f"up ({gate_up})"] = (
        lambda x, w1, g=gate_up: mb.up_projection(x, w1, None, layout, act, g, config=c), (x, w1))
    out[f"dH ({gate_up})"] = (
        lambda g_, h, s, w2, g=gate_up: mb.dh_projection(g_, h, s, w2, None, layout, act, g,
                                                         config=c), (d_out, h, scores, w2))
  out["down"] = (lambda a, w2: mb.down_projection(a, w2, None, layout, config=c), (a, w2))
  out["dX rows"] = (lambda d_h, w1: mb.dx_projection(d_h, w1, layout, config=c), (h, w1))
  out["weight grads"] = (
      lambda x, g_, d_h, a_s, s: mb.weight_grads(x, g_, None, d_h, a_s, s, layout, False, False,
                                                 config=c), (x, d_out, h, a, scores))
  return out


def ptx_counts(dump, prefixes):
  """Lines 'PTX <opcode>: <static count>' for the opcodes with one of `prefixes`, over the PTX
  files that Mosaic GPU dumped into `dump`."""
  counts = {}
  for path in sorted(glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True)):
    with open(path, errors="replace") as f:
      for ln in f:
        m = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][a-z0-9_.:]*)", ln)
        if m and m.group(1).startswith(tuple(prefixes)):
          counts[m.group(1)] = counts.get(m.group(1), 0) + 1
  if not counts:
    return [f"(no PTX instruction matched; files: {os.listdir(dump)})"]
  return [f"PTX {op}: {n}" for op, n in sorted(counts.items())]


def main(_):
  os.makedirs(FLAGS.out, exist_ok=True)
  lines = []
  for cfg in grid.parse_configs(FLAGS.thiek, DEFAULT_CONFIGS):
    for name, (fn, args) in kernels(cfg).items():
      with tempfile.TemporaryDirectory() as dump:
        dumps = {"MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_TO": dump}
        if FLAGS.ptx_opcodes or name in FLAGS.keep_ptx:
          dumps["MOSAIC_GPU_DUMP_PTX"] = "1"
        os.environ.update(dumps)
        try:
          jax.jit(fn).lower(*args).compile()
        finally:
          for key in dumps:
            del os.environ[key]
        found = []
        for path in sorted(glob.glob(os.path.join(dump, "**", "*"), recursive=True)):
          if os.path.isfile(path) and "ptxas" in os.path.basename(path):
            with open(path, errors="replace") as f:
              found += [ln.strip() for ln in f
                        if re.search(r"registers|spill|Compiling entry|injected", ln)]
        if not found:
          found = [f"(no ptxas dump; files: {os.listdir(dump)})"]
        if FLAGS.ptx_opcodes:
          found += ptx_counts(dump, FLAGS.ptx_opcodes)
        if name in FLAGS.keep_ptx:
          for i, path in enumerate(sorted(glob.glob(os.path.join(dump, "**", "*.ptx"),
                                                    recursive=True))):
            tag = re.sub(r"\W+", "_", f"{'_'.join(map(str, cfg))}_{name}_{i}")
            shutil.copy(path, os.path.join(FLAGS.out, f"ptx_{tag}.ptx"))
      lines.append(f"{','.join(map(str, cfg))} {name}:")
      lines += [f"  {ln}" for ln in found]
      print("\n".join(lines[-len(found) - 1:]), flush=True)
  with open(os.path.join(FLAGS.out, "ptxas_report.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  app.run(main)
