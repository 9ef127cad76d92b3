r"""SonicMoE's layer (PyTorch, CuTe DSL) on the paper's grid, timed as its own benchmark times it.

  python3 benchmarks/sonicmoe_bench.py [--thiek=T,d,n,E,K ...] [--out=dir]

Needs an H100 or H200 with SonicMoE importable. GPU machines have no network: on a CPU machine
`bash benchmarks/wheels.sh sonicmoe` puts SonicMoE's bundle in the ignored folder .sonic; carry
.sonic with the call, and `bash benchmarks/sonic_same_gpu.sh` installs it, runs this script and
then sonic_jax's moe_bench on the same configurations on the same GPU.

Per configuration: SonicMoE's MoE module (SwiGLU, no bias, every weight of std 0.02, bfloat16) on
x ~ 0.2 N(0, 1), softmax-over-top-K routing (`moe_TC_softmax_topk_layer`, eager PyTorch); the
forward, and the forward+backward from dO ~ 0.2 N(0, 1), each timed by triton's
`do_bench(warmup=5, rep=200, return_mode="median")`; backward = forward+backward - forward; FLOPs
as `grid.forward_flops`. "residual_bytes": the device memory that its forward leaves allocated,
less its output. The opening calls (which compile SonicMoE's kernels) are timed too. Writes
<device>_<date>_layer_sonicmoe.json in moe_bench's format (row "sonicmoe") after each
configuration, for benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import grid  # noqa: E402  (jax is imported, never initialised: torch owns the GPU)


def build(cfg, seed=0):
  """(forward, forward+backward): calls of SonicMoE's layer on configuration `cfg`'s inputs."""
  import torch
  from sonicmoe import MoE
  from sonicmoe.enums import ActivationType
  from sonicmoe.functional import moe_TC_softmax_topk_layer
  t, d, n, e, k = cfg
  torch.manual_seed(seed)
  moe = MoE(num_experts=e, num_experts_per_tok=k, hidden_size=d, intermediate_size=n,
            activation_function=ActivationType.SWIGLU, add_bias=False,
            std=0.02).to(torch.bfloat16).cuda()
  x = (0.2 * torch.randn(t, d, device="cuda", dtype=torch.bfloat16)).requires_grad_()
  d_out = 0.2 * torch.randn_like(x)
  w1, w2, rw = moe.c_fc.weight, moe.c_proj.weight, moe.router.weight

  def fwd():
    return moe_TC_softmax_topk_layer(x, rw, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None,
                                     k, moe.stream_id, ActivationType.SWIGLU, False)[0]

  def fwdbwd():
    fwd().backward(d_out)
    x.grad = w1.grad = w2.grad = rw.grad = None
  return fwd, fwdbwd


def measure(cfg):
  """moe_bench's row "sonicmoe" of configuration `cfg`; errors are recorded, not raised."""
  import torch
  from triton.testing import do_bench
  row = {"name": "sonicmoe"}
  try:
    fwd, fwdbwd = build(cfg)
    for name, call in (("first_fwd_s", fwd), ("first_fwdbwd_s", fwdbwd)):
      t0 = time.perf_counter()
      call()
      torch.cuda.synchronize()
      row[name] = time.perf_counter() - t0
      print(f"  {grid.config_name(cfg)} {name} {row[name]:.1f}", flush=True)
    t_fwd = do_bench(fwd, warmup=5, rep=200, return_mode="median")
    t_fb = do_bench(fwdbwd, warmup=5, rep=200, return_mode="median")
    flops = grid.forward_flops(cfg)
    row.update(fwd_ms=t_fwd, fwdbwd_ms=t_fb, bwd_ms=t_fb - t_fwd,
               fwd_tflops=flops / t_fwd / 1e9, bwd_tflops=2 * flops / (t_fb - t_fwd) / 1e9,
               fwdbwd_tflops=3 * flops / t_fb / 1e9)
    base = torch.cuda.memory_allocated()
    out = fwd()
    torch.cuda.synchronize()
    row["residual_bytes"] = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    del out, fwd, fwdbwd
    torch.cuda.empty_cache()
  except Exception as e:  # out of memory, a compile error: record and go on
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    traceback.print_exc()
  return row


def run_record():
  import importlib.metadata
  import torch
  return {"device": torch.cuda.get_device_name(), "devices": 1, "platform": "gpu",
          "sonicmoe": importlib.metadata.version("sonic-moe"), "torch": torch.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "command": "python3 benchmarks/sonicmoe_bench.py " + " ".join(sys.argv[1:]),
          "timing": "do_bench", "data": "sonicmoe", "router_dtype": "bfloat16"}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--thiek", action="append", help="configuration T,d,n,E,K (repeatable; "
                      "default: the paper's grid)")
  parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="output folder")
  args = parser.parse_args()
  rec = run_record()
  print(json.dumps(rec), flush=True)
  results = {"environment": rec, "configs": []}
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, grid.results_name(rec, "layer_sonicmoe"))
  for cfg in grid.parse_configs(args.thiek, grid.PAPER_GRID):
    row = measure(cfg)
    print(grid.config_name(cfg), json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                             for k, v in row.items()}), flush=True)
    results["configs"].append({"config": list(cfg), "name": grid.config_name(cfg), "rows": [row]})
    with open(path, "w") as f:
      json.dump(results, f, indent=1)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
