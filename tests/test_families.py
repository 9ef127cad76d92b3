"""The layer against Hugging Face transformers' own MoE blocks, family by family (`sonic_jax.hf`).

The reference values come from `tests/hf_reference.py`, run where torch and transformers are:
in this process when they import, else under the interpreter named by SONIC_JAX_REFERENCE_PYTHON,
else under <repo>/.venv-ref/bin/python (CI builds it), else the comparisons skip. Each family's
block runs in float64 on a tiny random config; the layer, built from the same config dict and
loaded with the converted state dict, runs in float64 on the xla backend, and its output, router
logits and every gradient (input, and each parameter mapped back to transformers' names) must
agree to 1e-6 relative (several transformers routers compute in float32: about 1e-7).
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import os
import subprocess
import tempfile
import warnings

from flax import nnx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import hf_reference
from oracle import rel_err
from sonic_jax import hf
from sonic_jax.activations import clamped_swiglu
from sonic_jax.routing import Router, hf_load_balancing_loss

CASES = list(hf_reference.CASES)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-6
GPU_TOL = 2e-2
# XLA:CPU compiles each family's program in about half the time with its backend optimizations
# off (compiling is nearly all of this file's time); the float64 comparisons at TOL do not see the
# difference (float32 transcendentals can move by ~1e-4 near zero: docs/decisions.md).
CPU_COMPILE = {"xla_backend_optimization_level": 0}


def _torch_here() -> bool:
  try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
  except ImportError:
    return False
  return True


def _reference_python() -> tuple[str | None, str]:
  """(interpreter, why) for running hf_reference.py; None when there is none (why: the reason)."""
  named = os.environ.get("SONIC_JAX_REFERENCE_PYTHON")
  if named:
    return named, ""
  local = os.path.join(REPO, ".venv-ref", "bin", "python")
  if not os.path.exists(local):
    return None, ("no torch + transformers here, SONIC_JAX_REFERENCE_PYTHON unset and no "
                  f"{local} (.ci/run builds it)")
  probe = subprocess.run([local, "-c", "import torch, transformers"], capture_output=True,
                         text=True)
  if probe.returncode:
    return None, f"{local} cannot import torch and transformers: {probe.stderr.strip()[-300:]}"
  return local, ""


class References:
  """The reference arrays per (case, size), computed once per test run."""

  def __init__(self, directory):
    self.directory = str(directory)
    self.cache = {}
    self.in_process = _torch_here()
    self.python, self.why = (None, "") if self.in_process else _reference_python()

  def get(self, case: str, size: str = "cpu") -> dict:
    key = (case, size)
    if key not in self.cache:
      path = os.path.join(self.directory, size, f"{case}.npz")
      if os.path.exists(path):  # computed earlier, or elsewhere (SONIC_JAX_REFERENCE_DIR)
        with np.load(path) as z:
          self.cache[key] = {k: z[k] for k in z.files}
      elif self.in_process:
        self.cache[key] = hf_reference.run_case(case, size=size)
      else:
        self.cache[key] = self._from_script(case, size)
    return self.cache[key]

  def _from_script(self, case, size):
    path = os.path.join(self.directory, size, f"{case}.npz")
    if self.python is None:
      why = f"no {path}, and {self.why}"
      if os.environ.get("CI"):  # CI must compare every family, not pass by skipping them all
        pytest.fail(f"no transformers reference under CI: {why}")
      pytest.skip(f"no transformers reference: {why}")
    if not os.path.exists(path):
      self._compute(size, path)
    with np.load(path) as z:
      return {k: z[k] for k in z.files}

  def _compute(self, size, path):
    """Every case of this size in one run of the script: torch starts once. The xdist workers
    share the directory (`references`): one runs the script while the other waits on the lock,
    and the files appear whole (renamed into place) or not at all."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(os.path.join(self.directory, f"{size}.lock"), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      if os.path.exists(path):  # the other worker's
        return
      out = tempfile.mkdtemp(dir=self.directory)
      cmd = [self.python, os.path.join(REPO, "tests", "hf_reference.py"), "--out", out,
             "--size", size] + CASES
      # One torch thread: the blocks are tiny, and more threads spin (twice the CPU time).
      env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
      done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                            env=dict(env, OMP_NUM_THREADS="1"))
      if done.returncode:
        pytest.fail(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
      for name in os.listdir(out):
        os.replace(os.path.join(out, name), os.path.join(os.path.dirname(path), name))
      os.rmdir(out)


@pytest.fixture(scope="module")  # every test of this file shares one
def references(tmp_path_factory):
  # SONIC_JAX_REFERENCE_DIR: reference files written by `hf_reference.py --out DIR/<size>` on
  # another machine (a GPU machine whose transformers lacks a family reads them from there).
  # Else the run's temporary directory, the one above the xdist workers' own: computed once.
  base = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent
  return References(os.environ.get("SONIC_JAX_REFERENCE_DIR") or base / "hf_reference")


def _config(r):
  return json.loads(str(r["config_json"]))


def _state(r):
  return {k[len("param/"):]: r[k] for k in r if k.startswith("param/")}


def _ref_grads(r):
  return {k[len("grad/"):]: r[k] for k in r if k.startswith("grad/")}


@functools.cache
def _value_and_grads_program(graph, on_cpu: bool):
  """The jitted value and gradients of L = sum(y * cot) for a layer of `graph` (its structure and
  configuration, not its values): the cases and features that share a configuration share it, and
  trace it once for each shape."""

  def loss(params, rest, x, cot, ids):
    y, aux = nnx.merge(graph, params, rest)(x, expert_ids=ids)
    return jnp.sum(y.astype(cot.dtype) * cot), (y, aux.stats.router_logits)

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 2), has_aux=True),
                 compiler_options=CPU_COMPILE if on_cpu else None)


def _value_and_grads(layer, x, cot, r):
  """(y, router logits, dL/dx, the layer's parameter gradients as a dict), L = sum(y * cot);
  the reference r's fixed selection where it has one (a hash-routed layer's expert_ids).

  Every array is an argument, none a constant of the program: cases whose layers are configured
  alike compile one program (the run's compilation cache, conftest.py)."""
  graph, params, rest = nnx.split(layer, nnx.Param, ...)
  ids = r["expert_ids"].reshape(x.shape[:-1] + (-1,)) if "expert_ids" in r else None
  f = _value_and_grads_program(graph, jax.default_backend() == "cpu")
  (_, (y, logits)), (g_params, g_x) = f(params, rest, x, cot, ids)
  return y, logits, g_x, hf.layer_params(g_params, gate_up_layout=layer.gate_up_layout)


def _errors(config, r, y, logits, g_x, g_params, gate_up_layout=None):
  """{name: relative error} of the output, the router logits and every gradient."""
  errs = {"output": rel_err(y, r["output"]), "router_logits": rel_err(logits, r["router_logits"]),
          "grad input": rel_err(g_x, r["grad_input"])}
  got = hf.hf_state_from_layer(config, g_params, gate_up_layout=gate_up_layout)
  want = _ref_grads(r)
  assert set(got) == set(want), (sorted(got), sorted(want))
  errs.update({f"grad {k}": rel_err(got[k], want[k]) for k in want})
  return errs


# --- against transformers, float64 ---------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_layer_matches_transformers_block(references, case):
  r = references.get(case)
  config = _config(r)
  with jax.enable_x64(True):
    layer = hf.moe_layer(config, _state(r), param_dtype=jnp.float64, backend="xla")
    y, logits, g_x, g_params = _value_and_grads(layer, jnp.asarray(r["input"]),
                                                jnp.asarray(r["cotangent"]), r)
    errs = _errors(config, r, y, logits, g_x, g_params)
  worst = max((k for k in errs if k.startswith("grad")), key=errs.get)
  print(f"\n{case}: output {errs['output']:.1e}, worst gradient {errs[worst]:.1e} ({worst})")
  bad = {k: v for k, v in errs.items() if not v <= TOL}
  assert not bad, f"{case}: relative errors above {TOL}: {bad}"


def _without(layer, feature):
  """The layer with one feature of its family switched off."""
  if feature == "selection bias":
    layer.selection_bias[...] = jnp.zeros_like(layer.selection_bias[...])
  elif feature == "groups":
    layer.routing = dataclasses.replace(layer.routing, n_group=1, topk_group=1)
  elif feature == "clamp":
    layer.activation = dataclasses.replace(layer.activation, limit=None)
  elif feature == "p-norm":
    layer.routing = dataclasses.replace(layer.routing, renorm_p=1.0)
  elif feature in ("router scale", "expert scale"):  # Gemma 4's: back to their ones
    scale = getattr(layer, feature.replace(" ", "_"))
    scale[...] = jnp.ones_like(scale[...])
  return layer


@pytest.mark.parametrize("case, feature", [
    ("deepseek_v3", "selection bias"), ("minimax_m2", "selection bias"),
    ("minimax_m3_vl_text", "selection bias"), ("minimax_m3_vl_text", "clamp"),
    ("dots3_note_text", "selection bias"), ("openai_privacy_filter", "clamp"),
    ("ernie4_5_moe", "selection bias"), ("lfm2_moe", "selection bias"),
    ("deepseek_v32", "selection bias"), ("kimi_linear", "selection bias"),
    ("glm4_moe_lite", "selection bias"), ("exaone_moe", "selection bias"),
    ("afmoe", "selection bias"), ("mimo_v2_flash", "selection bias"), ("mimo_v2_flash", "groups"),
    ("beam", "selection bias"), ("beam", "groups"), ("nemotron_h", "selection bias"),
    ("nemotron_h", "groups"), ("kolibri1", "selection bias"),
    ("step3p5", "selection bias"), ("bailing_hybrid", "groups"), ("solar_open", "selection bias"),
    ("hy_v3", "selection bias"), ("laguna", "selection bias"),
    ("deepseek_v2", "groups"), ("deepseek_v3", "groups"), ("mistral4", "groups"),
    ("mistral_large4_text", "groups"), ("axk2", "selection bias"), ("axk2", "groups"),
    ("deepseek_v32", "groups"), ("kimi_linear", "groups"), ("gpt_oss", "clamp"),
    ("dbrx_p2", "p-norm"), ("gemma4_text", "router scale"), ("gemma4_text", "expert scale"),
    ("diffusion_gemma_text", "router scale"), ("diffusion_gemma_text", "expert scale"),
    ("unlimited_ocr_text", "groups"),
    ("deepseek_v4", "selection bias"), ("deepseek_v4", "clamp"), ("glm5_next_text", "clamp")])
def test_reference_cases_exercise_their_family_features(references, case, feature):
  """The random cases are not degenerate: without the feature the layer misses the block. (The
  program of test_layer_matches_transformers_block: a feature that is a value, not part of the
  configuration, adds no compilation.)"""
  r = references.get(case)
  with jax.enable_x64(True):
    layer = _without(hf.moe_layer(_config(r), _state(r), param_dtype=jnp.float64,
                                  backend="xla"), feature)
    y, *_ = _value_and_grads(layer, jnp.asarray(r["input"]), jnp.asarray(r["cotangent"]), r)
  err = rel_err(y, r["output"])
  assert 1e-2 < err < np.inf, err  # a NaN output (rel_err's inf) proves nothing


def _first_case_of_each(key) -> list[str]:
  """The first case (in CASES' order) of each distinct key(family)."""
  firsts = {}
  for name, case in hf_reference.CASES.items():
    firsts.setdefault(key(hf.FAMILIES[case.model_type]), name)
  return list(firsts.values())


def _gate_up_storage(fam: hf.Family):
  """Where and in what order a family keeps the columns that a gate/up layout orders: experts
  (and their stored layout), shared MLP."""
  return fam.experts, fam.natural_layout, fam.shared_kind if fam.shared else None


# One case per gate/up storage: the converters' column permutation depends on nothing else.
@pytest.mark.parametrize("case", _first_case_of_each(_gate_up_storage))
def test_other_gate_up_layout_is_the_same_layer(references, case):
  """Loading into a layer with the other gate/up layout (columns permuted by the converter) gives
  the same layer: output and gradients as with the family's own layout."""
  r = references.get(case)
  config = _config(r)
  layout = "concat" if hf.family(config).natural_layout == "interleaved" else "interleaved"
  with jax.enable_x64(True):
    layer = hf.moe_layer(config, _state(r), gate_up_layout=layout, param_dtype=jnp.float64,
                         backend="xla")
    assert layer.gate_up_layout == layout
    y, logits, g_x, g_params = _value_and_grads(layer, jnp.asarray(r["input"]),
                                                jnp.asarray(r["cotangent"]), r)
    errs = _errors(config, r, y, logits, g_x, g_params, gate_up_layout=layout)
  bad = {k: v for k, v in errs.items() if not v <= TOL}
  assert not bad, f"{case} with {layout}: relative errors above {TOL}: {bad}"


@pytest.mark.parametrize("case", CASES)
def test_state_dict_round_trip_through_the_layer_is_exact(references, case):
  r = references.get(case)
  config = _config(r)
  state = _state(r)
  params = hf.layer_params_from_hf(config, state)
  # (DeepSeek-V4's hash table is the caller's, not a parameter: the converters pass over it.)
  state.pop(hf.family(config).lookup, None)
  for layout in ("concat", "interleaved"):
    back = hf.hf_state_from_layer(config, hf.layer_params_from_hf(config, state,
                                                                  gate_up_layout=layout),
                                  gate_up_layout=layout)
    assert set(back) == set(state)
    for k in state:
      assert back[k].dtype == state[k].dtype and np.array_equal(back[k], state[k]), (layout, k)
  with jax.enable_x64(True):
    layer = hf.moe_layer(config, state, param_dtype=jnp.float64, backend="xla")
    loaded = hf.layer_params(layer)
  assert set(loaded) == set(params)
  back = hf.hf_state_from_layer(config, loaded)
  for k in state:
    assert np.array_equal(back[k], state[k]), k  # the float32 selection bias holds its values


def _expected_kwargs(case):
  """What each family's config means, written out independently of sonic_jax.hf."""
  d, e, n, _, _ = hf_reference.SIZES["cpu"]
  base = dict(d_model=d, num_experts=e, expert_dim=n, top_k=2, activation="swiglu",
              routing=Router("softmax"), gate_up_layout="concat", use_bias=False,
              use_router_bias=False, num_shared_experts=0, shared_expert_dim=None,
              shared_expert_gate=False)
  v3 = lambda **kw: Router("sigmoid", renorm_epsilon=1e-20, group_score="top2_sum", **kw)
  raw = Router("softmax", renormalize=False)
  specific = {
      "mixtral": {}, "minimax": {}, "qwen3_moe": {}, "granitemoe": {}, "hunyuan_v1_moe":
      dict(num_shared_experts=1, shared_expert_dim=n),
      "qwen2_moe": dict(routing=raw, num_shared_experts=1, shared_expert_dim=2 * n,
                        shared_expert_gate=True),
      "qwen3_next": dict(num_shared_experts=1, shared_expert_dim=n, shared_expert_gate=True),
      "qwen3_5_moe_text": dict(num_shared_experts=1, shared_expert_dim=n,
                               shared_expert_gate=True),
      "qwen3_vl_moe_text": {}, "qwen3_omni_moe_text": {}, "mellum": {},
      "qwen4_exp_text": dict(num_shared_experts=1, shared_expert_dim=n, shared_expert_gate=True),
      "lara_mini": dict(num_shared_experts=1, shared_expert_dim=2 * n),
      "flint": dict(routing=Router("sigmoid"), num_shared_experts=1, shared_expert_dim=2 * n),
      "laguna": dict(routing=Router("sigmoid", routed_scaling_factor=2.5), num_shared_experts=1,
                     shared_expert_dim=n, bias_update_rate=1e-3),
      "qwen3_omni_moe_talker_text": dict(routing=raw, num_shared_experts=1,
                                         shared_expert_dim=2 * n, shared_expert_gate=True),
      "olmoe": dict(routing=raw), "flex_olmo": dict(routing=raw), "jamba": dict(routing=raw),
      "deepseek_v2": dict(routing=Router("softmax", renormalize=False, n_group=2, topk_group=1,
                                         group_score="max", routed_scaling_factor=1.5),
                          num_shared_experts=2, shared_expert_dim=n),
      **dict.fromkeys(("deepseek_v3", "deepseek_v32", "sarvam_mla", "kimi_linear", "axk2"), dict(
          routing=v3(n_group=4, topk_group=2, routed_scaling_factor=2.5), num_shared_experts=1,
          shared_expert_dim=n, bias_update_rate=1e-3)),
      **dict.fromkeys(("glm4_moe", "glm4_moe_lite", "sarvam_moe", "glm_moe_dsa", "glm4v_moe_text",
                       "solar_open"), dict(
          routing=v3(routed_scaling_factor=2.5), num_shared_experts=1, shared_expert_dim=n,
          bias_update_rate=1e-3)),
      "glm5_next_text": dict(activation=clamped_swiglu(alpha=1.0, limit=1.25, up_offset=0.0),
                             routing=v3(routed_scaling_factor=2.5), num_shared_experts=1,
                             shared_expert_dim=n, bias_update_rate=1e-3),
      **dict.fromkeys(("deepseek_ocr2_text", "unlimited_ocr_text"), dict(
          routing=Router("softmax", renormalize=False, n_group=2, topk_group=1,
                         group_score="max", routed_scaling_factor=1.5),
          num_shared_experts=2, shared_expert_dim=n)),
      **dict.fromkeys(("afmoe", "hy_v3"), dict(
          routing=Router("sigmoid", renorm_epsilon=1e-20, routed_scaling_factor=2.5),
          num_shared_experts=1, shared_expert_dim=n, bias_update_rate=1e-3)),
      **dict.fromkeys(("mimo_v2_flash", "beam"), dict(
          routing=v3(n_group=4, topk_group=2, routed_scaling_factor=2.5), bias_update_rate=1e-3)),
      "nemotron_h": dict(activation="relu_sq",
                         routing=v3(n_group=4, topk_group=2, routed_scaling_factor=2.5),
                         num_shared_experts=1, shared_expert_dim=2 * n, bias_update_rate=1e-3),
      "kolibri1": dict(routing=Router("sigmoid", selection_bias_on="logits"),
                       num_shared_experts=1, shared_expert_dim=2 * n, bias_update_rate=1e-3),
      "step3p5": dict(routing=Router("sigmoid", routed_scaling_factor=2.5), num_shared_experts=1,
                      shared_expert_dim=n, bias_update_rate=1e-3),
      "bailing_hybrid": dict(routing=v3(n_group=4, topk_group=2, routed_scaling_factor=2.5),
                             num_shared_experts=1, shared_expert_dim=n, bias_update_rate=1e-3),
      **dict.fromkeys(("dots1", "exaone_moe"), dict(
          routing=v3(renormalize=False, routed_scaling_factor=2.5), num_shared_experts=2,
          shared_expert_dim=n, bias_update_rate=1e-3)),
      **dict.fromkeys(("mistral4", "mistral_large4_text"), dict(
          routing=Router("softmax", renorm_epsilon=1e-20, n_group=4, topk_group=2,
                         group_score="top2_sum", routed_scaling_factor=2.5),
          num_shared_experts=1, shared_expert_dim=n)),
      "minimax_m2": dict(routing=Router("sigmoid"), bias_update_rate=1e-3),
      "minimax_m3_vl_text": dict(activation=clamped_swiglu(alpha=1.702, limit=1.25),
                                 routing=Router("sigmoid", routed_scaling_factor=1.5),
                                 num_shared_experts=1, shared_expert_dim=2 * n,
                                 bias_update_rate=1e-3),
      "aria_text": dict(num_shared_experts=2, shared_expert_dim=n),
      "dots3_note_text": dict(routing=v3(renormalize=False, routed_scaling_factor=2.5),
                              num_shared_experts=1, shared_expert_dim=2 * n,
                              bias_update_rate=1e-3),
      **dict.fromkeys(("granitemoe_swa", "granitemoehybrid"),
                      dict(num_shared_experts=1, shared_expert_dim=2 * n)),
      "openai_privacy_filter": dict(activation=clamped_swiglu(alpha=1.702, limit=1.25),
                                    use_bias=True, use_router_bias=True),
      "ernie4_5_moe": dict(num_shared_experts=2, shared_expert_dim=n, bias_update_rate=1e-3),
      "lfm2_moe": dict(routing=Router("sigmoid", renorm_epsilon=1e-6, routed_scaling_factor=1.5),
                       bias_update_rate=1e-3),
      "gpt_oss": dict(activation=clamped_swiglu(alpha=1.702, limit=1.25),
                      gate_up_layout="interleaved", use_bias=True, use_router_bias=True),
      "llama4_text": dict(top_k=1, routing=Router("sigmoid", renormalize=False, scale_input=True),
                          num_shared_experts=1, shared_expert_dim=n),
      "granitemoeshared": dict(num_shared_experts=1, shared_expert_dim=2 * n),
      "dbrx": {}, "dbrx_p2": dict(routing=Router("softmax", renorm_p=2.0)),
      **dict.fromkeys(("gemma4_text", "diffusion_gemma_text"), dict(
          activation="geglu_tanh", router_norm_eps=1e-6, use_expert_scale=True)),
      **{name: dict(activation=clamped_swiglu(alpha=1.0, limit=1.25, up_offset=0.0),
                    routing=Router("sqrt_softplus", renorm_epsilon=1e-20,
                                   routed_scaling_factor=1.5),
                    num_shared_experts=1, shared_expert_dim=n, **bias)
         for name, bias in (("deepseek_v4", dict(bias_update_rate=1e-3)),
                            ("deepseek_v4_hash", dict(fixed_selection=True)))},
  }
  return {**base, **specific[case]}


@pytest.mark.parametrize("case", CASES)
def test_layer_kwargs_read_the_config(references, case):
  """The layer's keywords from the config; its family names the model type and the block class
  that the reference builds."""
  config = _config(references.get(case))
  assert hf.layer_kwargs(config) == _expected_kwargs(case)
  family = hf.family(config)
  assert family.model_type == hf_reference.CASES[case].model_type
  assert hf_reference.CASES[case].block in family.block, (family.block, case)


def test_hf_load_balancing_loss_equals_transformers(references):
  """sonic_jax.hf_load_balancing_loss against transformers' load_balancing_loss_func, over two
  layers' router logits, without and with an attention mask (a Mixtral block's logits); a NaN in
  a masked token's logits stays out of the masked loss."""
  r = references.get("mixtral")
  logits = r["router_logits"]
  layers = [logits, 0.5 * logits]
  k = int(r["top_k"])
  both = jax.jit(lambda layers, mask: (hf_load_balancing_loss(layers, k),
                                       hf_load_balancing_loss(layers, k, attention_mask=mask)))
  mask = jnp.asarray(r["lb_mask"])
  padded = int(np.flatnonzero(np.asarray(mask).reshape(-1) == 0)[0])
  with jax.enable_x64(True):
    plain, masked = both(layers, mask)
    _, masked_nan = both([jnp.asarray(l).at[padded].set(jnp.nan) for l in layers], mask)
  assert rel_err(plain, r["lb_loss"]) < TOL
  assert rel_err(masked, r["lb_loss_masked"]) < TOL
  assert rel_err(masked_nan, r["lb_loss_masked"]) < TOL
  assert not np.isclose(float(r["lb_loss"]), float(r["lb_loss_masked"]))


# --- without transformers: the converters on hand-written configs ---------------------------------

MINIMAL_CONFIGS = {
    "mixtral": dict(hidden_size=32, num_local_experts=4, intermediate_size=16,
                    num_experts_per_tok=2),
    "qwen2_moe": dict(hidden_size=32, num_experts=4, moe_intermediate_size=16,
                      num_experts_per_tok=2, shared_expert_intermediate_size=24),
    "deepseek_v3": dict(hidden_size=32, n_routed_experts=8, moe_intermediate_size=16,
                        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                        norm_topk_prob=True, routed_scaling_factor=2.5),
    "mistral4": dict(hidden_size=32, n_routed_experts=8, moe_intermediate_size=16,
                     num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                     norm_topk_prob=True, routed_scaling_factor=2.5),
    "mistral_large4": dict(text_config=dict(model_type="mistral_large4_text", hidden_size=32,
                                            n_routed_experts=8, moe_intermediate_size=16,
                                            num_experts_per_tok=2, n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5)),
    # A.X-K2-Light's: no groups
    "axk2": dict(hidden_size=32, n_routed_experts=8, moe_intermediate_size=16,
                 num_experts_per_tok=2, n_group=None, topk_group=None),
    "ernie4_5_moe": dict(hidden_size=32, moe_num_experts=4, moe_intermediate_size=16, moe_k=2,
                         moe_num_shared_experts=1),
    "gpt_oss": dict(hidden_size=32, num_local_experts=4, intermediate_size=16,
                    num_experts_per_tok=2, swiglu_alpha=1.702, swiglu_limit=7.0),
    "llama4": dict(text_config=dict(model_type="llama4_text", hidden_size=32, num_local_experts=4,
                                    intermediate_size=16, num_experts_per_tok=1)),
    # a checkpoint's config.json: its text_config names no model_type
    "qwen3_5_moe": dict(text_config=dict(hidden_size=32, num_experts=4, moe_intermediate_size=16,
                                         num_experts_per_tok=2,
                                         shared_expert_intermediate_size=24)),
    "gemma4": dict(text_config=dict(hidden_size=32, num_experts=4, moe_intermediate_size=16,
                                    top_k_experts=2, enable_moe_block=True,
                                    hidden_activation="gelu_pytorch_tanh")),
    # a checkpoint's config.json: the text_config's legacy names, no model_type, "swigluoai"
    "step3p7": dict(text_config=dict(hidden_size=32, moe_num_experts=4, moe_intermediate_size=16,
                                     moe_top_k=2, share_expert_dims=24,
                                     hidden_act="swigluoai")),
    "granitemoeshared": dict(hidden_size=32, num_local_experts=4, intermediate_size=16,
                             num_experts_per_tok=2, shared_intermediate_size=8),
    "hunyuan_v1_moe": dict(hidden_size=32, num_experts=[4, 6], intermediate_size=16,
                           moe_topk=[2, 3]),
    # no shared experts: transformers builds one shared MLP of intermediate_size
    "hy_v3": dict(hidden_size=32, num_experts=4, moe_intermediate_size=16, num_experts_per_tok=2,
                  num_shared_experts=0, intermediate_size=24),
    "dbrx": dict(d_model=32, ffn_config=dict(moe_num_experts=4, ffn_hidden_size=16, moe_top_k=2)),
    "minimax_m3_vl": dict(text_config=dict(hidden_size=32, num_local_experts=4,
                                           intermediate_size=16, num_experts_per_tok=2,
                                           shared_intermediate_size=8)),
    # a checkpoint's config.json: the legacy hybrid_override_pattern
    "nemotron_h": dict(hidden_size=32, n_routed_experts=8, moe_intermediate_size=16,
                       num_experts_per_tok=2, moe_shared_expert_intermediate_size=24,
                       mlp_hidden_act="relu2", hybrid_override_pattern="MEM*E"),
    "kolibri1": dict(hidden_size=32, num_experts=4, moe_intermediate_size=16,
                     num_experts_per_tok=2, shared_expert_intermediate_size=24),
    "beam": dict(hidden_size=32, num_experts=8, moe_intermediate_size=16, num_experts_per_tok=2,
                 n_group=4, topk_group=2),
    "qwen4_exp": dict(text_config=dict(model_type="qwen4_exp_text", hidden_size=32, num_experts=4,
                                       moe_intermediate_size=16, num_experts_per_tok=2,
                                       shared_expert_intermediate_size=24)),
    "laguna": dict(hidden_size=32, num_experts=4, moe_intermediate_size=16, num_experts_per_tok=2,
                   shared_expert_intermediate_size=24, moe_routed_scaling_factor=2.5),
    "diffusion_gemma": dict(text_config=dict(hidden_size=32, num_experts=4,
                                             moe_intermediate_size=16, top_k_experts=2)),
    # its released config.json: the text config as language_config, named DeepSeek-V2's
    "unlimited_ocr": dict(language_config=dict(model_type="deepseek_v2", hidden_size=32,
                                               n_routed_experts=4, moe_intermediate_size=16,
                                               num_experts_per_tok=2)),
}


def _random_layer(config, seed=1, **kw):
  """hf.moe_layer(config, **kw) with numpy's random values in all its variables, the selection
  bias included: the converters' checks need values, not the layer's initializers (a compiled
  program for each shape)."""
  graph, state = nnx.split(nnx.eval_shape(lambda: hf.moe_layer(config, **kw)))
  rng = np.random.default_rng(seed)
  return nnx.merge(graph, jax.tree.map(
      lambda a: jnp.asarray(rng.standard_normal(a.shape).astype(a.dtype)), state))


@pytest.mark.parametrize("model_type", sorted(MINIMAL_CONFIGS))
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_layer_to_hf_to_layer_is_exact(model_type, layout):
  """No torch needed: a layer built from a hand-written config, its (random) parameters to the
  block's state dict and back, exactly; the state dict has exactly the family's keys."""
  config = dict(MINIMAL_CONFIGS[model_type], model_type=model_type)
  index = 1 if model_type == "hunyuan_v1_moe" else None  # its sizes differ by layer
  layer = _random_layer(config, gate_up_layout=layout, use_bias=model_type == "gpt_oss",
                        layer=index)
  params = hf.layer_params(layer)
  state = hf.hf_state_from_layer(config, params, gate_up_layout=layout, layer=index)
  assert set(state) == set(hf.hf_keys(config))
  again = hf.layer_params_from_hf(config, state, gate_up_layout=layout, layer=index)
  assert set(again) == set(params)
  for k in params:
    assert np.array_equal(again[k], params[k]), k


def test_layer_kwargs_read_the_names_of_the_checkpoints():
  """Sarvam's config.json has num_experts and num_shared_experts where transformers' config has
  n_routed_experts and n_shared_experts (it renames them on loading): both read alike."""
  ours = dict(model_type="sarvam_moe", hidden_size=32, n_routed_experts=8,
              moe_intermediate_size=16, num_experts_per_tok=2, n_shared_experts=2)
  theirs = dict(model_type="sarvam_moe", hidden_size=32, num_experts=8, moe_intermediate_size=16,
                num_experts_per_tok=2, num_shared_experts=2)
  assert hf.layer_kwargs(theirs) == hf.layer_kwargs(ours)
  assert hf.layer_kwargs(ours)["num_shared_experts"] == 2


def test_step3p5_refuses_its_clamped_layers():
  """Step-3.7's clamped layers (SiLU, then the clamp) have no layer activation: refused, the
  others read. Its MoE layers as its hub configs list them (moe_layers_enum; without it the
  first three layers are dense, as transformers derives them)."""
  config = {"model_type": "step3p7", "text_config": {
      **MINIMAL_CONFIGS["step3p7"]["text_config"], "swiglu_limits_shared": [0.0, 16.0],
      "moe_layers_enum": "0,1"}}
  with pytest.raises(ValueError, match="dense one .moe_layers_enum does not list it"):
    hf.layer_kwargs(dict(config, text_config=dict(config["text_config"], moe_layers_enum=[1])),
                    layer=0)
  with pytest.raises(ValueError, match="dense one .moe_layers_enum does not list it"):
    hf.layer_kwargs(dict(config, text_config=dict(config["text_config"], moe_layers_enum=None)),
                    layer=1)
  with pytest.raises(ValueError, match="pass layer="):
    hf.layer_kwargs(config)
  with pytest.raises(ValueError, match="layer 1 clamps"):
    hf.layer_kwargs(config, layer=1)
  kw = hf.layer_kwargs(config, layer=0)
  assert (kw["activation"], kw["num_experts"], kw["top_k"], kw["shared_expert_dim"]) == (
      "swiglu", 4, 2, 24)


def test_nemotron_h_layers_by_their_mixer():
  """No torch needed: a NemotronH decoder layer has one mixer, the MoE block only where
  layers_block_type (a checkpoint's hybrid_override_pattern) says "moe"; its experts one by one
  under a checkpoint's backbone.layers; its latent-space experts refused."""
  config = dict(MINIMAL_CONFIGS["nemotron_h"], model_type="nemotron_h")
  for layer in (0, 2, 3):
    with pytest.raises(ValueError, match=f"decoder layer {layer} .* dense one .layers_block_type"):
      hf.layer_kwargs(config, layer=layer)
  typed = {k: v for k, v in config.items() if k != "hybrid_override_pattern"}
  typed["layers_block_type"] = ["moe", "linear_attention"]
  assert hf.layer_kwargs(typed, layer=0) == hf.layer_kwargs(config, layer=4)
  with pytest.raises(ValueError, match="dense one .layers_block_type says 'linear_attention'"):
    hf.layer_kwargs(typed, layer=1)
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config)))
  hub = {f"backbone.layers.1.mixer.{k}": v for k, v in state.items()
         if not k.startswith("experts.")}
  for e in range(8):
    hub |= {f"backbone.layers.1.mixer.experts.{e}.{name}.weight": state[f"experts.{name}"][e]
            for name in ("up_proj", "down_proj")}
  block = hf.block_state_dict(config, hub, layer=1)
  assert set(block) == set(state) and all(np.array_equal(block[k], state[k]) for k in state)
  with pytest.raises(ValueError, match="moe_latent_size"):
    hf.layer_kwargs(dict(config, moe_latent_size=8))
  # its layer count is its mixers' (the config class has no num_hidden_layers field)
  with pytest.raises(ValueError, match=r"index in \[0, 5\), got 5"):
    hf.layer_kwargs(config, layer=5)
  # a shared expert of width 0 is one of intermediate_size, as transformers builds it
  zero = hf.layer_kwargs(dict(config, moe_shared_expert_intermediate_size=0, intermediate_size=40),
                         layer=1)
  assert (zero["num_shared_experts"], zero["shared_expert_dim"]) == (1, 40)
  # its multimodal models (NemotronH-Omni's released config.json names its text config llm_config)
  text = {k: v for k, v in config.items() if k != "model_type"}
  for wrapper in (dict(model_type="nemotron_h_omni", llm_config=config),
                  dict(model_type="nemo_speechlm", text_config=text)):
    assert hf.layer_kwargs(wrapper, layer=1) == hf.layer_kwargs(config, layer=1)
    model = {f"model.language_model.layers.1.mixer.{k}": v for k, v in state.items()}
    block = hf.block_state_dict(wrapper, model, layer=1)
    assert set(block) == set(state) and all(np.array_equal(block[k], state[k]) for k in state)


def test_laguna_refuses_a_softcapped_router():
  """Laguna's router logits softcapped (c tanh(logit / c)) have no Router: refused by field."""
  config = dict(MINIMAL_CONFIGS["laguna"], model_type="laguna")
  for cap in (0.0, -1.0):  # transformers softcaps only with a positive cap
    assert hf.layer_kwargs(dict(config, moe_router_logit_softcapping=cap)) == hf.layer_kwargs(
        config)
  with pytest.raises(ValueError, match="moe_router_logit_softcapping=30.0"):
    hf.layer_kwargs(dict(config, moe_router_logit_softcapping=30.0))


def test_deepseek_v4_layers_of_both_kinds():
  """No torch needed: DeepSeek-V4's first layers are hash-routed (no selection bias; its table
  gate.tid2eid the caller's), the rest top-K: the converters take layer= and say so without it;
  a checkpoint's num_hash_layers reads as mlp_layer_types does."""
  config = dict(model_type="deepseek_v4", hidden_size=32, n_routed_experts=4,
                moe_intermediate_size=16, num_experts_per_tok=2, swiglu_limit=10.0,
                mlp_layer_types=["hash_moe", "moe"])
  with pytest.raises(ValueError, match="pass layer="):
    hf.layer_kwargs(config)
  hashed = hf.layer_kwargs(config, layer=0)
  assert "bias_update_rate" not in hashed and hashed["fixed_selection"]
  assert hf.layer_kwargs(config, layer=1)["bias_update_rate"] == 1e-3
  with pytest.raises(ValueError, match="layer=2 is not a decoder layer"):
    hf.layer_kwargs(config, layer=2)
  with pytest.raises(ValueError, match="pass its selection as expert_ids"):
    _random_layer(config, layer=0)(np.zeros((3, 32), np.float32))
  legacy = {k: v for k, v in config.items() if k != "mlp_layer_types"}
  legacy.update(num_hash_layers=1, num_hidden_layers=2)
  for layer in (0, 1):
    assert hf.layer_kwargs(legacy, layer=layer) == hf.layer_kwargs(config, layer=layer)
    state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config, layer=layer)),
                                   layer=layer)
    assert ("gate.e_score_correction_bias" in state) == (layer == 1)
    assert set(state) == set(hf.hf_keys(config, layer=layer))
    table = {"gate.tid2eid": np.zeros((64, 2), np.int64)} if layer == 0 else {}
    again = hf.layer_params_from_hf(config, {**state, **table}, layer=layer)
    assert all(np.array_equal(again[k], v) for k, v in
               hf.layer_params_from_hf(config, state, layer=layer).items())


def test_kimi_k25_language_model_is_deepseek_v3():
  """Kimi-K2.5's text_config is DeepSeek-V3's, its model_type "deepseek_v3" (transformers'
  to_dict) or "kimi_k2" (its config.json); its layers' keys are under model.language_model."""
  v3 = dict(MINIMAL_CONFIGS["deepseek_v3"], model_type="deepseek_v3")
  for name in ("deepseek_v3", "kimi_k2"):
    config = dict(model_type="kimi_k25", text_config=dict(v3, model_type=name))
    assert hf.layer_kwargs(config) == hf.layer_kwargs(v3)
    state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config)))
    assert set(state) == set(hf.hf_keys(v3))
    model = {f"model.language_model.layers.3.mlp.{k}": v for k, v in state.items()}
    block = hf.block_state_dict(config, model, layer=3)
    assert set(block) == set(state) and all(np.array_equal(block[k], state[k]) for k in state)


def test_converters_refuse_a_state_dict_that_does_not_fit():
  config = dict(MINIMAL_CONFIGS["mixtral"], model_type="mixtral")
  layer = _random_layer(config)
  state = hf.hf_state_from_layer(config, hf.layer_params(layer))
  with pytest.raises(TypeError, match=r"hf_state_from_layer\(config, layer_params\(module\)\)"):
    hf.hf_state_from_layer(config, layer)
  with pytest.raises(ValueError, match="missing keys.*gate.weight"):
    hf.layer_params_from_hf(config, {k: v for k, v in state.items() if k != "gate.weight"})
  with pytest.raises(ValueError, match="unexpected keys.*experts.bias"):
    hf.layer_params_from_hf(config, {**state, "experts.bias": np.zeros(4)})
  with pytest.raises(ValueError, match="not a supported MoE family .*routed_experts"):
    hf.layer_kwargs({"model_type": "phimoe"})
  with pytest.raises(ValueError, match="did you mean 'deepseek_v3'"):
    hf.layer_kwargs({"model_type": "deepseekv3"})
  assert hf.family("llama4").model_type == "llama4_text"  # a multimodal model's model_type
  with pytest.raises(ValueError, match="enable_moe_block=False"):  # a dense Gemma 4
    hf.layer_kwargs({"model_type": "gemma4", "text_config": {
        **MINIMAL_CONFIGS["gemma4"]["text_config"], "enable_moe_block": False}})
  omni = {"model_type": "qwen3_omni_moe", "thinker_config": {"text_config": {}},
          "talker_config": {"text_config": {}}}
  with pytest.raises(ValueError, match=r"config\['thinker_config'\]\['text_config'\] or"):
    hf.layer_kwargs(omni)
  # Shapes that do not fit the config, named by layer parameter (a reshape or an axis that the
  # conversion cannot make, with the state dict's shapes).
  with pytest.raises(ValueError, match=r"'w2': \(\(4, 32, 8\), \(4, 16, 32\)\)"):
    hf.layer_params_from_hf(config, {**state, "experts.down_proj": np.zeros((4, 8, 32))})
  with pytest.raises(ValueError, match=r"its shapes .*'gate.weight': \(128,\)"):
    hf.layer_params_from_hf(config, {**state, "gate.weight": np.zeros(128)})
  with pytest.raises(ValueError, match=r"params: shapes .*'w1'"):
    hf.hf_state_from_layer(config, {**hf.layer_params(_random_layer(config)),
                                    "w1": np.zeros((3, 5, 7))}, gate_up_layout="concat")
  # Nothing guessed or dropped: a State's layout, parts the block has no place for (the layer's
  # biases for this family), a whole model's state dict (named by a few keys)
  params = hf.layer_params(_random_layer(config))
  with pytest.raises(ValueError, match="params do not say their gate/up layout"):
    hf.hf_state_from_layer(config, dict(params))
  with pytest.raises(ValueError, match=r"has no place for the layer's \['b1', 'b2'\]"):
    hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config, use_bias=True)))
  with pytest.raises(ValueError, match="and 20 more.*a whole model's state dict"):
    hf.layer_params_from_hf(config, {**state, **{f"model.layers.{i}.w": np.zeros(2)
                                                 for i in range(30)}})
  with pytest.raises(ValueError, match="hidden size must be a whole number, got 32.7"):
    hf.layer_kwargs({**config, "hidden_size": 32.7})
  with pytest.raises(ValueError, match="none of the fields \\('hidden_size',\\)"):
    hf.layer_kwargs({k: v for k, v in config.items() if k != "hidden_size"})
  with pytest.raises(TypeError, match="config must be a dict"):
    hf.moe_layer("mixtral")
  oai = dict(MINIMAL_CONFIGS["gpt_oss"], model_type="gpt_oss", swiglu_limit=None)
  with pytest.raises(ValueError, match=r"config\['swiglu_limit'\] must be a number, got None"):
    hf.layer_kwargs(oai)
  assert hf.layer_kwargs(dict(oai, swiglu_limit=np.float32(7.0)))["activation"] == "clamped_swiglu"
  layer = _random_layer(config)
  with pytest.raises(ValueError, match="shape"):
    hf.load_into_layer(layer, {**hf.layer_params(layer), "w2": np.zeros((4, 8, 32))})
  with pytest.raises(ValueError, match="no \\['b1'\\]"):
    hf.load_into_layer(layer, {**hf.layer_params(layer), "b1": np.zeros((4, 32))})
  # A plain mapping says no layout: named, or refused for a GLU layer.
  with pytest.raises(ValueError, match="params do not say their gate/up layout"):
    hf.load_into_layer(layer, dict(hf.layer_params(layer)))
  with pytest.raises(ValueError, match="params hold w1 in the 'interleaved' gate/up layout"):
    hf.load_into_layer(layer, dict(hf.layer_params(layer)), gate_up_layout="interleaved")
  hf.load_into_layer(layer, dict(hf.layer_params(layer)), gate_up_layout="concat")
  # Arrays that are not weights, by key: quantized, integer, NumPy's raw bytes of a bfloat16, and
  # a torch bfloat16 tensor (which NumPy cannot take).
  down = state["experts.down_proj"]
  for bad, message in ((down.astype(ml_dtypes.float8_e4m3fn), "float8_e4m3fn.*dequantize"),
                       (down.astype(np.int32), "int32"),
                       (down.astype(ml_dtypes.bfloat16).view("V2"), "raw bytes")):
    with pytest.raises(TypeError, match=r"state_dict\['experts.down_proj'\] has dtype .*" + message):
      hf.layer_params_from_hf(config, {**state, "experts.down_proj": bad})

  class TorchBFloat16:
    def __array__(self, *args, **kwargs):
      raise TypeError("Got unsupported ScalarType BFloat16")

  with pytest.raises(TypeError, match=r"\['gate.weight'\] \(TorchBFloat16\).*float\(\).cpu\(\).numpy"):
    hf.layer_params_from_hf(config, {**state, "gate.weight": TorchBFloat16()})
  # Decoder layer indexes: negative, not an int, past the config's layers or a per-layer list.
  for bad in (-1, 4):
    with pytest.raises(ValueError, match=r"layer must be a decoder layer's index in \[0, 4\)"):
      hf.layer_kwargs({**config, "num_hidden_layers": 4}, layer=bad)
  for bad, kind in (("1", "str"), (True, "bool"), (1.0, "float")):
    with pytest.raises(TypeError, match=rf"layer must be a decoder layer's index \(an int\), "
                                        rf"got {kind}"):
      hf.layer_kwargs({**config, "num_hidden_layers": 4}, layer=bad)
  hunyuan = dict(MINIMAL_CONFIGS["hunyuan_v1_moe"], model_type="hunyuan_v1_moe")
  with pytest.raises(ValueError, match=r"in \[0, 2\) \(config\['num_experts'\] has 2"):
    hf.layer_kwargs(hunyuan, layer=2)
  # Its converters need the layer too: unchecked, a block of the other layer would convert.
  layer1 = hf.layer_params(_random_layer(hunyuan, layer=1))
  with pytest.raises(ValueError, match="per-layer list .*pass layer="):
    hf.hf_state_from_layer(hunyuan, layer1)
  with pytest.raises(ValueError,
                     match=r"shapes that do not fit .*'router': \(\(32, 6\), \(32, 4\)"):
    hf.hf_state_from_layer(hunyuan, layer1, layer=0)
  for bad in (True, "1"):  # hf_keys reads the per-layer lists too
    with pytest.raises(TypeError, match=r"decoder layer's index \(an int\)"):
      hf.hf_keys(hunyuan, layer=bad)
    with pytest.raises(TypeError, match=r"decoder layer's index \(an int\)"):
      hf.hf_keys({**config, "num_hidden_layers": 4}, layer=bad)
  # Dense decoder layers, as transformers' decoder layers choose them.
  qwen = dict(MINIMAL_CONFIGS["qwen2_moe"], model_type="qwen2_moe", mlp_only_layers=[0],
              decoder_sparse_step=2)
  v3 = dict(MINIMAL_CONFIGS["deepseek_v3"], model_type="deepseek_v3", first_k_dense_replace=1)
  llama4 = dict(MINIMAL_CONFIGS["llama4"]["text_config"], interleave_moe_layer_step=2,
                num_hidden_layers=4)  # MoE layers 1 and 3, as transformers derives moe_layers
  ernie = dict(MINIMAL_CONFIGS["ernie4_5_moe"], model_type="ernie4_5_moe", num_hidden_layers=4,
               moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1)
  for c, layer, why in ((qwen, 0, "in mlp_only_layers"), (qwen, 2, "decoder_sparse_step=2"),
                        (v3, 0, "first_k_dense_replace=1"), (llama4, 2, "interleave_moe"),
                        (ernie, 0, "moe_layer_interval=1, moe_layer_start_index=1")):
    with pytest.raises(ValueError, match=f"decoder layer {layer} .* is a dense one \\({why}"):
      hf.layer_kwargs(c, layer=layer)
    with pytest.raises(ValueError, match=f"decoder layer {layer} .* is a dense one \\({why}"):
      hf.hf_keys(c, layer=layer)
  assert hf.layer_kwargs(qwen, layer=1) == hf.layer_kwargs(qwen)
  assert hf.layer_kwargs(v3, layer=1) == hf.layer_kwargs(v3)
  assert hf.layer_kwargs(llama4, layer=3) == hf.layer_kwargs(llama4)
  assert hf.layer_kwargs(ernie, layer=3) == hf.layer_kwargs(ernie)  # -1: up to the last layer
  # mlp_layer_types decides alone where given (EXAONE-MoE and others keep first_k_dense_replace
  # beside it); a multi-token-prediction layer follows the decoder's.
  typed = dict(v3, mlp_layer_types=["sparse", "dense"], num_hidden_layers=2,
               num_nextn_predict_layers=1)
  assert hf.layer_kwargs(typed, layer=0) == hf.layer_kwargs(typed)
  with pytest.raises(ValueError, match="mlp_layer_types says dense"):
    hf.layer_kwargs(typed, layer=1)
  assert hf.layer_kwargs(dict(v3, num_hidden_layers=2, num_nextn_predict_layers=1), layer=2)

  class TransformersConfig:  # a config object: read through its to_dict()
    def to_dict(self):
      return v3

  assert hf.layer_kwargs(TransformersConfig()) == hf.layer_kwargs(v3)
  assert hf.family(TransformersConfig()).model_type == "deepseek_v3"


def test_params_carry_their_gate_up_layout():
  """A layer's parameters carry its gate/up layout: mapped back without naming it they give the
  block's state exactly, and loading params of the other layout is refused."""
  config = dict(MINIMAL_CONFIGS["qwen2_moe"], model_type="qwen2_moe")
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config)))
  layer = hf.moe_layer(config, state, gate_up_layout="interleaved")
  params = hf.layer_params(layer)
  assert params.gate_up_layout == "interleaved"
  back = hf.hf_state_from_layer(config, params)
  assert set(back) == set(state) and all(np.array_equal(back[k], state[k]) for k in state)
  with pytest.raises(ValueError, match="gate_up_layout='concat', but params hold"):
    hf.hf_state_from_layer(config, params, gate_up_layout="concat")
  with pytest.raises(ValueError, match="params hold w1 in the 'concat' gate/up layout"):
    hf.load_into_layer(layer, hf.layer_params_from_hf(config, state))
  # The layout survives jax.tree.map (a pytree), copies and merges.
  for kept in (jax.tree.map(lambda a: a * 2, params), params.copy(), params | {"w2": 0}):
    assert kept.gate_up_layout == "interleaved"
  np.testing.assert_array_equal(jax.tree.map(lambda a: a * 2, params)["w1"], 2 * params["w1"])
  # A State of gradients does not say its layout: given, it is carried.
  grads = nnx.state(layer, nnx.Param)
  assert hf.layer_params(grads, gate_up_layout="interleaved").gate_up_layout == "interleaved"
  assert hf.layer_params(grads).gate_up_layout is None


def test_block_state_dict_takes_one_layer_out_of_a_model():
  config = dict(MINIMAL_CONFIGS["qwen2_moe"], model_type="qwen2_moe")
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config)))
  model = {f"model.layers.{i}.mlp.{k}": v + i for i in range(2) for k, v in state.items()}
  model["model.layers.1.self_attn.q_proj.weight"] = np.zeros(3)
  block = hf.block_state_dict(config, model, layer=1)
  assert set(block) == set(state)
  assert all(np.array_equal(block[k], state[k] + 1) for k in state)
  # Gemma 4's keys are the decoder layer's, beside its dense MLP and norms: only the MoE's taken
  config = dict(MINIMAL_CONFIGS["gemma4"], model_type="gemma4")
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config)))
  for prefix in ("model.layers.0.", "model.language_model.layers.0."):  # text, multimodal model
    model = {f"{prefix}{k}": v for k, v in state.items()}
    model[f"{prefix}mlp.gate_proj.weight"] = np.zeros(3)
    model[f"{prefix}pre_feedforward_layernorm_2.weight"] = np.zeros(3)
    assert set(hf.block_state_dict(config, model, layer=0)) == set(state) == {
        "router.proj.weight", "router.scale", "router.per_expert_scale", "experts.gate_up_proj",
        "experts.down_proj"}
  # Keys under the block's modules that the converters do not read: refused, not dropped.
  model = {f"model.layers.0.{k}": v for k, v in state.items()}
  for extra in ("experts.0.w1.weight", "experts.down_proj_scale_inv"):
    with pytest.raises(ValueError, match=rf"keys not read \['{extra}'\].*with transformers"):
      hf.block_state_dict(config, {**model, f"model.layers.0.{extra}": np.zeros(3)}, layer=0)
  with pytest.raises(ValueError, match="'model.layers.1.' or 'model.language_model.layers.1.'"):
    hf.block_state_dict(config, model, layer=1)


# transformers' Hub layout of each case's block (`hf_reference.hub_checkpoint`) where it differs
# from the in-memory one, by the keys that show it.
_HUB_LAYOUTS = {"mixtral": "block_sparse_moe.experts.0.w1.weight",
                "qwen2_moe": "mlp.experts.0.gate_proj.weight",
                "deepseek_v3": "mlp.experts.0.gate_proj.weight",
                "glm4v_moe_text": "mlp.experts.0.gate_proj.weight",
                "lfm2_moe": "feed_forward.experts.0.w1.weight",
                "deepseek_v4": "ffn.shared_experts.w1.weight",
                "granitemoeshared": "block_sparse_moe.router.layer.weight",
                "aria_text": "mlp.experts.fc1.weight",
                "step3p5": "layers.0.moe.gate_proj.weight",
                "hy_v3": "mlp.router.gate.weight",
                "beam": "mlp.experts.0.gate_proj.weight",
                "nemotron_h": "backbone.layers.0.mixer.experts.0.up_proj.weight",
                "kolibri1": "layers.0.moe.router.expert_bias",
                "mistral_large4_text": "layers.0.experts.0.w1.weight",
                "axk2": "mlp.experts.0.gate_proj.weight",
                "laguna": "mlp.experts.e_score_correction_bias"}


@pytest.mark.parametrize("case", CASES)
def test_hub_checkpoint_loads_as_the_in_memory_block(references, case):
  """A whole Hub checkpoint's tensors (transformers' conversion for save_pretrained of the
  block as decoder layer 0) give the block's in-memory state dict exactly."""
  r = references.get(case)
  # The reference puts the block under model.layers.0; the family's own models may hold their
  # text model elsewhere (a multimodal model's, Qwen3-Omni's thinker or talker).
  prefix = hf.family(_config(r)).prefix
  root = prefix[:prefix.index("layers.{layer}.")] + "layers.0." if "layers.{layer}." in (
      prefix) else "model.layers.0."
  hub = {root + k[len("hub/model.layers.0."):] if k.startswith("hub/model.layers.0.") else
         k[len("hub/"):]: v for k, v in r.items() if k.startswith("hub/")}
  if case in _HUB_LAYOUTS:
    assert any(k.endswith(_HUB_LAYOUTS[case]) for k in hub), sorted(hub)
  block = hf.block_state_dict(_config(r), hub, layer=0)
  state = _state(r)
  assert sorted(block) == sorted(state)
  for k, v in state.items():
    np.testing.assert_array_equal(block[k], v, err_msg=k)


@pytest.mark.parametrize("model_type,root,module", [
    ("deepseek_ocr2", "model.layers.1.", "mlp"),  # DeepSeek-OCR-2's language model
    ("minimax_m3_vl", "language_model.model.layers.1.", "block_sparse_moe"),
    ("kimi_k25", "language_model.model.layers.1.", "mlp"),
    ("deepseek_v4", "layers.1.", "ffn")])
def test_block_state_dict_finds_released_checkpoints_roots(model_type, root, module):
  """Released checkpoints root their decoder layers otherwise than the model transformers builds
  (which moves them on loading): the block is found there too."""
  text = dict(MINIMAL_CONFIGS["deepseek_v3"], first_k_dense_replace=0, n_group=1, topk_group=1)
  config = {"deepseek_ocr2": dict(text, model_type="deepseek_ocr2_text"),
            "minimax_m3_vl": dict(MINIMAL_CONFIGS["minimax_m3_vl"], model_type="minimax_m3_vl"),
            "kimi_k25": dict(model_type="kimi_k25", text_config=dict(text,
                                                                     model_type="deepseek_v3")),
            "deepseek_v4": dict(model_type="deepseek_v4", hidden_size=32, n_routed_experts=4,
                                moe_intermediate_size=16, num_experts_per_tok=2,
                                mlp_layer_types=["moe", "moe"])}[model_type]
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config, layer=1)),
                                 layer=1)
  block = hf.block_state_dict(config, {f"{root}{module}.{k}": v for k, v in state.items()},
                              layer=1)
  assert set(block) == set(state) and all(np.array_equal(block[k], state[k]) for k in state)


def test_mistral_large4_released_checkpoint_layout():
  """Mistral Large 4's released checkpoint holds the block as its decoder layer's own modules
  under "layers.{i}.", its experts one by one and its shared experts as w1 (gate), w3 (up) and
  w2 (down); its first decoder layer is dense (first_k_dense_replace, 1 by default)."""
  config = MINIMAL_CONFIGS["mistral_large4"] | {"model_type": "mistral_large4"}
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config, layer=1)),
                                 layer=1)
  hub = {"layers.1.gate.weight": state["gate.weight"],
         "layers.1.attention.wq.weight": np.zeros((4, 32))}
  for name, key in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
    hub[f"layers.1.shared_experts.{name}.weight"] = state[f"shared_experts.{key}.weight"]
  for e, (gate_up, down) in enumerate(zip(state["experts.gate_up_proj"],
                                          state["experts.down_proj"])):
    gate, up = np.split(gate_up, 2)
    hub |= {f"layers.1.experts.{e}.w1.weight": gate, f"layers.1.experts.{e}.w3.weight": up,
            f"layers.1.experts.{e}.w2.weight": down}
  block = hf.block_state_dict(config, hub, layer=1)
  assert set(block) == set(state) and all(np.array_equal(block[k], state[k]) for k in state)
  dense = {"layers.0.feed_forward.w1.weight": np.zeros((16, 32))}
  with pytest.raises(ValueError, match="dense one .first_k_dense_replace=1"):
    hf.block_state_dict(config, dense, layer=0)


def test_unlimited_ocr_and_diffusion_gemma_read_as_their_text_block():
  """Unlimited-OCR's released config.json holds its text config as language_config, which
  transformers reads as its own text config whatever model_type it names (dense layers from
  first_k_dense_replace; never renormalised, as DeepSeek-OCR-2, whatever norm_topk_prob says);
  its checkpoint roots the layers at model.layers. DiffusionGemma's
  encoder ties its layers' weights to its decoder's: the block under either."""
  text = dict(hidden_size=32, n_routed_experts=4, moe_intermediate_size=16,
              num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=2)
  config = dict(model_type="unlimited_ocr", language_config=dict(text, model_type="deepseek_v2"))
  assert hf.family(config).model_type == "unlimited_ocr_text"
  assert hf.layer_kwargs(config, layer=1) == hf.layer_kwargs(
      dict(text, model_type="unlimited_ocr_text"), layer=1)
  with pytest.raises(ValueError, match=r"is a dense one \(first_k_dense_replace=1\)"):
    hf.layer_kwargs(config, layer=0)
  for model_type in ("unlimited_ocr_text", "deepseek_ocr2_text"):  # their routers never renormalise
    renorm = dict(text, model_type=model_type, norm_topk_prob=True)
    assert not hf.layer_kwargs(renorm, layer=1)["routing"].renormalize
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config, layer=1)),
                                 layer=1)
  block = hf.block_state_dict(config, {f"model.layers.1.mlp.{k}": v for k, v in state.items()},
                              layer=1)
  assert set(block) == set(state) and all(np.array_equal(block[k], state[k]) for k in state)
  config = dict(MINIMAL_CONFIGS["diffusion_gemma"], model_type="diffusion_gemma")
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config)))
  decoder, encoder = "model.decoder.layers.0.", "model.encoder.language_model.layers.0."
  for prefixes in ((decoder, encoder), (decoder,), (encoder,)):
    model = {f"{p}{k}": v for p in prefixes for k, v in state.items()}
    model[f"{prefixes[0]}pre_feedforward_layernorm_2.weight"] = np.zeros(3)
    block = hf.block_state_dict(config, model, layer=0)
    assert set(block) == set(state) and all(np.array_equal(block[k], state[k]) for k in state)


def test_block_state_dict_reads_only_the_layer_and_explains_what_it_cannot():
  config = dict(MINIMAL_CONFIGS["mixtral"], model_type="mixtral", num_hidden_layers=2)
  state = hf.hf_state_from_layer(config, hf.layer_params(_random_layer(config)))
  e, two_n, _ = state["experts.gate_up_proj"].shape
  per_expert = {"gate.weight": state["gate.weight"]}
  for i in range(e):  # Mixtral's Hub layout: w1 gate, w3 up, w2 down
    gate, up = np.split(state["experts.gate_up_proj"][i], 2)
    per_expert |= {f"experts.{i}.w1.weight": gate, f"experts.{i}.w3.weight": up,
                   f"experts.{i}.w2.weight": state["experts.down_proj"][i]}
  model = {f"model.layers.{j}.block_sparse_moe.{k}": v for j in range(2)
           for k, v in per_expert.items()}
  model["model.layers.1.self_attn.q_proj.weight"] = np.zeros(3)

  class Lazy(dict):  # a lazily read checkpoint: records what is read
    read = set()

    def __getitem__(self, key):
      self.read.add(key)
      return super().__getitem__(key)

  lazy = Lazy(model)
  block = hf.block_state_dict(config, lazy, layer=1)
  assert all(np.array_equal(block[k], state[k]) for k in state) and set(block) == set(state)
  assert lazy.read == {k for k in model if k.startswith("model.layers.1.block_sparse_moe.")}
  del model["model.layers.0.block_sparse_moe.experts.2.w3.weight"]
  with pytest.raises(ValueError, match=r"one by one lack \['experts.2.w3.weight'\]"):
    hf.block_state_dict(config, model, layer=0)
  for bad in (-1, 2):
    with pytest.raises(ValueError, match=r"layer must be a decoder layer's index in \[0, 2\)"):
      hf.block_state_dict(config, model, layer=bad)
  for bad in (True, 1.0):
    with pytest.raises(TypeError, match=r"layer must be a decoder layer's index \(an int\)"):
      hf.block_state_dict(config, model, layer=bad)
  # Step-3.5/3.7's Hub layout (the decoder layer's moe.* and share_expert.*): a key of its parts
  # that is not read is refused.
  step = dict(MINIMAL_CONFIGS["step3p7"], model_type="step3p7")
  state = hf.hf_state_from_layer(step, hf.layer_params(_random_layer(step)), layer=3)
  gate, up = np.split(state["experts.gate_up_proj"], 2, axis=1)
  hub = {"moe.gate.weight": state["gate.weight"], "moe.gate_proj.weight": gate,
         "moe.up_proj.weight": up, "moe.down_proj.weight": state["experts.down_proj"],
         "moe.router_bias": state["gate.e_score_correction_bias"],
         **{f"share_expert.{k}_proj.weight": state[f"shared_experts.{k}_proj.weight"]
            for k in ("gate", "up", "down")}}
  # Under its released checkpoint's root (model.layers.) and its multimodal model's.
  for root in ("model.layers.3.", "model.language_model.layers.3."):
    block = hf.block_state_dict(step, {root + k: v for k, v in hub.items()}, layer=3)
    assert set(block) == set(state) and all(np.array_equal(block[k], state[k]) for k in state)
  hub = {f"model.language_model.layers.3.{k}": v for k, v in hub.items()}
  hub["model.language_model.layers.3.moe.gate_proj.weight_scale_inv"] = np.zeros(3)
  with pytest.raises(ValueError, match=r"keys not read \['moe.gate_proj.weight_scale_inv'\]"):
    hf.block_state_dict(step, hub, layer=3)
  # A dense layer: the reason, as layer_kwargs gives it.
  v3 = dict(MINIMAL_CONFIGS["deepseek_v3"], model_type="deepseek_v3", num_hidden_layers=4,
            first_k_dense_replace=1, num_nextn_predict_layers=1)
  with pytest.raises(ValueError, match=r"layer 0 is a dense one \(first_k_dense_replace=1\)"):
    hf.block_state_dict(v3, {"model.layers.0.mlp.gate_proj.weight": np.zeros(3)}, layer=0)
  with pytest.raises(ValueError, match=r"\[0, 5\) \(the last 1: multi-token-prediction"):
    hf.layer_kwargs(v3, layer=5)
  qwen = dict(MINIMAL_CONFIGS["qwen2_moe"], model_type="qwen2_moe", num_experts=0)
  with pytest.raises(ValueError, match=r"dense one \(num_experts=0\)"):
    hf.layer_kwargs(qwen, layer=0)
  with pytest.raises(ValueError, match=r"num_experts=0: its decoder layers are dense"):
    hf.layer_kwargs(qwen)
  with pytest.raises(TypeError, match=r"decoder layer's index \(an int\), got None"):
    hf.block_state_dict(config, model, layer=None)
  with pytest.raises(TypeError, match=r"takes \(config, state_dict, layer=...\)"):
    hf.block_state_dict(model, config, layer=1)  # the other hf functions' order, swapped
  # Experts stored one by one number the config's E: a file of the checkpoint left out is named.
  few = {k: v for k, v in model.items() if ".experts.3." not in k}
  with pytest.raises(ValueError, match=r"lack \['experts.3.w1.weight'.*several files"):
    hf.block_state_dict(config, few, layer=1)
  # One expert's tensor transposed, or all gates against all ups: named by key before stacking.
  odd = dict(model)
  odd["model.layers.1.block_sparse_moe.experts.2.w3.weight"] = np.asarray(
      model["model.layers.1.block_sparse_moe.experts.2.w3.weight"]).T
  with pytest.raises(ValueError, match=r"differ in shape: \['experts.2.w3.weight \(32, 16\)'\], "
                                       r"the others' is \(16, 32\)"):
    hf.block_state_dict(config, odd, layer=1)
  # Half of them transposed: no shape is the others', so every key is named with its shape.
  key = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
  with pytest.raises(ValueError, match=r"differ in shape: \['experts.0.w3.weight \(16, 32\)', "
                                       r"'experts.1.w3.weight \(16, 32\)', 'experts.2.w3"):
    hf.block_state_dict(config, {**odd, key: np.asarray(model[key]).T}, layer=1)
  for i in range(e):
    key = f"model.layers.1.block_sparse_moe.experts.{i}.w1.weight"
    odd[key] = np.asarray(model[key]).T
    odd[key.replace("w1", "w3")] = model[key.replace("w1", "w3")]
  with pytest.raises(ValueError, match=r"experts.0.w1.weight \(32, 16\) and experts.0.w3.weight "
                                       r"\(16, 32\) differ in their input width"):
    hf.block_state_dict(config, odd, layer=1)
  # One block's keys with the model's prefix left on: pointed at block_state_dict.
  prefixed = {f"model.layers.1.block_sparse_moe.{k}": v
              for k, v in hf.block_state_dict(config, model, layer=1).items()}
  with pytest.raises(ValueError, match=r"with their model's prefix\? hf.block_state_dict"):
    hf.layer_params_from_hf(config, prefixed, layer=1)


# --- on the Hopper kernels, bfloat16 -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_family_on_the_hopper_kernels(references, case):
  """The layer in bfloat16 (float32 parameters, bfloat16 compute) on backend="mosaic_gpu", against
  the float64 transformers block at kernel-friendly sizes (d = 256, n = 128; input and weights
  bfloat16-representable), to 2e-2; no role of the backend falls back to XLA."""
  from sonic_jax.backends import _device_is_hopper
  from sonic_jax.mosaic_gpu.backend import FallbackWarning
  if not _device_is_hopper():
    pytest.skip("needs a Hopper GPU (sm90)")
  r = references.get(case, size="gpu")
  config = _config(r)
  jax.clear_caches()  # a fallback warns when traced: trace this family's layer afresh
  with warnings.catch_warnings(record=True) as caught, jax.default_matmul_precision("highest"):
    warnings.simplefilter("always")
    layer = hf.moe_layer(config, _state(r), param_dtype=jnp.float32, dtype=jnp.bfloat16,
                         backend="mosaic_gpu")
    y, logits, g_x, g_params = _value_and_grads(
        layer, jnp.asarray(r["input"], jnp.bfloat16), jnp.asarray(r["cotangent"], jnp.float32), r)
    errs = _errors(config, r, y, logits, g_x, g_params)
  fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
  assert not fallbacks, fallbacks
  worst = max((k for k in errs if k.startswith("grad")), key=errs.get)
  print(f"\n{case} (bfloat16, mosaic_gpu): output {errs['output']:.1e}, worst gradient "
        f"{errs[worst]:.1e} ({worst})")
  bad = {k: v for k, v in errs.items() if not v <= GPU_TOL}
  assert not bad, f"{case}: relative errors above {GPU_TOL}: {bad}"
