r"""Expert parallelism: the sharded layer against one device, and the cost of its collectives.

  python -m benchmarks.ep_bench [--thiek=T_local,d,n,E,K ...] [--backend=auto] [--out=dir]

With P devices (all of `jax.devices()`, or --devices), each configuration gives the work of one
device: T_local tokens per device, E experts in all (E/P per device), K per token. Measured, forward
and forward+backward (median of repeated runs after warm-up):
- `sharded`: `moe_all_gather` over P devices, P*T_local tokens (the same per-device work as below);
- `single`: `sonic_jax.moe` on one device with T_local tokens and all E experts: the same pairs per
  device as the sharded layer (T_local*K on average) without communication;
- the collectives alone, at the layer's sizes: the all-gather of x (T_local -> P*T_local rows) and
  the reduce-scatter of y (float32), with their bus bandwidth (bytes moved per device / time).
Printed last: step time and TFLOP/s per device for both, the communication share, and the same layer
extrapolated to 8 and 64 devices from the measured bandwidths (the gather-based scheme moves
2 (P-1)/P * T*d values per device each way, so its cost grows with the global token count).
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import sonic_jax
from benchmarks import grid, timing
from sonic_jax.parallel import moe_all_gather

DEFAULT_CONFIGS = [(16384, 1536, 512, 64, 4), (16384, 4096, 1024, 64, 4), (8192, 4096, 512, 128, 8)]

flags.DEFINE_multi_string("thiek", None, "per-device configuration T_local,d,n,E,K (repeatable)")
flags.DEFINE_integer("devices", None, "expert-parallel degree P (default: all devices)")
flags.DEFINE_string("backend", "auto", "sonic_jax backend")
flags.DEFINE_integer("repeats", 10, "timed samples per measurement (median reported)")
flags.DEFINE_string("out", "bench_out", "output folder")
FLAGS = flags.FLAGS


def _time(fn, *args):
  # On CPU devices, one call at a time: queued collective programs can starve XLA:CPU's small thread
  # pool (every participant of a rendezvous needs a thread) and deadlock.
  cpu = jax.devices()[0].platform == "cpu"
  return timing.time_fn(fn, *args, repeats=FLAGS.repeats, max_inner=1 if cpu else 200)


def _fwd_and_fwdbwd(layer, *args):
  def fwdbwd(*a):
    y, vjp = jax.vjp(layer, *a)
    return vjp(y)
  return _time(layer, *args), _time(fwdbwd, *args)


def run_config(cfg, devices, backend):
  t_local, d, n, e, k = cfg
  p = len(devices)
  if e % p:
    raise ValueError(f"E={e} is not a multiple of the {p} devices")
  dtype = jnp.bfloat16 if devices[0].platform == "gpu" else jnp.float32
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (p * t_local, d), dtype)
  rw = jax.random.normal(keys[1], (d, e), jnp.float32) / np.sqrt(d)
  w1 = (jax.random.normal(keys[2], (e, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(dtype)
  w2 = (jax.random.normal(keys[3], (e, n, d), jnp.float32) / np.sqrt(n)).astype(dtype)
  mesh = jax.make_mesh((p,), ("ep",), devices=devices)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))

  sharded = jax.shard_map(
      lambda x, rw, w1, w2: moe_all_gather(x, rw, w1, w2, axis_name="ep", top_k=k,
                                           backend=backend)[0],
      mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep"), check_vma=False)
  args = (put(x, P("ep")), put(rw, P()), put(w1, P("ep")), put(w2, P("ep")))
  t_sh_fwd, t_sh_fb = _fwd_and_fwdbwd(sharded, *args)

  one = devices[0]
  single = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=k, backend=backend)[0]
  args1 = [jax.device_put(a, one) for a in (x[:t_local], rw, w1, w2)]
  t_1_fwd, t_1_fb = _fwd_and_fwdbwd(single, *args1)

  gather = jax.shard_map(lambda v: jax.lax.all_gather(v, "ep", tiled=True), mesh=mesh,
                         in_specs=P("ep"), out_specs=P(), check_vma=False)
  y32 = jnp.zeros((p * t_local, d), jnp.float32)
  scatter = jax.shard_map(lambda v: jax.lax.psum_scatter(v, "ep", tiled=True), mesh=mesh,
                          in_specs=P(), out_specs=P("ep"), check_vma=False)
  t_gather = _time(gather, put(x, P("ep")))
  t_scatter = _time(scatter, put(y32, P()))
  # Bytes each device receives (all-gather) or sends (reduce-scatter): (P-1)/P of the full array.
  frac = (p - 1) / p
  gather_bytes = frac * p * t_local * d * jnp.dtype(dtype).itemsize
  scatter_bytes = frac * p * t_local * d * 4
  flops_per_device = grid.forward_flops((t_local, d, n, e, k))
  return {
      "config": list(cfg), "devices": p, "device_kind": one.device_kind,
      "x_itemsize": jnp.dtype(dtype).itemsize,
      "sharded_fwd_ms": t_sh_fwd * 1e3, "sharded_fwdbwd_ms": t_sh_fb * 1e3,
      "single_fwd_ms": t_1_fwd * 1e3, "single_fwdbwd_ms": t_1_fb * 1e3,
      "sharded_fwdbwd_tflops_per_device": 3 * flops_per_device / t_sh_fb / 1e12,
      "single_fwdbwd_tflops": 3 * flops_per_device / t_1_fb / 1e12,
      "all_gather_ms": t_gather * 1e3, "reduce_scatter_ms": t_scatter * 1e3,
      "all_gather_gbps": gather_bytes / t_gather / 1e9 if p > 1 else None,
      "reduce_scatter_gbps": scatter_bytes / t_scatter / 1e9 if p > 1 else None,
      # Forward: one all-gather and one reduce-scatter; the backward runs their transposes.
      "communication_ms_fwdbwd": 2 * (t_gather + t_scatter) * 1e3,
  }


def extrapolate(res, devices):
  """fwd+bwd ms per step at `devices` GPUs with the same per-device work, from the measured
  single-device compute and collective bandwidths (communication not overlapped)."""
  t_local, d = res["config"][0], res["config"][1]
  gbps = [res["all_gather_gbps"], res["reduce_scatter_gbps"]]
  if None in gbps:
    return None
  frac = (devices - 1) / devices
  comm = 2 * frac * devices * t_local * d * (res["x_itemsize"] / gbps[0] + 4 / gbps[1]) / 1e9
  return res["single_fwdbwd_ms"] + comm * 1e3


def table(results):
  lines = ["| per-device config (T_local,d,n,E,K) | P | single fwd+bwd ms (TF/s) | sharded fwd+bwd ms "
           "(TF/s per device) | all-gather ms (GB/s) | reduce-scatter ms (GB/s) | comm share | "
           "extrapolated fwd+bwd ms at 8 / 64 devices |", "|---|---|---|---|---|---|---|---|"]
  for r in results:
    gbps = lambda v: "–" if v is None else f"{v:.0f}"
    ext = [extrapolate(r, n) for n in (8, 64)]
    ext_s = " / ".join("–" if v is None else f"{v:.2f}" for v in ext)
    lines.append(
        f"| {','.join(map(str, r['config']))} | {r['devices']} | {r['single_fwdbwd_ms']:.3f} "
        f"({r['single_fwdbwd_tflops']:.0f}) | {r['sharded_fwdbwd_ms']:.3f} "
        f"({r['sharded_fwdbwd_tflops_per_device']:.0f}) | {r['all_gather_ms']:.3f} "
        f"({gbps(r['all_gather_gbps'])}) | {r['reduce_scatter_ms']:.3f} "
        f"({gbps(r['reduce_scatter_gbps'])}) | "
        f"{100 * r['communication_ms_fwdbwd'] / r['sharded_fwdbwd_ms']:.0f}% | {ext_s} |")
  return "\n".join(lines)


def main(_):
  devices = jax.devices()[:FLAGS.devices] if FLAGS.devices else jax.devices()
  configs = ([tuple(int(v) for v in s.split(",")) for s in FLAGS.thiek] if FLAGS.thiek
             else DEFAULT_CONFIGS)
  backend = sonic_jax.backends.resolve_backend(FLAGS.backend).name
  os.makedirs(FLAGS.out, exist_ok=True)
  results = []
  for cfg in configs:
    results.append(run_config(cfg, devices, backend))
    with open(os.path.join(FLAGS.out, "ep.json"), "w") as f:
      json.dump({"jax": jax.__version__, "backend": backend, "results": results}, f, indent=1)
    print(table(results[-1:]), flush=True)
  with open(os.path.join(FLAGS.out, "ep.md"), "w") as f:
    f.write(table(results) + "\n")


if __name__ == "__main__":
  app.run(main)
