"""A config that leaves a field out means its transformers config class's default: `sonic_jax.hf`
reads such a config as transformers builds the block from it. No transformers needed.

tests/data/hf_defaults.json holds, for each family of `hf.FAMILIES` that transformers knows, its
config class's defaults (transformers' version under "transformers") of the fields that hf.py reads
("defaults"), the fields without a default there ("required": the sizes, which the readers demand),
values for required fields that the defaults leave None or out ("set"), and the dense-layer fields
as the class resolves them for 96 decoder layers, more than any class's default ("at_96_layers":
some derive from the layer count). After changing a reader (or its fields), edit the family's entry
and refresh the values under the reference interpreter (tests/test_families.py's, with
transformers), from the repository root:

  .venv-ref/bin/python - <<'EOF'
  import json, transformers
  path = "tests/data/hf_defaults.json"
  data = json.load(open(path))
  data["transformers"] = transformers.__version__
  for model_type, entry in data["families"].items():
    full = transformers.AutoConfig.for_model(model_type).to_dict()
    entry["defaults"] = {k: {s: full[k][s] for s in v} if isinstance(v, dict) else full[k]
                         for k, v in entry["defaults"].items() if k in full}
    full = transformers.AutoConfig.for_model(model_type, num_hidden_layers=96).to_dict()
    entry["at_96_layers"] = {k: full[k] for k in entry["at_96_layers"] if k in full}
  open(path, "w").write(json.dumps(data, indent=1, sort_keys=True) + "\n")
  EOF
"""

from __future__ import annotations

import json
import os

import pytest

from sonic_jax import hf
from sonic_jax.activations import clamped_swiglu
from sonic_jax.routing import Router

with open(os.path.join(os.path.dirname(__file__), "data", "hf_defaults.json")) as f:
  DATA = json.load(f)
FAMILIES = DATA["families"]
# model_types that transformers does not know (remote-code families)
UNKNOWN = {"kimi_k2"}


def _configs(model_type):
  """(full, minimal): the defaults with the required fields set; only the required fields."""
  entry = FAMILIES[model_type]
  full = {"model_type": model_type, **entry["defaults"], **entry.get("set", {})}
  minimal = {"model_type": model_type, **{k: full[k] for k in entry["required"]}}
  return full, minimal


def _layers(config):
  """The decoder layers to read (DeepSeek-V4's first layers are hash-routed, the rest top-K)."""
  return (0, 3) if config["model_type"] == "deepseek_v4" else (None,)


def test_every_family_has_its_defaults():
  assert set(FAMILIES) == set(hf.FAMILIES) - UNKNOWN


def test_kwargs_compare_by_value():
  """Routers and activations are compared with ==: by value, not identity."""
  assert Router("sigmoid", n_group=8, topk_group=4) == Router("sigmoid", n_group=8, topk_group=4)
  assert Router("sigmoid", n_group=8, topk_group=4) != Router("sigmoid", n_group=8, topk_group=2)
  assert Router("softmax") != Router("softmax", renormalize=False)
  assert clamped_swiglu(alpha=1.0, limit=10.0) == clamped_swiglu(alpha=1.0, limit=10.0)
  assert clamped_swiglu(alpha=1.0, limit=10.0) != clamped_swiglu(alpha=1.0, limit=7.0)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_absent_fields_read_as_transformers_defaults(model_type):
  full, minimal = _configs(model_type)
  assert len(minimal) < len(full) or model_type == "hunyuan_v1_moe"
  for layer in _layers(full):
    want = hf.layer_kwargs(full, layer=layer)
    got = hf.layer_kwargs(minimal, layer=layer)
    assert set(got) == set(want)
    diff = {k: (got[k], want[k]) for k in want if not got[k] == want[k]}
    assert not diff, f"{model_type}: (without the fields, with their defaults): {diff}"


def test_deepseek_v3_without_its_routing_fields():
  """DeepseekV3Config's defaults: 8 groups, the best 4 kept, renormalised, times 2.5, one
  shared expert of the experts' width."""
  kw = hf.layer_kwargs(dict(model_type="deepseek_v3", hidden_size=64, n_routed_experts=16,
                            num_experts_per_tok=4, moe_intermediate_size=32))
  assert kw["routing"] == Router("sigmoid", renormalize=True, renorm_epsilon=1e-20, n_group=8,
                                 topk_group=4, group_score="top2_sum",
                                 routed_scaling_factor=2.5)
  assert (kw["num_shared_experts"], kw["shared_expert_dim"]) == (1, 32)
  assert kw["activation"] == "swiglu" and kw["bias_update_rate"] == 1e-3
  # Kimi-K2.5's text config, "kimi_k2" in its config.json: transformers reads it as DeepSeek-V3's
  text = dict(model_type="kimi_k2", hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
              moe_intermediate_size=32)
  assert hf.layer_kwargs(dict(model_type="kimi_k25", text_config=text)) == kw
  assert hf.layer_kwargs(text) == kw


def test_explicit_values_are_kept():
  """A field the config gives is read as given, False and 1 included."""
  kw = hf.layer_kwargs(dict(model_type="deepseek_v3", hidden_size=64, n_routed_experts=16,
                            num_experts_per_tok=4, moe_intermediate_size=32, n_group=1,
                            norm_topk_prob=False, routed_scaling_factor=1.0, n_shared_experts=0))
  assert kw["routing"] == Router("sigmoid", renormalize=False, renorm_epsilon=1e-20,
                                 group_score="top2_sum")
  assert kw["num_shared_experts"] == 0
  # Step-3.7's legacy name of the shared expert's width, beside the default of the new one
  step = dict(model_type="step3p5", hidden_size=64, n_routed_experts=16, num_experts_per_tok=4,
              moe_intermediate_size=32)
  assert hf.layer_kwargs(step)["shared_expert_dim"] == 1280
  assert hf.layer_kwargs({**step, "share_expert_dims": 24})["shared_expert_dim"] == 24


def test_a_shared_width_without_a_default_is_required():
  """The Qwen3-Omni talker's config class has no default shared_expert_intermediate_size (its
  block always has the shared expert): refused, not read as no shared expert."""
  _, minimal = _configs("qwen3_omni_moe_talker_text")
  del minimal["shared_expert_intermediate_size"]
  with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
    hf.layer_kwargs(minimal)


def _is_dense(config, layer):
  """Whether `layer_kwargs` refuses decoder layer `layer` as a dense one."""
  try:
    hf.layer_kwargs(config, layer=layer)
  except ValueError as e:
    if "is a dense one" in str(e):
      return True
    raise
  return False


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_absent_dense_layer_fields_read_as_transformers_defaults(model_type):
  """A config without the fields that make decoder layers dense (first_k_dense_replace and the
  like, which a config saved by transformers leaves out at their defaults) has the dense layers
  of its config class's defaults."""
  full, minimal = _configs(model_type)
  # (NemotronH's config class counts its layers by its mixers: no num_hidden_layers field)
  layers = range(full.get("num_hidden_layers") or len(full.get("layers_block_type") or ()) or 8)
  assert [_is_dense(minimal, i) for i in layers] == [_is_dense(full, i) for i in layers]
  # At another layer count, where the class derives some of them from it (ERNIE's end index -1;
  # NemotronH's count is its mixer list's, which the entry gives)
  at_96 = FAMILIES[model_type]["at_96_layers"]
  full = {**full, **at_96}
  if "num_hidden_layers" in at_96 or not at_96:
    minimal, count = {**minimal, "num_hidden_layers": 96}, 96
  else:
    minimal, count = {**minimal, **at_96}, len(full["layers_block_type"])
  layers = range(count)
  assert [_is_dense(minimal, i) for i in layers] == [_is_dense(full, i) for i in layers]


def test_axk2_dense_layers_from_its_legacy_fields():
  """A.X-K2's config class derives mlp_layer_types, where a config has none, from
  first_k_dense_replace and moe_layer_freq: MoE from layer 2 on, every third layer (as
  AXK2Config(first_k_dense_replace=2, moe_layer_freq=3, num_hidden_layers=10) gives them)."""
  _, minimal = _configs("axk2")
  config = {**minimal, "first_k_dense_replace": 2, "moe_layer_freq": 3, "num_hidden_layers": 10}
  assert [i for i in range(10) if not _is_dense(config, i)] == [3, 6, 9]


def test_the_registries_are_read_only():
  """A process-wide assignment cannot change what a config converts to."""
  for registry in (hf.FAMILIES, hf.WRAPPERS, hf.GLU_OF_HIDDEN_ACT):
    with pytest.raises(TypeError):
      registry["mixtral"] = None
