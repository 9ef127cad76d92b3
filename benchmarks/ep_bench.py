r"""Expert parallelism: both sharded schemes against one device, and the cost of their collectives.

  python -m benchmarks.ep_bench [--thiek=T_local,d,n,E,K ...] [--schemes=...] [--backend=auto]
      [--out=dir]
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.ep_bench \
      --thiek=128,32,16,4,2 --backend=xla                              # 2 CPU devices

On a host of several GPUs: `PYTHONPATH=$PWD python3 -m benchmarks.ep_bench --repeats=5
--out=DIR` (or `bash benchmarks/ep_gpu.sh`); it writes DIR/<device>x<P>_<date>_ep.json for
benchmarks/results/.

With P devices (all of `jax.devices()`, or --devices), each configuration gives the work of one
device: T_local tokens per device, E experts in all (E/P per device), K per token. The run opens
with a correctness check of the dropless schemes against the single-device op at a small float32
size. Then, measured forward and forward+backward (median of repeated samples after warm-up, all
of a configuration's programs timed in alternating rounds, a sample --sample_ms (200) of
back-to-back calls, the sustained rate a training loop sees):
- `single`: `sonic_jax.moe` on one device with T_local tokens and all E experts: the same pairs per
  device as the sharded layers (T_local*K on average) without communication;
- over P devices, P*T_local tokens: `moe_all_to_all` and `moe_all_gather`, each dropless and at
  capacity factor 1.25 (with its dropped pairs);
- the collectives alone at the layers' sizes, with their bandwidth (bytes each device sends or
  receives over the links / time): each exchange (whole slots, whatever the routing), the
  all-gather of x and the combine (the all-to-all of the partial outputs and their float32 sum);
- (--profile, on by default) one traced training step of the dropless `moe_all_gather`, GPU 0's
  time split into communication (NCCL kernels and copies between GPUs), computation and
  communication hidden under computation.
At P = 2 (--memcpy_p2p's default) the sharded programs compile with XLA's
`xla_gpu_use_memcpy_local_p2p` (copies between the GPUs by their copy engines), at other P
without it (NCCL's kernels): the faster transport at each P measured (docs/decisions.md).
Printed after each configuration: step time and TFLOP/s per device and as a multiple of the
single GPU's, the communication share, the hidden share, and the layers extrapolated to 8 devices
(one node: the measured bandwidths), 16 and 64 devices (2 and 8 nodes: the cross-node share at
--inter_node_gbps per GPU, an assumption, not a measurement).
"""

from __future__ import annotations

import os
import tempfile

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import sonic_jax
from benchmarks import grid, timing
from sonic_jax import exchange
from sonic_jax.parallel import _sum_partials, moe_all_gather, moe_all_to_all, slot_capacity

DEFAULT_CONFIGS = [(16384, 1536, 512, 64, 4), (16384, 4096, 1024, 64, 4), (8192, 4096, 512, 128, 8)]
CAPACITY_FACTOR = 1.25
# name: (layer, keyword arguments)
SCHEMES = {
    "all_to_all": (moe_all_to_all, {}),
    f"all_to_all c={CAPACITY_FACTOR}": (moe_all_to_all, dict(capacity_factor=CAPACITY_FACTOR)),
    "all_gather": (moe_all_gather, {}),
    f"all_gather c={CAPACITY_FACTOR}": (moe_all_gather, dict(capacity_factor=CAPACITY_FACTOR)),
}

# The compiler option the layer's expert parallelism is measured with at P = 2 (docs/design.md).
MEMCPY_P2P = {"xla_gpu_use_memcpy_local_p2p": True}

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script: benchmarks.report imports `table`
  flags.DEFINE_multi_string("thiek", None, "per-device configuration T_local,d,n,E,K (repeatable)")
  flags.DEFINE_integer("devices", None, "expert-parallel degree P (default: all devices)")
  flags.DEFINE_string("backend", "auto", "sonic_jax backend")
  flags.DEFINE_integer("repeats", 10, "timed samples per measurement (median reported)")
  flags.DEFINE_float("sample_ms", 200.0, "back-to-back calls per sample, in ms: long enough that "
                     "a multi-device step's fixed dispatch and sync latency per sample does not "
                     "count as step time (docs/decisions.md)")
  flags.DEFINE_float("inter_node_gbps", 50.0, "assumed per-GPU cross-node bandwidth, GB/s "
                     "(400 Gb/s InfiniBand NDR), for the extrapolation to several nodes")
  flags.DEFINE_string("out", "bench_out", "output folder")
  flags.DEFINE_list("schemes", None, f"schemes to run, of {list(SCHEMES)}, each by its name or "
                    "its first word (all_to_all or all_gather: dropless and with a capacity); "
                    "default: all")
  flags.DEFINE_bool("memcpy_p2p", None, "compile the sharded programs with XLA's "
                    "xla_gpu_use_memcpy_local_p2p: copies between the GPUs of this process "
                    "(all-to-alls, collective permutes) by the copy engines instead of NCCL "
                    "kernels, which leaves the SMs to the expert kernels; default: at P = 2 only")
  flags.DEFINE_bool("profile", True, "trace one training step of each dropless all_gather run "
                    "and split GPU 0's time into communication, computation and their overlap")


def _time_all(calls, options, compiled_out=None, plain=()):
  """{name: median seconds per call} of {name: (fn, args)}, compiled first (with the compiler
  `options`, but for the names in `plain`; into `compiled_out`, {name: compiled}, where given),
  then timed in
  alternating rounds (`timing.time_interleaved`): a drift of the GPUs' clocks over the run spreads
  over the single-device op and every scheme alike."""
  # On CPU devices, one call at a time: queued collective programs can starve XLA:CPU's small thread
  # pool (every participant of a rendezvous needs a thread) and deadlock.
  cpu = jax.devices()[0].platform == "cpu"
  compiled = {name: (timing.compile_fn(fn, *args,
                                        compiler_options=None if name in plain else options)[0],
                      args)
              for name, (fn, args) in calls.items()}
  if compiled_out is not None:
    compiled_out.update({name: c for name, (c, _) in compiled.items()})
  times = timing.time_interleaved(compiled, repeats=FLAGS.repeats,
                                  min_sample_s=FLAGS.sample_ms / 1e3,
                                  max_inner=1 if cpu else 200)
  return {name: t for name, (t, _) in times.items()}


def _fwdbwd(layer):
  def step(*a):  # the training step's work, the output as its own cotangent
    y, vjp = jax.vjp(layer, *a)
    return vjp(y)
  return step


def _inputs(p, t_local, d, n, e, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (p * t_local, d), dtype)
  rw = jax.random.normal(keys[1], (d, e), jnp.float32) / np.sqrt(d)
  w1 = (jax.random.normal(keys[2], (e, d, 2 * n), jnp.float32) / np.sqrt(d)).astype(dtype)
  w2 = (jax.random.normal(keys[3], (e, n, d), jnp.float32) / np.sqrt(n)).astype(dtype)
  return x, rw, w1, w2


def _sharded(scheme, mesh, k, backend, with_aux=False):
  fn, kw = scheme

  def layer(x, rw, w1, w2):
    y, aux = fn(x, rw, w1, w2, axis_name="ep", top_k=k, backend=backend, **kw)
    return (y, aux.dropped_pairs) if with_aux else y

  return jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep")),
                       out_specs=(P("ep"), P()) if with_aux else P("ep"), check_vma=False)


def _placed(mesh, x, rw, w1, w2):
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  return put(x, P("ep")), put(rw, P()), put(w1, P("ep")), put(w2, P("ep"))


def check_against_single_device(devices, backend, runs, options=None, cfg=(256, 64, 32, 8, 2)):
  """Max relative error of output and all gradients, each scheme (compiled with the compiler
  `options`) vs `sonic_jax.moe` on one device, float32 with full-precision matmuls (skewed
  routing: empty experts, a hot device)."""
  t_local, d, n, e, k = cfg
  p = len(devices)
  e = max(e, p)
  x, rw, w1, w2 = _inputs(p, t_local, d, n, e, jnp.float32, seed=1)
  rw = rw.at[0, 0].set(3.0)  # expert 0 takes many tokens
  d_y = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
  mesh = jax.make_mesh((p,), ("ep",), devices=devices)

  def loss_of(layer, options=None):
    return jax.jit(jax.value_and_grad(lambda *a: jnp.vdot(layer(*a), d_y), argnums=(0, 1, 2, 3)),
                   compiler_options=options)

  errs = {}
  with jax.default_matmul_precision("highest"):
    single = lambda *a: sonic_jax.moe(*a, top_k=k, backend=backend)[0]
    ref_loss, ref = loss_of(single)(*[jax.device_put(a, devices[0]) for a in (x, rw, w1, w2)])
    for name, scheme in runs.items():
      if scheme[1].get("capacity_factor"):
        continue  # the dropless ones
      got_loss, got = loss_of(_sharded(scheme, mesh, k, backend), options)(
          *_placed(mesh, x, rw, w1, w2))
      host = lambda a: np.asarray(a, np.float64)
      rel = lambda a, b: (float(np.linalg.norm(host(a) - host(b)) / np.linalg.norm(host(b)))
                          if np.all(np.isfinite(host(a))) else np.inf)  # NaN never passes
      errs[name] = max([rel(got_loss, ref_loss)] + [rel(a, b) for a, b in zip(got, ref)])
  return errs


def overlap_split(events, is_communication):
  """Milliseconds of a traced step on one GPU, from its stream events [(start_ns, duration_ns,
  name)]: span (first start to last end), communication (the union of the collective kernels'
  intervals), computation (the union of the others') and hidden (communication during which
  computation also ran)."""
  def union(intervals):
    merged = []
    for start, end in sorted(intervals):
      if merged and start <= merged[-1][1]:
        merged[-1][1] = max(merged[-1][1], end)
      else:
        merged.append([start, end])
    return merged

  comm = union((s, s + d) for s, d, n in events if is_communication(n))
  comp = union((s, s + d) for s, d, n in events if not is_communication(n))
  length = lambda iv: sum(e - s for s, e in iv)
  hidden, j = 0, 0
  for s, e in comm:  # intersection of two sorted unions
    while j < len(comp) and comp[j][1] <= s:
      j += 1
    k = j
    while k < len(comp) and comp[k][0] < e:
      hidden += min(e, comp[k][1]) - max(s, comp[k][0])
      k += 1
  span = (max(s + d for s, d, _ in events) - min(s for s, _, _ in events)) if events else 0
  return {"span_ms": span / 1e6, "communication_ms": length(comm) / 1e6,
          "computation_ms": length(comp) / 1e6, "hidden_ms": hidden / 1e6}


def _is_communication(name):
  """NCCL kernels, and copies between GPUs (the trace names them "MemcpyP2P")."""
  name = name.lower()
  return "nccl" in name or ("memcpy" in name and "p2p" in name)


def profile_step(step, args, keep_events=False):
  """`overlap_split` of one traced call of `step` on the first GPU; None off a GPU. keep_events:
  with the trace's events as "events" [(start_ns, duration_ns, name, stream)]."""
  jax.block_until_ready(step(*args))
  with tempfile.TemporaryDirectory() as logdir:
    jax.profiler.start_trace(logdir)
    jax.block_until_ready(step(*args))
    jax.profiler.stop_trace()
    events = timing.device_events(logdir, gpu=0, with_stream=True)
  if not events:
    return None
  split = overlap_split([e[:3] for e in events], _is_communication)
  if keep_events:
    split["events"] = events
  split["copy_kinds"] = sorted({n for _, _, n, _ in events if "memcpy" in n.lower()})
  return split


def run_config(cfg, devices, backend, runs, options=None, profile=False):
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

  single = lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=k, backend=backend)[0]
  one = tuple(jax.device_put(a, devices[0]) for a in (x[:t_local], rw, w1, w2))
  placed = _placed(mesh, x, rw, w1, w2)
  layers = {name: _sharded(scheme, mesh, k, backend) for name, scheme in runs.items()}
  calls = {}
  for name, (layer, args) in {"single": (single, one),
                              **{n: (f, placed) for n, f in layers.items()}}.items():
    calls[(name, "fwd")], calls[(name, "fwdbwd")] = (layer, args), (_fwdbwd(layer), args)
  compiled = {}
  t = _time_all(calls, options, compiled, plain=[("single", "fwd"), ("single", "fwdbwd")])
  res.update(single_fwd_ms=t[("single", "fwd")] * 1e3,
             single_fwdbwd_ms=t[("single", "fwdbwd")] * 1e3,
             single_fwdbwd_tflops=3 * flops_per_device / t[("single", "fwdbwd")] / 1e12)
  for name, scheme in runs.items():
    fn, kw = scheme
    t_fb = t[(name, "fwdbwd")]
    _, dropped = jax.jit(_sharded(scheme, mesh, k, backend, with_aux=True))(*placed)
    res[name] = {"fwd_ms": t[(name, "fwd")] * 1e3, "fwdbwd_ms": t_fb * 1e3,
                 "dropped_pairs": int(dropped),
                 "fwdbwd_tflops_per_device": 3 * flops_per_device / t_fb / 1e12,
                 "layer": "all_gather" if fn is moe_all_gather else "all_to_all",
                 "capacity_factor": kw.get("capacity_factor")}
    if profile and fn is moe_all_gather and not kw.get("capacity_factor"):
      res[name]["profile"] = profile_step(compiled[(name, "fwdbwd")], placed)

  # The collectives alone, at the layers' sizes. Bytes each device sends (all-to-all) or receives
  # (all-gather) over the links: (P-1)/P of what it holds.
  frac = (p - 1) / p
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))

  def a2a_time(slot_rows):
    fn = jax.shard_map(lambda v: exchange.exchange(v, "ep"), mesh=mesh, in_specs=P("ep"),
                       out_specs=P("ep"), check_vma=False)
    return _time_all({"": (fn, (put(jnp.zeros((p * p * slot_rows, d), dtype), P("ep")),))},
                     options)[""]

  gbps = lambda b, t: b / t / 1e9 if p > 1 else None
  for name, (fn, kw) in runs.items():
    if fn is not moe_all_to_all:
      continue
    slot_rows = slot_capacity(t_local, k, 0, p, e // p, kw.get("capacity_factor"))
    t = a2a_time(slot_rows)
    moved = p * slot_rows * frac * d * itemsize
    # Dispatch and combine, each once more (transposed) in the backward.
    res[name].update(slot_rows=slot_rows, exchange_ms=t * 1e3, exchange_gbps=gbps(moved, t),
                     communication_ms=4 * t * 1e3)
  gathers = [name for name, (fn, _) in runs.items() if fn is moe_all_gather]
  if gathers:
    # The all-gather of x and the combine (an all-to-all of the partial outputs, summed by their
    # owner), whole; each runs once more, transposed, in the backward.
    gather = jax.shard_map(lambda v: jax.lax.all_gather(v, "ep", tiled=True), mesh=mesh,
                           in_specs=P("ep"), out_specs=P(), check_vma=False)
    combine = jax.shard_map(lambda v: _sum_partials(v, "ep"), mesh=mesh, in_specs=P(),
                            out_specs=P("ep"), check_vma=False)
    t = _time_all({"gather": (gather, (put(x, P("ep")),)),
                   "combine": (combine, (put(jnp.zeros((p * t_local, d), dtype), P()),))},
                  options)
    t_gather, t_combine = t["gather"], t["combine"]
    for name in gathers:
      res[name].update(
          all_gather_ms=t_gather * 1e3,
          all_gather_gbps=gbps(frac * p * t_local * d * itemsize, t_gather),
          combine_ms=t_combine * 1e3,
          combine_gbps=gbps(frac * p * t_local * d * itemsize, t_combine),
          communication_ms=2 * (t_gather + t_combine) * 1e3)
  return res


EXTRAPOLATED_DEVICES = (8, 16, 64)  # one, two and eight nodes of 8 GPUs


def extrapolate(res, scheme, devices, inter_node_gbps):
  """fwd+bwd ms per step at `devices` GPUs (8 per node) with the same per-device work: the
  measured single-device compute (all-gather's routing of more tokens not counted) plus
  communication not overlapped. All-to-alls (the exchanges, the all-gather scheme's combine) move
  their rows at the measured (intra-node) bandwidth, the share bound for other nodes at
  min(that, `inter_node_gbps`); the all-gather, a ring, runs at its slowest link. The all-to-all's
  slots are sized for `devices` (dropless: T_local*min(K, E_local) rows; with a capacity factor
  they shrink as 1/P)."""
  t_local, d, _, e, k = res["config"]
  item = res["x_itemsize"]
  r = res[scheme]
  if e % devices:
    return None  # E experts cannot be spread over that many devices
  frac = (devices - 1) / devices
  cross = max(0.0, 1 - 8 / devices)  # share of a device's peers on other nodes
  if r["layer"] == "all_gather":
    bws = [r["all_gather_gbps"], r["combine_gbps"]]
    if None in bws:
      return None
    ring = bws[0] if devices <= 8 else min(bws[0], inter_node_gbps)  # the ring spans the nodes
    combine = (frac - cross) / bws[1] + cross / min(bws[1], inter_node_gbps)
    comm = 2 * devices * t_local * d * item * (frac / ring + combine) / 1e9
    return res["single_fwdbwd_ms"] + comm * 1e3
  bw = r["exchange_gbps"]
  if bw is None:
    return None
  rows = devices * slot_capacity(t_local, k, 0, devices, e // devices, r["capacity_factor"])
  per_way = rows * d * item * ((frac - cross) / bw + cross / min(bw, inter_node_gbps)) / 1e9
  return res["single_fwdbwd_ms"] + 4 * per_way * 1e3


def scheme_names(res):
  """The schemes of `SCHEMES` that a configuration's results hold (benchmarks/results/ files
  also hold "all_to_all ragged", a transport docs/decisions.md records, which `SCHEMES` lacks)."""
  return [k for k, v in res.items() if k in SCHEMES and isinstance(v, dict) and "fwdbwd_ms" in v]


def table(results, inter_node_gbps):
  lines = ["| per-device config (T_local,d,n,E,K) | P | single fwd+bwd ms (TF/s) | scheme | "
           "sharded fwd+bwd ms (TF/s per device) | × single | dropped pairs | "
           "collectives ms (GB/s) | comm share | hidden | extrapolated fwd+bwd ms at 8 / 16 / 64 "
           "GPUs |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in results:
    gbps = lambda v: "–" if v is None else f"{v:.0f}"
    for scheme in scheme_names(r):
      s = r[scheme]
      if s["layer"] == "all_gather":
        coll = (f"AG {s['all_gather_ms']:.3f} ({gbps(s['all_gather_gbps'])}), combine "
                f"{s['combine_ms']:.3f} ({gbps(s['combine_gbps'])})")
      else:
        coll = f"exchange {s['exchange_ms']:.3f} ({gbps(s['exchange_gbps'])})"
      prof = s.get("profile")
      hidden = (f"{100 * prof['hidden_ms'] / prof['communication_ms']:.0f}%"
                if prof and prof["communication_ms"] else "–")
      ext = [extrapolate(r, scheme, n, inter_node_gbps) for n in EXTRAPOLATED_DEVICES]
      ext_s = " / ".join("–" if v is None else f"{v:.2f}" for v in ext)
      lines.append(
          f"| {','.join(map(str, r['config']))} | {r['devices']} | {r['single_fwdbwd_ms']:.3f} "
          f"({r['single_fwdbwd_tflops']:.0f}) | {scheme} | {s['fwdbwd_ms']:.3f} "
          f"({s['fwdbwd_tflops_per_device']:.0f}) | "
          f"{s['fwdbwd_tflops_per_device'] / r['single_fwdbwd_tflops']:.2f} | "
          f"{s['dropped_pairs']} | {coll} | "
          f"{100 * s['communication_ms'] / s['fwdbwd_ms']:.0f}% | {hidden} | {ext_s} |")
  return "\n".join(lines)


def main(_):
  devices = jax.devices()[:FLAGS.devices] if FLAGS.devices else jax.devices()
  memcpy_p2p = len(devices) == 2 if FLAGS.memcpy_p2p is None else FLAGS.memcpy_p2p
  options = dict(MEMCPY_P2P) if memcpy_p2p else {}
  configs = grid.parse_configs(FLAGS.thiek, DEFAULT_CONFIGS)
  backend = sonic_jax.backends.resolve_backend(FLAGS.backend).name
  picked = lambda name, key: name in (key, key.split()[0])
  unknown = [n for n in FLAGS.schemes or () if not any(picked(n, k) for k in SCHEMES)]
  if unknown:
    raise app.UsageError(f"--schemes: unknown {unknown}; known: {list(SCHEMES)}")
  runs = {k: v for k, v in SCHEMES.items()
          if not FLAGS.schemes or any(picked(n, k) for n in FLAGS.schemes)}
  os.makedirs(FLAGS.out, exist_ok=True)
  out = grid.run_record("ep_bench", devices, backend=backend,
                        inter_node_gbps_assumed=FLAGS.inter_node_gbps,
                        xla_flags=os.environ.get("XLA_FLAGS", ""), compiler_options=options,
                        timing=f"a configuration's programs in alternating rounds, "
                               f"{FLAGS.sample_ms:g} ms samples, median of {FLAGS.repeats}",
                        check_max_rel_err=check_against_single_device(devices, backend, runs,
                                                                      options),
                        results=[])
  print("correctness vs one device (max rel err of output and gradients):",
        out["check_max_rel_err"], flush=True)
  for cfg in configs:
    out["results"].append(run_config(cfg, devices, backend, runs, options, FLAGS.profile))
    path = grid.write_record(out, FLAGS.out, "ep")  # after each configuration
    print(table(out["results"][-1:], FLAGS.inter_node_gbps), flush=True)
  print(f"wrote {path}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
