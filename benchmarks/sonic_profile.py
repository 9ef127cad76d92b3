r"""SonicMoE's kernels one by one, on this GPU: device time per kernel of its forward and of its
training step (torch.profiler), to put next to `step_timeline`'s figures for sonic_jax's kernels.

Needs PyTorch and the SonicMoE bundle (`../shared/bench/sonic-wheels.sh`: carry `.sonic` and
install it as that script's header says). Usage:

  python benchmarks/sonic_profile.py [--thiek=T,d,n,E,K ...] [--calls=N] [--out=dir]

The layer is built as `../shared/bench/sonic_ref.py` builds it (softmax over the top-K, SwiGLU,
bfloat16, no bias). After two warm-up calls, `calls` back-to-back forwards and then `calls` training
steps (forward, backward from a fixed dO) are profiled; per kernel name it prints the device time
per call and the number of launches per call, largest first, and writes everything to
`out/sonic_profile.json` (after each profiled phase: on a fresh machine the first training step of
a d = 4096 configuration compiles for minutes).
"""

from __future__ import annotations

import argparse
import collections
import json
import os

DEFAULT_CONFIGS = ["32768,4096,1024,128,8", "32768,4096,2048,64,4"]


def kernel_times(prof, calls):
  """{kernel name: (us per call, launches per call)} from a torch.profiler run."""
  total, count = collections.Counter(), collections.Counter()
  for evt in prof.events():
    if evt.device_type.name != "CUDA":  # kernels and copies on the device
      continue
    total[evt.name] += evt.time_range.elapsed_us()
    count[evt.name] += 1
  return {name: (total[name] / calls, count[name] / calls) for name, _ in total.most_common()}


def sonicmoe_layer(cfg):
  """(forward, step) of SonicMoE's layer for configuration `cfg`, built as sonic_ref.py builds it:
  forward() returns the output, step() runs forward and backward from a fixed dO."""
  import torch
  from sonicmoe import MoE
  from sonicmoe.enums import ActivationType
  from sonicmoe.functional import moe_TC_softmax_topk_layer

  t, d, n, e, k = cfg
  torch.manual_seed(0)
  moe = MoE(num_experts=e, num_experts_per_tok=k, hidden_size=d, intermediate_size=n,
            activation_function=ActivationType.SWIGLU, add_bias=False,
            std=0.02).to(torch.bfloat16).cuda()
  x = (0.2 * torch.randn(t, d, device="cuda", dtype=torch.bfloat16)).requires_grad_()
  d_out = 0.2 * torch.randn_like(x)
  w1, w2, rw = moe.c_fc.weight, moe.c_proj.weight, moe.router.weight

  def forward():
    return moe_TC_softmax_topk_layer(x, rw, w1.permute(1, 2, 0), None, w2.permute(1, 2, 0), None,
                                     k, moe.stream_id, ActivationType.SWIGLU, False)[0]

  def step():
    forward().backward(d_out)
    x.grad = w1.grad = w2.grad = rw.grad = None

  return forward, step


def profile_config(cfg, calls, save):
  import torch
  forward, step = sonicmoe_layer(cfg)
  result = {}
  for name, fn in (("forward", forward), ("step", step)):
    for _ in range(2):
      fn()
    torch.cuda.synchronize()
    print(f"  {cfg} {name}: warm", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
      for _ in range(calls):
        fn()
      torch.cuda.synchronize()
    times = kernel_times(prof, calls)
    result[name] = {"kernels": {k_: {"us": us, "launches": c} for k_, (us, c) in times.items()},
                    "total_us": sum(us for us, _ in times.values())}
    save(result)  # the first compile of a training step can take minutes: keep what is done
  return result


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--thiek", action="append", help="configuration T,d,n,E,K (repeatable)")
  parser.add_argument("--calls", type=int, default=5)
  parser.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
  args = parser.parse_args()
  import torch
  out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "configs": {}}
  os.makedirs(args.out, exist_ok=True)

  def save(spec, partial):
    out["configs"][spec] = partial
    with open(os.path.join(args.out, "sonic_profile.json"), "w") as f:
      json.dump(out, f, indent=1)

  for spec in args.thiek or DEFAULT_CONFIGS:
    cfg = tuple(int(v) for v in spec.split(","))
    res = profile_config(cfg, args.calls, lambda r, spec=spec: save(spec, r))
    for name, r in res.items():
      print(f"\n{spec} {name}: {r['total_us'] / 1000:.3f} ms of kernels per call")
      for kname, v in r["kernels"].items():
        print(f"  {v['us']:9.1f} us  x{v['launches']:<4g} {kname[:110]}")
    torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
