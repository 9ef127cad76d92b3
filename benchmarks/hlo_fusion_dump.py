r"""Prints the optimized HLO of the layer's training step (or forward) around the fusions whose name
matches a pattern: the fusion instructions (operand and result shapes) and their computations.
Shows what XLA fused with what on this GPU (e.g. the backward's dX gather-sum with the router's
input gradient).

  python -m benchmarks.hlo_fusion_dump --thiek=T,d,n,E,K [--pattern=reduce_fusion] [--forward_only]
      [--out=dir]
"""

from __future__ import annotations

import os
import re

from absl import app, flags
import jax

import sonic_jax
from benchmarks import grid, timing

flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
flags.DEFINE_string("pattern", "reduce_fusion", "regular expression on fusion names")
flags.DEFINE_bool("forward_only", False, "the forward alone instead of the training step")
flags.DEFINE_string("out", "bench_out", "output folder (the whole HLO text goes there)")
FLAGS = flags.FLAGS


def main(_):
  os.makedirs(FLAGS.out, exist_ok=True)
  for cfg in grid.parse_configs(FLAGS.thiek, [(32768, 4096, 1024, 64, 4)]):
    x, rw, w1, w2, d_out = grid.random_problem(cfg, data="sonicmoe")
    fwd = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=cfg[4],
                                              backend="mosaic_gpu")[0]
    fn, args = ((fwd, (x, rw, w1, w2)) if FLAGS.forward_only else
                (timing.forward_and_backward(fwd), (x, rw, w1, w2, d_out)))
    text = jax.jit(fn).lower(*args).compile().as_text()
    name = grid.config_name(cfg) + ("_fwd" if FLAGS.forward_only else "_step")
    with open(os.path.join(FLAGS.out, f"hlo_{name}.txt"), "w") as f:
      f.write(text)
    pattern = re.compile(FLAGS.pattern)
    print(f"== {name}")
    lines = text.splitlines()
    for i, line in enumerate(lines):
      m = re.match(r"\s*(ROOT )?%?([\w.\-]+) = .*fusion\(", line)
      if m and pattern.search(m.group(2)):
        print(line.strip()[:600])
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:  # the fused computation's body
          start = next((j for j, l in enumerate(lines)
                        if re.match(rf"%?{re.escape(called.group(1))} ", l.strip())), None)
          if start is not None:
            for l in lines[start:start + 60]:
              print("    " + l.strip()[:300])
              if l.strip() == "}":
                break


if __name__ == "__main__":
  app.run(main)
