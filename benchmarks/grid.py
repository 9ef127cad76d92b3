"""The benchmark grid of the SonicMoE paper and its published / measured H100 figures."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

# (T, d, n, E, K): tokens, hidden, expert width, experts, experts per token.
PAPER_GRID = [
    (40960, 768, 256, 128, 8), (40960, 768, 512, 64, 4), (40960, 768, 1024, 32, 2),
    (24576, 1536, 256, 128, 8), (24576, 1536, 512, 64, 4), (24576, 1536, 1024, 32, 2),
    (32768, 4096, 256, 256, 16), (32768, 4096, 512, 128, 8), (32768, 4096, 1024, 64, 4),
    (32768, 4096, 512, 256, 16), (32768, 4096, 1024, 128, 8), (32768, 4096, 2048, 64, 4),
]
# Small enough for a CPU smoke run of the harness.
TINY_GRID = [(256, 64, 32, 8, 2), (512, 128, 64, 16, 4)]

_ANCHORS = os.path.join(os.path.dirname(__file__), "data", "sonicmoe_h100.json")


def config_name(cfg):
  t, d, n, e, k = cfg
  return f"T{t}_d{d}_n{n}_E{e}_K{k}"


def load_anchors():
  """{config tuple: entry} from data/sonicmoe_h100.json (its '_source' says where each came from)."""
  with open(_ANCHORS) as f:
    data = json.load(f)
  return {tuple(c[k] for k in "TdnEK"): c for c in data["configs"]}, data["_source"]


def forward_flops(cfg, glu=True):
  """The paper's count: 6*T*K*d*n for GLU activations (4*TKdn otherwise); backward is twice it."""
  t, d, n, _, k = cfg
  return (6 if glu else 4) * t * k * d * n


DATA_SCALES = ("unit", "sonicmoe")


def input_std(data: str) -> float:
  """Standard deviation of x and dO: 1 (unit), or SonicMoE's benchmark's 0.2."""
  return 0.2 if data == "sonicmoe" else 1.0


def weight_std(data: str, fan_in: int) -> float:
  """Standard deviation of a weight: 1/sqrt(fan-in) (unit), or SonicMoE's benchmark's 0.02."""
  return 0.02 if data == "sonicmoe" else fan_in ** -0.5


def random_problem(cfg, seed: int = 0, data: str = "unit"):
  """(x, router_weight, w1, w2, d_out) for a SwiGLU layer of configuration `cfg`, all bfloat16 (the
  router weight too, as in SonicMoE's benchmark). data="unit": unit-scale x and dO, weights of std
  1/sqrt(fan-in); "sonicmoe": SonicMoE's benchmark's scales (../shared/bench/sonic_ref.py: x, dO ~
  0.2 N(0, 1), every weight of std 0.02), which draw less power on an H100."""
  if data not in DATA_SCALES:
    raise ValueError(f"data must be one of {DATA_SCALES}, got {data!r}")
  t_count, d, n, e, _ = cfg
  keys = jax.random.split(jax.random.key(seed), 5)
  if data == "sonicmoe":
    normal = lambda key, shape, scale: (
        scale * jax.random.normal(key, shape, jnp.float32)).astype(jnp.bfloat16)
    return (normal(keys[0], (t_count, d), input_std(data)),
            normal(keys[1], (d, e), weight_std(data, d)),
            normal(keys[2], (e, d, 2 * n), weight_std(data, d)),
            normal(keys[3], (e, n, d), weight_std(data, n)),
            normal(keys[4], (t_count, d), input_std(data)))
  scaled = lambda key, shape, fan_in: (jax.random.normal(key, shape, jnp.float32)
                                       / fan_in ** 0.5).astype(jnp.bfloat16)
  return (jax.random.normal(keys[0], (t_count, d), jnp.bfloat16), scaled(keys[1], (d, e), d),
          scaled(keys[2], (e, d, 2 * n), d), scaled(keys[3], (e, n, d), n),
          jax.random.normal(keys[4], (t_count, d), jnp.bfloat16))


def route_fn(cfg, row_tile: int = 128):
  """The layer's routing step for configuration `cfg`: (x, router_weight) -> (RouterOutput of the
  softmax top-K of the router logits, its GroupedLayout with `row_tile`-row tiles)."""
  from sonic_jax import routing
  from sonic_jax.layout import build_grouped_layout
  _, _, _, e, k = cfg

  def route(x, router_weight):
    logits, ids = routing.router_logits_and_ids(x, router_weight, k, "softmax_topk")
    r = routing.route(logits, k, "softmax_topk", expert_ids=ids)
    return r, build_grouped_layout(r.expert_ids, e, row_tile)
  return route


def swiglu_sigmoid_by_division():
  """SwiGLU with sigmoid(g) = 1 / (1 + exp(-g)) in the kernels' epilogues (what they ran before
  the tanh form, `activations._sigmoid_kernel`): for A/B timings of the epilogue's arithmetic."""
  from sonic_jax import activations as acts
  sigmoid = lambda g: 1.0 / (1.0 + jnp.exp(-g))
  fn = lambda g: g * sigmoid(g)
  grad = lambda g: sigmoid(g) * (1.0 + g * (1.0 - sigmoid(g)))
  return acts.Activation("swiglu", fn, grad, is_glu=True)


def variant_activation(overrides, default):
  """The activation a variant names under the key "activation" of its overrides (popped from
  them): "sigmoid_by_division", or `default` when it names none."""
  name = overrides.pop("activation", None)
  if name is None:
    return default
  if name != "sigmoid_by_division":
    raise ValueError(f"unknown variant activation {name!r}")
  return swiglu_sigmoid_by_division()


def parse_configs(thiek, default):
  """Configurations from --thiek strings "T,d,n,E,K" (repeatable), or `default` without any."""
  return [tuple(int(v) for v in s.split(",")) for s in thiek] if thiek else list(default)


def define_variant_flags(repeats: int = 7):
  """The flags of the kernel-variant scripts (gather_variants, dh_variants, wgrad_variants)."""
  from absl import flags
  flags.DEFINE_multi_string("thiek", None, "configuration T,d,n,E,K (repeatable)")
  flags.DEFINE_string("out", "bench_out", "output folder")
  flags.DEFINE_integer("repeats", repeats, "timed samples per variant")
  flags.DEFINE_multi_string("variants", None, "a name of the script's VARIANTS to run "
                            "(repeatable; default: all)")
  flags.DEFINE_integer("cool_calls", 0, "also profile this many calls of each variant after 2 s "
                       "idle: device time near boost clocks, beside the sustained samples")


def print_variant_table(results):
  """One line of milliseconds per configuration, a column per variant (WRONG: its outputs
  differed from the first variant's; "cool" the device time near boost clocks, --cool_calls)."""
  cool = lambda v: f" (cool {v['cool_device_us'] / 1e3:.3f})" if "cool_device_us" in v else ""
  for r in results["configs"]:
    print(f"\n{'config':28s} " + " | ".join(r["variants"]))
    cells = [f"{v['ms']:.3f}{cool(v)}{'' if v['exact'] else ' (WRONG)'}" if "ms" in v else "error"
             for v in r["variants"].values()]
    print(f"{','.join(map(str, r['config'])):28s} " + " | ".join(cells))


def run_variant_configs(run_config, thiek, default_configs, out_dir, filename):
  """The variant scripts' main: run_config(cfg) for each configuration of --thiek (default
  `default_configs`), all results written to out_dir/filename; returns them."""
  results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "configs": [run_config(c) for c in parse_configs(thiek, default_configs)]}
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, filename), "w") as f:
    json.dump(results, f, indent=1)
  return results
