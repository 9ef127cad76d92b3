r"""XLA compiler options for expert parallelism, compared in one process.

  python -m benchmarks.ep_options_bench [--thiek=T_local,d,n,E,K ...] [--scheme=all_gather]
      [--option_set=NAME:option=value,... ...] [--sample_ms=25,200] [--repeats=7] [--hlo]
      [--out=dir]
  XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m benchmarks.ep_options_bench \
      --thiek=128,32,16,4,2 --backend=xla                               # 2 CPU devices

A scheme's training step (forward and backward, the output as its own cotangent; `ep_bench`'s
layers over all of `jax.devices()`) is compiled once per option set with those options as
`jax.jit(..., compiler_options=...)`, beside the single-device step (`sonic_jax.moe`, T_local
tokens and all E experts on the first device). All of a configuration's programs are timed in
alternating rounds (`timing.time_interleaved`) at each --sample_ms, so the option sets are
compared under the same clocks, which XLA_FLAGS set per process cannot give. Each set's step is
also traced once and GPU 0's time split into communication and computation
(`ep_bench.overlap_split`). The defaults compare NCCL with XLA's memcpy peer copies, the choice
that docs/decisions.md records. Printed last: per configuration and sample length, each step's
milliseconds and the single-device step over it. Its results back decisions, not a table: they
stay out of benchmarks/results/ (the report refuses them there).
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import jax
import jax.numpy as jnp

import sonic_jax
from benchmarks import ep_bench, grid, timing

DEFAULT_CONFIGS = [(16384, 4096, 1024, 64, 4), (8192, 4096, 512, 128, 8)]
DEFAULT_SETS = ["nccl:", "memcpy:xla_gpu_use_memcpy_local_p2p=true"]

FLAGS = flags.FLAGS


def _define_flags():  # only when run as a script, as ep_bench does
  flags.DEFINE_multi_string("thiek", None, "per-device configuration T_local,d,n,E,K (repeatable)")
  flags.DEFINE_string("scheme", "all_gather", f"the layer, of {list(ep_bench.SCHEMES)}")
  flags.DEFINE_multi_string("option_set", DEFAULT_SETS, "NAME:option=value,... (repeatable): "
                            "XLA compiler options of one compilation; values true/false, "
                            "integers or strings")
  flags.DEFINE_list("sample_ms", ["25", "200"], "sample lengths, ms of back-to-back calls")
  flags.DEFINE_integer("repeats", 7, "samples per program and sample length (median reported)")
  flags.DEFINE_string("backend", "auto", "sonic_jax backend")
  flags.DEFINE_string("out", "bench_out", "output folder")
  flags.DEFINE_bool("hlo", False, "also write each option set's optimized HLO (its schedule: "
                    "which kernels XLA put between a collective's start and done) and its traced "
                    "step's GPU 0 events (start ns, duration ns, name, stream) to the out folder")

def parse_option_set(text):
  """"NAME:a=1,b=true" -> ("NAME", {"a": 1, "b": True}); "NAME:" has no options."""
  name, sep, body = text.partition(":")
  if not name or not sep:
    raise app.UsageError(f"--option_set={text!r}: expected NAME:option=value,...")
  options = {}
  for item in filter(None, body.split(",")):
    key, eq, value = item.partition("=")
    if not key or not eq:
      raise app.UsageError(f"--option_set={text!r}: {item!r} is not option=value")
    low = value.lower()
    options[key] = (low == "true" if low in ("true", "false")
                    else int(value) if value.lstrip("-").isdigit() else value)
  return name, options


def run_config(cfg, devices, backend, scheme, option_sets, sample_ms):
  t_local, d, n, e, k = cfg
  p = len(devices)
  if e % p:
    raise ValueError(f"E={e} is not a multiple of the {p} devices")
  cpu = devices[0].platform == "cpu"
  x, rw, w1, w2 = ep_bench._inputs(p, t_local, d, n, e, jnp.float32 if cpu else jnp.bfloat16)
  mesh = jax.make_mesh((p,), ("ep",), devices=devices)
  placed = ep_bench._placed(mesh, x, rw, w1, w2)
  one = tuple(jax.device_put(a, devices[0]) for a in (x[:t_local], rw, w1, w2))
  single = ep_bench._fwdbwd(
      lambda x, rw, w1, w2: sonic_jax.moe(x, rw, w1, w2, top_k=k, backend=backend)[0])
  step = ep_bench._fwdbwd(ep_bench._sharded(ep_bench.SCHEMES[scheme], mesh, k, backend))
  calls = {"single": (jax.jit(single).lower(*one).compile(), one)}
  for name, options in option_sets.items():
    calls[name] = (jax.jit(step, compiler_options=options).lower(*placed).compile(), placed)
  flops = 3 * grid.forward_flops(cfg)
  res = {"config": list(cfg), "devices": p, "fwdbwd_flops_per_device": flops, "timings": [],
         "profiles": {}}
  for ms in sample_ms:
    t = timing.time_interleaved(calls, repeats=FLAGS.repeats, min_sample_s=ms / 1e3,
                                max_inner=1 if cpu else 200)
    res["timings"].append({"sample_ms": ms, **{name: v[0] * 1e3 for name, v in t.items()}})
  for name in option_sets:
    prof = ep_bench.profile_step(calls[name][0], placed, keep_events=FLAGS.hlo)
    if FLAGS.hlo:
      stem = os.path.join(FLAGS.out, f"{'_'.join(map(str, cfg))}_{name}")
      with open(stem + ".hlo.txt", "w") as f:
        f.write(calls[name][0].as_text())
      if prof:
        with open(stem + ".events.json", "w") as f:
          json.dump(prof.pop("events"), f)
    res["profiles"][name] = prof
  return res


def table(results, names):
  lines = ["| per-device config (T_local,d,n,E,K) | P | sample ms | single fwd+bwd ms | "
           + " | ".join(f"{n} ms (single / it)" for n in names) + " |",
           "|---|---|---|---|" + "---|" * len(names)]
  for r in results:
    for t in r["timings"]:
      cells = [f"{t[n]:.3f} ({t['single'] / t[n]:.3f})" for n in names]
      lines.append(f"| {','.join(map(str, r['config']))} | {r['devices']} | {t['sample_ms']:g} | "
                   f"{t['single']:.3f} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(_):
  if FLAGS.scheme not in ep_bench.SCHEMES:
    raise app.UsageError(f"--scheme={FLAGS.scheme!r}: expected one of {list(ep_bench.SCHEMES)}")
  option_sets = dict(parse_option_set(s) for s in FLAGS.option_set)
  if "single" in option_sets:
    raise app.UsageError("--option_set: 'single' names the single-device step")
  sample_ms = [float(v) for v in FLAGS.sample_ms]
  devices = jax.devices()
  configs = grid.parse_configs(FLAGS.thiek, DEFAULT_CONFIGS)
  backend = sonic_jax.backends.resolve_backend(FLAGS.backend).name
  out = grid.run_record("ep_options_bench", devices, backend=backend, scheme=FLAGS.scheme,
                        option_sets=option_sets, xla_flags=os.environ.get("XLA_FLAGS", ""),
                        results=[])
  os.makedirs(FLAGS.out, exist_ok=True)
  for cfg in configs:
    out["results"].append(run_config(cfg, devices, backend, FLAGS.scheme, option_sets,
                                     sample_ms))
    path = grid.write_record(out, FLAGS.out, "ep_options")  # after each configuration
    r = out["results"][-1]
    for name, prof in r["profiles"].items():
      if prof:
        print(f"{cfg} {name}: span {prof['span_ms']:.3f} ms, communication "
              f"{prof['communication_ms']:.3f}, computation {prof['computation_ms']:.3f}, "
              f"hidden {prof['hidden_ms']:.3f}", flush=True)
  print(table(out["results"], list(option_sets)))
  print(f"wrote {path}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
