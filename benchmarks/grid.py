"""The benchmark grid (the SonicMoE paper's configurations), its inputs, and the run record that
every benchmark writes with its results."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shlex
import re
import sys

from absl import app
import jax
import jax.numpy as jnp

# (T, d, n, E, K): tokens, hidden, expert width, experts, experts per token.
PAPER_GRID = [
    (40960, 768, 256, 128, 8), (40960, 768, 512, 64, 4), (40960, 768, 1024, 32, 2),
    (24576, 1536, 256, 128, 8), (24576, 1536, 512, 64, 4), (24576, 1536, 1024, 32, 2),
    (32768, 4096, 256, 256, 16), (32768, 4096, 512, 128, 8), (32768, 4096, 1024, 64, 4),
    (32768, 4096, 512, 256, 16), (32768, 4096, 1024, 128, 8), (32768, 4096, 2048, 64, 4),
]
# Small enough for a CPU run of the harness.
TINY_GRID = [(256, 64, 32, 8, 2), (512, 128, 64, 16, 4)]

# SonicMoE paper (Guo et al., arXiv 2512.14080) Fig. 14, H100, bf16, SwiGLU: SonicMoE's forward and
# backward TFLOP/s with the FLOP counts of `forward_flops`, read off the figure to about +-2.
SONICMOE_PAPER = dict(zip(PAPER_GRID, [
    (337, 365), (399, 401), (403, 433), (362, 403), (433, 438), (466, 466),
    (427, 459), (502, 511), (552, 554), (517, 526), (558, 567), (595, 586)]))

DATA_SCALES = ("sonicmoe", "unit")


def config_name(cfg):
  t, d, n, e, k = cfg
  return f"T{t}_d{d}_n{n}_E{e}_K{k}"


def parse_configs(thiek, default):
  """Configurations from --thiek strings "T,d,n,E,K" (repeatable), or `default` without any."""
  if not thiek:
    return list(default)
  configs = []
  for s in thiek:
    try:
      cfg = tuple(int(v) for v in s.split(","))
    except ValueError:
      cfg = ()
    if len(cfg) != 5 or min(cfg) < 1:
      raise app.UsageError(f"--thiek={s!r}: expected five positive integers T,d,n,E,K")
    configs.append(cfg)
  return configs


def forward_flops(cfg, glu=True):
  """The paper's count: 6*T*K*d*n for GLU activations (4*TKdn otherwise); backward is twice it."""
  t, d, n, _, k = cfg
  return (6 if glu else 4) * t * k * d * n


def _normal(key, shape, std, dtype=jnp.bfloat16):
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def random_inputs(cfg, seed=0, data="sonicmoe"):
  """(x, d_out), both (T, d) bfloat16: data="sonicmoe" draws SonicMoE's benchmark's scale
  (0.2 N(0, 1)), "unit" N(0, 1)."""
  if data not in DATA_SCALES:
    raise ValueError(f"data must be one of {DATA_SCALES}, got {data!r}")
  keys = jax.random.split(jax.random.key(seed), 2)
  std = 0.2 if data == "sonicmoe" else 1.0
  return _normal(keys[0], (cfg[0], cfg[1]), std), _normal(keys[1], (cfg[0], cfg[1]), std)


def random_weights(cfg, seed=1234, data="sonicmoe", router_dtype=jnp.bfloat16):
  """(router_weight (d, E), w1 (E, d, 2n), w2 (E, n, d)) of a SwiGLU layer: data="sonicmoe" draws
  every weight of std 0.02 (SonicMoE's benchmark), "unit" of std 1/sqrt(fan-in)."""
  if data not in DATA_SCALES:
    raise ValueError(f"data must be one of {DATA_SCALES}, got {data!r}")
  _, d, n, e, _ = cfg
  keys = jax.random.split(jax.random.key(seed), 3)
  std = lambda fan_in: 0.02 if data == "sonicmoe" else fan_in ** -0.5
  return (_normal(keys[0], (d, e), std(d), router_dtype), _normal(keys[1], (e, d, 2 * n), std(d)),
          _normal(keys[2], (e, n, d), std(n)))


def random_problem(cfg, seed=0, data="sonicmoe"):
  """(x, router_weight, w1, w2, d_out) of configuration `cfg`, all bfloat16."""
  x, d_out = random_inputs(cfg, seed, data)
  return (x, *random_weights(cfg, seed + 1234, data), d_out)


def route_fn(cfg, row_tile=128, config=None):
  """The layer's routing step: (x, router_weight) -> (RouterOutput of the softmax top-K of the
  router logits, its GroupedLayout of `row_tile`-row tiles)."""
  from sonic_jax import routing
  from sonic_jax.layout import build_grouped_layout
  _, _, _, e, k = cfg

  def route(x, router_weight):
    logits, ids = routing.router_logits_and_ids(x, router_weight, k, "softmax_topk",
                                                config=config)
    r = routing.route(logits, k, "softmax_topk", expert_ids=ids)
    return r, build_grouped_layout(r.expert_ids, e, row_tile, config=config)
  return route


def device_tag(kind, count=1):
  """A short name of `count` devices of `kind` for result file names: "h100", "h200x2", "cpu"."""
  found = re.search(r"\b([A-Z]\d{2,3})\b", kind)
  tag = found.group(1).lower() if found else re.sub(r"\W+", "_", kind.lower()).strip("_")
  return tag + (f"x{count}" if count > 1 else "")


def run_record(script, devices=None, **extra):
  """What every results file says about its run: device, versions, date (UTC) and command."""
  import sonic_jax
  devices = devices or jax.devices()
  return {"device": devices[0].device_kind, "devices": len(devices),
          "platform": devices[0].platform, "jax": jax.__version__,
          "sonic_jax": sonic_jax.__version__, "python": platform.python_version(),
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
          "command": f"python -m benchmarks.{script} " + shlex.join(sys.argv[1:]), **extra}


def results_name(record, kind):
  """The results file name of a run: <device>_<date>_<kind>.json (benchmarks/results/ keeps
  these names; `benchmarks.report` reads the kind from it)."""
  tag = device_tag(record["device"], record.get("devices", 1))
  return f"{tag}_{record['date'][:10]}_{kind}.json"


def write_record(record, out, kind):
  """Writes a whole run's record to out/`results_name(record, kind)`; returns the path."""
  os.makedirs(out, exist_ok=True)
  path = os.path.join(out, results_name(record, kind))
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
  return path


@contextlib.contextmanager
def interpret_mode(enabled=True):
  """Mosaic GPU interpret mode on a CPU (enabled), for an H100-like abstract device of 2 SMs: the
  kernels run, slowly, without a GPU (CPU runs of the harness)."""
  if not enabled:
    yield
    return
  from jax._src.mesh import AbstractDevice
  from jax.experimental.pallas import mosaic_gpu as plgpu
  mesh = jax.sharding.AbstractMesh((), (), abstract_device=AbstractDevice(
      device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=2))
  with jax.sharding.use_abstract_mesh(mesh), plgpu.force_gpu_interpret_mode(
      plgpu.InterpretGPUParams(detect_races=False)):
    yield


def print_kernels(results, case_fields):
  """Each result's traced kernels ("kernels_us": {name: device us per call}), one line each."""
  for r in results:
    for name, us in r["kernels_us"].items():
      case = ",".join(str(r[f]) for f in case_fields)
      print(f"  {case} {r['variant'][:24]:<24} {us:8.1f} us  {name[:70]}")


def variants_table(results, case_fields, columns=()):
  """A markdown table of timed variants against the "xla" variant of the same case: one row per
  result, each case's rows fastest first. case_fields: the result fields naming a case (joined by
  commas in the first column); columns: (header, result -> text) pairs shown after the time."""
  case = lambda r: tuple(r[f] for f in case_fields)
  base = {case(r): r["us"] for r in results if r["variant"] == "xla"}
  lines = ["| " + " | ".join([",".join(case_fields), "variant", "us",
                              *(h for h, _ in columns), "× xla"]) + " |",
           "|" + "---|" * (4 + len(columns))]
  for r in sorted(results, key=lambda r: (case(r), r["us"])):
    cells = [",".join(str(v) for v in case(r)), r["variant"], f"{r['us']:.1f}",
             *(fmt(r) for _, fmt in columns), f"{base[case(r)] / r['us']:.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
