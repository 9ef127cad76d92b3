r"""Expert parallelism: both sharded schemes against one device, and the cost of their collectives.

  python -m benchmarks.ep_bench [--thiek=T_local,d,n,E,K ...] [--backend=auto] [--out=dir]

With P devices (all of `jax.devices()`, or --devices), each configuration gives the work of one
device: T_local tokens per device, E experts in all (E/P per device), K per token. First a
correctness check of both schemes against the single-device op at a small float32 size (on GPUs the
all-to-all runs the native ragged-all-to-all, which the CPU tests cannot reach). Then, measured
forward and forward+backward (median of repeated runs after warm-up):
- `single`: `sonic_jax.moe` on one device with T_local tokens and all E experts: the same pairs per
  device as the sharded layers (T_local*K on average) without communication;
- `all_to_all`: `moe_all_to_all` over P devices, P*T_local tokens, dropless (worst-case buffers);
- `all_gather`: `moe_all_gather`, the same;
- the collectives alone at the layers' sizes, with their bandwidth (bytes each device sends or
  receives / time): the ragged all-to-all of the T_local*K rows of x (balanced), the all-gather of
  x and the reduce-scatter of y (float32).
Printed last: step time and TFLOP/s per device, the communication share, and the layers
extrapolated to 8 devices (one node: the measured bandwidths) and 64 devices (8 nodes: the
all-to-all's cross-node share at --inter_node_gbps per GPU, an assumption, not a measurement).
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
from sonic_jax import exchange
from sonic_jax.parallel import moe_all_gather, moe_all_to_all

DEFAULT_CONFIGS = [(16384, 1536, 512, 64, 4), (16384, 4096, 1024, 64, 4), (8192, 4096, 512, 128, 8)]
SCHEMES = {"all_to_all": moe_all_to_all, "all_gather": moe_all_gather}

flags.DEFINE_multi_string("thiek", None, "per-device configuration T_local,d,n,E,K (repeatable)")
flags.DEFINE_integer("devices", None, "expert-parallel degree P (default: all devices)")
flags.DEFINE_string("backend", "auto", "sonic_jax backend")
flags.DEFINE_integer("repeats", 10, "timed samples per measurement (median reported)")
flags.DEFINE_float("inter_node_gbps", 50.0, "assumed per-GPU cross-node bandwidth, GB/s (400 Gb/s "
                   "InfiniBand NDR), for the 64-device extrapolation")
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


def _inputs(p, t_local, d, n, e, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (p * t_local, d), dtype)
  rw = jax.random.normal(keys[1], (d, e), jnp.float32) / np.sqrt(d)
  w1 = (jax.random.normal(keys[2], (e, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(dtype)
  w2 = (jax.random.normal(keys[3], (e, n, d), jnp.float32) / np.sqrt(n)).astype(dtype)
  return x, rw, w1, w2


def _sharded(scheme, mesh, k, backend):
  layer = lambda x, rw, w1, w2: SCHEMES[scheme](x, rw, w1, w2, axis_name="ep", top_k=k,
                                                backend=backend)[0]
  return jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep")),
                       out_specs=P("ep"), check_vma=False)


def _placed(mesh, x, rw, w1, w2):
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  return put(x, P("ep")), put(rw, P()), put(w1, P("ep")), put(w2, P("ep"))


def check_against_single_device(devices, backend, cfg=(256, 64, 32, 8, 2)):
  """Max relative error of output and all gradients, each scheme vs `sonic_jax.moe` on one
  device, float32 with full-precision matmuls (skewed routing: empty experts, a hot device)."""
  t_local, d, n, e, k = cfg
  p = len(devices)
  e = max(e, p)
  x, rw, w1, w2 = _inputs(p, t_local, d, n, e, jnp.float32, seed=1)
  rw = rw.at[0, 0].set(3.0)  # expert 0 takes many tokens
  d_y = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  mesh = jax.make_mesh((p,), ("ep",), devices=devices)

  def loss_of(layer):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.vdot(layer(*a), d_y), argnums=(0, 1, 2, 3)))

  errs = {}
  with jax.default_matmul_precision("highest"):
    single = lambda *a: sonic_jax.moe(*a, top_k=k, backend=backend)[0]
    ref_loss, ref = loss_of(single)(*[jax.device_put(a, devices[0]) for a in (x, rw, w1, w2)])
    for scheme in SCHEMES:
      got_loss, got = loss_of(_sharded(scheme, mesh, k, backend))(*_placed(mesh, x, rw, w1, w2))
      host = lambda a: np.asarray(a, np.float64)
      rel = lambda a, b: float(np.linalg.norm(host(a) - host(b)) / np.linalg.norm(host(b)))
      errs[scheme] = max([rel(got_loss, ref_loss)] + [rel(a, b) for a, b in zip(got, ref)])
  return errs


def _balanced_plan(p, e_local, rows_per_device):
  """The exchange plan of a perfectly balanced routing: every device sends rows/P to each."""
  counts = np.full((p, p * e_local), rows_per_device // (p * e_local), np.int32)
  return [exchange.exchange_plan(jnp.asarray(counts), jnp.int32(me), rows_per_device)[0]
          for me in range(p)]


def run_config(cfg, devices, backend):
  t_local, d, n, e, k = cfg
  p = len(devices)
  if e % p:
    raise ValueError(f"E={e} is not a multiple of the {p} devices")
  dtype = jnp.bfloat16 if devices[0].platform == "gpu" else jnp.float32
  itemsize = jnp.dtype(dtype).itemsize
  x, rw, w1, w2 = _inputs(p, t_local, d, n, e, dtype)
  mesh = jax.make_mesh((p,), ("ep",), devices=devices)
  res = {"config": list(cfg), "devices": p, "device_kind": devices[0].device_kind,
         "x_itemsize": itemsize}
  flops_per_device = grid.forward_flops((t_local, d, n, e, k))

  one = devices[0]
  single = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=k, backend=backend)[0]
  t_fwd, t_fb = _fwd_and_fwdbwd(single, *[jax.device_put(a, one) for a in (x[:t_local], rw, w1,
                                                                           w2)])
  res.update(single_fwd_ms=t_fwd * 1e3, single_fwdbwd_ms=t_fb * 1e3,
             single_fwdbwd_tflops=3 * flops_per_device / t_fb / 1e12)
  for scheme in SCHEMES:
    t_fwd, t_fb = _fwd_and_fwdbwd(_sharded(scheme, mesh, k, backend),
                                  *_placed(mesh, x, rw, w1, w2))
    res[scheme] = {"fwd_ms": t_fwd * 1e3, "fwdbwd_ms": t_fb * 1e3,
                   "fwdbwd_tflops_per_device": 3 * flops_per_device / t_fb / 1e12}

  # The collectives alone. Bytes each device sends (all-to-all, reduce-scatter) or receives
  # (all-gather) over the links: (P-1)/P of what it holds.
  frac = (p - 1) / p
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  rows = t_local * k
  plans = _balanced_plan(p, e // p, rows)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *plans)

  def a2a(v, plan):
    plan = jax.tree.map(lambda a: a[0], plan)
    return exchange.ragged_exchange(v, rows, plan, "ep")

  a2a_fn = jax.shard_map(a2a, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=P("ep"),
                         check_vma=False)
  gather = jax.shard_map(lambda v: jax.lax.all_gather(v, "ep", tiled=True), mesh=mesh,
                         in_specs=P("ep"), out_specs=P(), check_vma=False)
  scatter = jax.shard_map(lambda v: jax.lax.psum_scatter(v, "ep", tiled=True), mesh=mesh,
                          in_specs=P(), out_specs=P("ep"), check_vma=False)
  t_a2a = _time(a2a_fn, put(jnp.zeros((p * rows, d), dtype), P("ep")),
                jax.tree.map(lambda a: put(a, P("ep")), stacked))
  t_gather = _time(gather, put(x, P("ep")))
  t_scatter = _time(scatter, put(jnp.zeros((p * t_local, d), jnp.float32), P()))
  a2a_bytes = frac * rows * d * itemsize
  gather_bytes = frac * p * t_local * d * itemsize
  scatter_bytes = frac * p * t_local * d * 4
  gbps = lambda b, t: b / t / 1e9 if p > 1 else None
  res.update(
      all_to_all_ms=t_a2a * 1e3, all_to_all_gbps=gbps(a2a_bytes, t_a2a),
      all_gather_ms=t_gather * 1e3, all_gather_gbps=gbps(gather_bytes, t_gather),
      reduce_scatter_ms=t_scatter * 1e3, reduce_scatter_gbps=gbps(scatter_bytes, t_scatter))
  # Per step (forward + backward): all-to-all dispatch and combine, each once more transposed in
  # the backward; all-gather + reduce-scatter, likewise.
  res["all_to_all"]["communication_ms"] = 4 * t_a2a * 1e3
  res["all_gather"]["communication_ms"] = 2 * (t_gather + t_scatter) * 1e3
  return res


def extrapolate(res, scheme, devices, inter_node_gbps):
  """fwd+bwd ms per step at `devices` GPUs (8 per node) with the same per-device work: the
  measured single-device compute plus communication at the measured (intra-node) bandwidth, the
  all-to-all's cross-node share at `inter_node_gbps`; communication not overlapped."""
  t_local, d, _, _, k = res["config"]
  item = res["x_itemsize"]
  frac = (devices - 1) / devices
  if scheme == "all_to_all":
    bw = res["all_to_all_gbps"]
    if bw is None:
      return None
    cross = max(0.0, 1 - 8 / devices)  # share of a device's rows bound for other nodes
    slow = min(bw, inter_node_gbps)
    per_way = t_local * k * d * item * ((frac - cross) / bw + cross / slow) / 1e9
    comm = 4 * per_way
  else:
    bws = [res["all_gather_gbps"], res["reduce_scatter_gbps"]]
    if None in bws:
      return None
    slowest = lambda b: b if devices <= 8 else min(b, inter_node_gbps)  # ring over all nodes
    comm = 2 * frac * devices * t_local * d * (item / slowest(bws[0]) + 4 / slowest(bws[1])) / 1e9
  return res["single_fwdbwd_ms"] + comm * 1e3


def table(results, inter_node_gbps):
  lines = ["| per-device config (T_local,d,n,E,K) | P | single fwd+bwd ms (TF/s) | scheme | sharded "
           "fwd+bwd ms (TF/s per device) | collectives ms (GB/s) | comm share | extrapolated "
           "fwd+bwd ms at 8 / 64 GPUs |", "|---|---|---|---|---|---|---|---|"]
  for r in results:
    gbps = lambda v: "–" if v is None else f"{v:.0f}"
    for scheme in SCHEMES:
      s = r[scheme]
      if scheme == "all_to_all":
        coll = f"a2a {r['all_to_all_ms']:.3f} ({gbps(r['all_to_all_gbps'])})"
      else:
        coll = (f"AG {r['all_gather_ms']:.3f} ({gbps(r['all_gather_gbps'])}), RS "
                f"{r['reduce_scatter_ms']:.3f} ({gbps(r['reduce_scatter_gbps'])})")
      ext = [extrapolate(r, scheme, n, inter_node_gbps) for n in (8, 64)]
      ext_s = " / ".join("–" if v is None else f"{v:.2f}" for v in ext)
      lines.append(
          f"| {','.join(map(str, r['config']))} | {r['devices']} | {r['single_fwdbwd_ms']:.3f} "
          f"({r['single_fwdbwd_tflops']:.0f}) | {scheme} | {s['fwdbwd_ms']:.3f} "
          f"({s['fwdbwd_tflops_per_device']:.0f}) | {coll} | "
          f"{100 * s['communication_ms'] / s['fwdbwd_ms']:.0f}% | {ext_s} |")
  return "\n".join(lines)


def main(_):
  devices = jax.devices()[:FLAGS.devices] if FLAGS.devices else jax.devices()
  configs = ([tuple(int(v) for v in s.split(",")) for s in FLAGS.thiek] if FLAGS.thiek
             else DEFAULT_CONFIGS)
  backend = sonic_jax.backends.resolve_backend(FLAGS.backend).name
  os.makedirs(FLAGS.out, exist_ok=True)
  out = {"jax": jax.__version__, "backend": backend,
         "native_ragged_all_to_all": exchange.native_ragged_all_to_all(),
         "inter_node_gbps_assumed": FLAGS.inter_node_gbps,
         "check_max_rel_err": check_against_single_device(devices, backend), "results": []}
  print("correctness vs one device (max rel err of output and gradients):",
        out["check_max_rel_err"], flush=True)
  for cfg in configs:
    out["results"].append(run_config(cfg, devices, backend))
    with open(os.path.join(FLAGS.out, "ep.json"), "w") as f:
      json.dump(out, f, indent=1)
    print(table(out["results"][-1:], FLAGS.inter_node_gbps), flush=True)
  with open(os.path.join(FLAGS.out, "ep.md"), "w") as f:
    f.write(table(out["results"], FLAGS.inter_node_gbps) + "\n")


if __name__ == "__main__":
  app.run(main)
