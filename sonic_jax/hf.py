"""Hugging Face transformers interop: the `MoE` layer of a transformers MoE block, its weights both
ways.

For each supported family (`FAMILIES`, keyed by the config's `model_type`):

- `layer_kwargs(config)`: the `sonic_jax.layers.MoE` arguments (d_model, num_experts, expert_dim,
  top_k, activation, routing, gate_up_layout, biases, shared experts, selection bias) from the
  family's config, given as a dict (`config.to_dict()` or a checkpoint's config.json; a
  transformers config object is read through its to_dict()), read with the family's own field
  names;
- `layer_params_from_hf(config, state_dict)`: the block's state dict (NumPy arrays, keys exactly as
  the block's `state_dict()` in transformers 5.x: relative to the block, e.g. "gate.weight",
  "experts.gate_up_proj") to the layer's parameter arrays, and `hf_state_from_layer` back. Both
  directions only transpose, reshape and reorder: they are exact, and the map is orthogonal, so
  `hf_state_from_layer` also takes the layer's *gradients* to the block's;
- `load_into_layer(module, params)` sets an `MoE` layer's variables, `layer_params(module)` reads
  them (from a layer, or from an `nnx.State` of gradients), and `moe_layer(config, state_dict)`
  builds and loads a layer in one call; `block_state_dict` takes one layer's block out of a whole
  model's state dict. The parameter dicts (`LayerParams`) carry their gate/up layout: loading
  refuses another layout than the layer's, and `hf_state_from_layer` reads it.

A multimodal config holds its language model's as text_config (Llama 4's "llama4", Qwen3.5-MoE's
"qwen3_5_moe", Gemma 4's "gemma4", Qwen3-VL-MoE's "qwen3_vl_moe", the Qwen3-Omni-MoE thinker's
and talker's "qwen3_omni_moe_thinker", "qwen3_omni_moe_talker", GLM-4.5V's "glm4v_moe",
GLM-5.3-Flash's "glm5_next", DeepSeek-OCR-2's "deepseek_ocr2", Kimi-K2.5's "kimi_k25" (a
DeepSeek-V3 text config), Step-3.7's "step3p7", MiniMax-M3's "minimax_m3_vl", Aria's "aria",
dots3's "dots3_note", Mistral Large 4's "mistral_large4", Qwen4-Exp's "qwen4_exp",
Unlimited-OCR's "unlimited_ocr" (DeepSeek-OCR-2's block; its released config.json's
language_config read as the text config), DiffusionGemma's "diffusion_gemma" (Gemma 4's MoE part
in every decoder layer), NemotronH-Omni's "nemotron_h_omni" (its released config.json's
llm_config read as the text config) and NeMo SpeechLM's "nemo_speechlm" (Nemotron 3.5
Transcribe; its released checkpoint's names, llm.model.layers.* and experts.gate_and_up_projs,
are not read: a loaded model's state_dict() is)): every function takes either, and
`block_state_dict` finds a layer under the text model's keys or the multimodal model's
(DiffusionGemma's: its diffusion decoder's, or its encoder's, which ties the same weights). A
whole Qwen3-Omni-MoE config ("qwen3_omni_moe") holds two MoE language models, the thinker's and the
talker's: pass the one meant (config["thinker_config"]["text_config"], say).

The block state dicts are transformers' in-memory ones (fused experts, `experts.gate_up_proj`).
`block_state_dict` also reads a whole Hub checkpoint's tensors (what `save_pretrained` writes:
Mixtral's `block_sparse_moe.experts.0.w1.weight`, Qwen's `mlp.experts.0.gate_proj.weight`, ...)
and converts them to those as transformers does when it loads one, so a checkpoint's safetensors
load without torch; quantized checkpoints are dequantized by loading the model with transformers,
then taking its `state_dict()`. Nothing here imports torch; arrays are NumPy.

How the tensors map (HF applies a Linear as x W^T; the layer computes x @ w):

  router        gate.weight / router.weight (E, d) (nn.Linear) -> router (d, E) = W^T.
                DBRX: router.layer.weight; Hunyuan: gate.wg.weight; AFMoE: router.gate.weight;
                Gemma 4, DiffusionGemma: router.proj.weight, with router.scale (d,) ->
                router_scale and router.per_expert_scale (E,) -> expert_scale as they are.
  experts       experts.gate_up_proj (E, 2n, d), gate rows first ("concat") -> w1 (E, d, 2n) =
                transpose(0, 2, 1), gate columns then up columns; experts.down_proj (E, d, n) ->
                w2 (E, n, d) = transpose(0, 2, 1). (Mixtral, MiniMax, Qwen2/3-MoE, Qwen3-Next,
                Qwen3.5-MoE, Qwen3-VL-MoE, Qwen3-Omni-MoE, Qwen4-Exp, Lara Mini, Mellum, Flint,
                Laguna, OLMoE, FlexOlmo, Jamba, DeepSeek-V2/V3/V3.2, GLM-4.5, GLM-4.7-Flash,
                GLM-5, GLM-5.3-Flash, GLM-4.5V, Kimi-Linear, Kimi-K2.5, EXAONE-MoE, Sarvam,
                AFMoE, MiMo-V2-Flash, Beam, Kolibri-1, Step-3.7, Bailing-Hybrid, Solar Open,
                Mistral 4, Mistral Large 4, A.X-K2, dots.llm1, dots3, DeepSeek-OCR-2,
                Unlimited-OCR, MiniMax-M2, MiniMax-M3, ERNIE 4.5, LFM2-MoE, Hunyuan, Hy3, Granite
                (and Granite-SWA, GraniteMoeHybrid), Gemma 4, DiffusionGemma, DeepSeek-V4.)
                NemotronH: experts without a gate, experts.up_proj (E, n, d) -> w1 (E, d, n) and
                down_proj (E, d, n) -> w2 (E, n, d), each transpose(0, 2, 1), no gate/up columns
                (any gate_up_layout is the same layer).
                Llama 4, Aria: experts.gate_up_proj is already (E, d, 2n) (x @ W, gate first)
                and down_proj (E, n, d): taken as they are.
                gpt-oss: experts.gate_up_proj (E, d, 2n) with gate and up columns *interleaved*
                (gate = [..., 0::2], up = [..., 1::2]) and its bias gate_up_proj_bias (E, 2n) the
                same way -> w1, b1 as they are, gate_up_layout "interleaved"; down_proj (E, n, d)
                and down_proj_bias (E, d) -> w2, b2; the router's Linear bias router.bias (E,) ->
                router_bias (trained, added to the logits). The OpenAI privacy filter stores
                gpt-oss's experts with concat gate/up.
                DBRX: separate experts.mlp.w1 (gate) and experts.mlp.v1 (up), each (E * n, d),
                -> w1 = [w1_e^T | v1_e^T]; experts.mlp.w2 (E * n, d) is x-side already ->
                w2 = reshape (E, n, d).
  gate/up       w1's (and b1's and shared_in's) columns are put in the layer's gate_up_layout
                ("concat" by default, gpt-oss "interleaved"; `convert_gate_up_layout` order):
                pass gate_up_layout="interleaved" to convert a concat family for the faster
                mosaic_gpu up-projection, the same value to every function here.
  shared        shared_expert(s).{gate,up,down}_proj.weight ((s, d), (s, d), (d, s); Qwen2-MoE,
                Qwen3-Next, Qwen3.5-MoE, the Qwen3-Omni talker, Qwen4-Exp, Lara Mini, Flint,
                Laguna, DeepSeek-V2/V3/V3.2/V4, GLM-4.5, GLM-4.7-Flash, GLM-5, GLM-5.3-Flash,
                GLM-4.5V, Kimi-Linear, Kimi-K2.5, EXAONE-MoE, Sarvam, AFMoE, Kolibri-1, Step-3.7,
                Bailing-Hybrid, Solar Open, Mistral 4, Mistral Large 4, A.X-K2, dots.llm1, dots3,
                DeepSeek-OCR-2, Unlimited-OCR, ERNIE 4.5, Llama 4, Aria, Hy3; Hunyuan's
                shared_mlp) -> shared_in (d, 2s) = [gate^T | up^T], shared_out (s, d) = down^T.
                NemotronH: shared_experts.up_proj.weight (s, d) -> shared_in (d, s) = W^T,
                down_proj.weight (d, s) -> shared_out (s, d) = W^T (no gate).
                Granite (granitemoeshared, Granite-SWA, GraniteMoeHybrid): the decoder layer's
                shared_mlp.input_linear.weight (2s, d), gate rows first, -> shared_in = W^T;
                output_linear.weight (d, s) -> shared_out = W^T. Its state dict is the decoder
                layer's MoE part: "block_sparse_moe.*" and "shared_mlp.*".
  shared gate   Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE / Qwen3-Omni talker / Qwen4-Exp
                shared_expert_gate.weight (1, d) -> shared_gate (d, 1): the shared output times
                sigmoid(x @ shared_gate).
  selection     gate.e_score_correction_bias (E,) of DeepSeek-V3's router (DeepSeek-V3.2, GLM-4.5,
  bias          GLM-4.7-Flash, GLM-5, GLM-5.3-Flash, GLM-4.5V, Kimi-Linear, Kimi-K2.5,
                EXAONE-MoE, Sarvam, MiMo-V2-Flash, Beam, NemotronH, Kolibri-1, Bailing-Hybrid,
                Solar Open, dots.llm1, dots3, A.X-K2, Step-3.7, MiniMax-M3, Laguna; DeepSeek-V4's
                top-K layers), MiniMax-M2 and Hy3
                e_score_correction_bias (E,), LFM2-MoE and AFMoE expert_bias (E,), ERNIE 4.5
                gate.moe_statics.e_score_correction_bias (1, E) -> selection_bias (E,) (a
                `SelectionBias`, float32, no gradient; layer_kwargs sets bias_update_rate).

The routers (`layer_kwargs`' routing, a `Router`):

  Mixtral, MiniMax, Hunyuan, Granite (-SWA, MoeHybrid), ERNIE 4.5, Qwen3.5-MoE, Qwen3-VL-MoE, Aria
      Router("softmax"):
      softmax over E, top-K, renormalised (Granite's softmax over the K selected logits is the
      same; ERNIE selects on the probabilities plus its bias). Qwen2-MoE, Qwen3-MoE, Qwen3-Next,
      Qwen3-Omni-MoE (thinker and talker), Qwen4-Exp, Lara Mini, Mellum, OLMoE, FlexOlmo:
      renormalised as norm_topk_prob says; Jamba never. Qwen4-Exp's block is Qwen3-Next's (its
      decoder layer's hyper-connections, which mix its residual streams into the block's input
      and add the output back to each, are outside it); Mellum's is Qwen3-MoE's; Lara Mini adds
      one shared expert (no shared_expert_gate) of shared_expert_intermediate_size.
  DeepSeek-V2, DeepSeek-OCR-2, Unlimited-OCR   Router("softmax", renormalize=norm_topk_prob,
      routed_scaling_factor); topk_method "group_limited_greedy": n_group, topk_group,
      group_score="max".
  Mistral 4      Router("softmax", renormalize=norm_topk_prob, renorm_epsilon=1e-20, n_group,
      topk_group, group_score="top2_sum", routed_scaling_factor): DeepSeek-V3's group rule on the
      softmax probabilities, no selection bias; n_shared_experts shared experts. Mistral Large 4:
      the same, always renormalised (its config has no norm_topk_prob).
  DeepSeek-V3, DeepSeek-V3.2, GLM-4.5, GLM-4.7-Flash, GLM-5, GLM-4.5V, Kimi-Linear, Kimi-K2.5,
  EXAONE-MoE, Sarvam, MiMo-V2-Flash and Beam (no shared expert), Bailing-Hybrid, Solar Open,
  dots.llm1, dots3, NemotronH, A.X-K2 (n_group None: no groups)
      Router("sigmoid", renormalize=norm_topk_prob, renorm_epsilon=1e-20, n_group, topk_group,
      group_score="top2_sum", routed_scaling_factor) with the selection bias (Kimi-Linear's and
      Bailing-Hybrid's fields: moe_renormalize, num_expert_group, num_shared_experts,
      num_experts_per_token; EXAONE-MoE's and Sarvam's checkpoints: num_shared_experts; Beam
      multiplies the summed routed output by the factor, which is the same). AFMoE: the same with
      one group, always renormalised, route_scale as the factor; Hy3 the same with
      router_scaling_factor, num_shared_experts shared experts (one of intermediate_size where it
      is 0, as transformers builds it). NemotronH: experts and one shared expert of
      moe_shared_expert_intermediate_size without a gate, activation mlp_hidden_act ("relu2":
      "relu_sq"); its decoder layers whose layers_block_type (a checkpoint's
      hybrid_override_pattern) is not "moe" have no block; moe_latent_size (experts between two
      latent projections) is refused. Kolibri-1: Router("sigmoid", renormalize=norm_topk_prob,
      selection_bias_on="logits"): top-K of the logits plus the selection bias, weights the
      sigmoids of the selected logits; one shared expert of shared_expert_intermediate_size.
      MiniMax-M2:
      Router("sigmoid") with its bias. LFM2-MoE: Router("sigmoid", renormalize=norm_topk_prob,
      renorm_epsilon=1e-6, routed_scaling_factor), the bias where use_expert_bias.
  Flint          Router("sigmoid", renormalize=norm_topk_prob): sigmoid scores, top-K,
      renormalised without an epsilon, no selection bias; one shared expert (no
      shared_expert_gate) of shared_expert_intermediate_size. Its first layers are dense
      (mlp_only_layers [0, 1]).
  Laguna         Router("sigmoid", routed_scaling_factor=moe_routed_scaling_factor) with
      gate.e_score_correction_bias: always renormalised, no epsilon; one shared expert (no
      shared_expert_gate) of shared_expert_intermediate_size. moe_router_logit_softcapping
      (logits -> c tanh(logit / c)) is refused where it is positive (transformers ignores a cap
      <= 0).
  GLM-5.3-Flash  DeepSeek-V3's router; the experts and the shared expert compute
      clamped_swiglu(alpha=1, limit=swiglu_limit, up_offset=0) (DeepSeek-V4's activation).
  Kimi-K2.5      its text_config is DeepSeek-V3's (model_type "deepseek_v3", or "kimi_k2" as its
      config.json says: the same family).
  DeepSeek-OCR-2 DeepSeek-V2's router, never renormalised (whatever norm_topk_prob says).
      Unlimited-OCR's text model: DeepSeek-OCR-2's block (its config's defaults: one group).
  Step-3.7 (its text config, model_type "step3p5")   Router("sigmoid", routed_scaling_factor=
      moe_router_scaling_factor) with gate.e_score_correction_bias: renormalised without an
      epsilon, the routed output times the factor; one shared expert of share_expert_dim; SiLU
      experts whatever hidden_act says. Layers that swiglu_limits or swiglu_limits_shared clamp
      compute min(silu(gate), limit) * clip(up, -limit, limit), the clamp after the SiLU, which no
      layer activation does: refused (pass layer= for the others where a config has such layers).
  MiniMax-M3     Router("sigmoid", routed_scaling_factor) with its gate.e_score_correction_bias;
      activation clamped_swiglu(swiglu_alpha, swiglu_limit) on concat gate/up, in the experts and
      in its one shared MLP (shared_intermediate_size), whose shared_experts.gate_up_proj.weight
      (2s, d), gate rows first, and down_proj.weight (d, s) map as Granite's shared_mlp.
      Aria: Router("softmax") (softmax over the K best logits); experts stored x-side as Llama 4's
      (experts.gate_up_proj (E, d, 2n), down_proj (E, n, d)), always SiLU; moe_num_shared_experts
      shared experts of intermediate_size (hidden_act must be SiLU too). dots3 (Dots3Note):
      DeepSeek-V3's router, n_shared_experts shared experts of shared_experts_intermediate_size.
      Granite-SWA and GraniteMoeHybrid: Granite's (with the shared MLP) on the decoder layer's
      keys. OpenAI privacy filter: gpt-oss's block with concat gate/up (its router's 1/K and the
      block's factor K cancel).
  gpt-oss        Router("softmax") on logits + router_bias (top-K of them, softmax over the K),
      activation clamped_swiglu(swiglu_alpha, swiglu_limit), interleaved gate/up, expert biases.
  Llama 4        Router("sigmoid", renormalize=False, scale_input=True): top-1 by logit, the
      expert sees sigmoid(logit) * x.
  DBRX           Router("softmax", renorm_p=moe_normalize_expert_weights) (None: not
      renormalised); the activation from ffn_config's ffn_act_fn.
  DeepSeek-V4    Router("sqrt_softplus", renorm_epsilon=1e-20, routed_scaling_factor): scores
      sqrt(softplus(logit)), selected on the scores plus gate.e_score_correction_bias, always
      renormalised; activation clamped_swiglu(alpha=1, limit=swiglu_limit, up_offset=0) (SiLU
      of the clamped gate times the clamped up half), one shared expert of the experts' width.
      Its first layers (mlp_layer_types "hash_moe") select by a frozen table of each token id's
      experts, gate.tid2eid (vocab, K): no selection bias there, fixed_selection=True, and the
      caller passes layer(x, expert_ids=tid2eid[input_ids]); every function here that takes a
      config takes layer= (hf_state_from_layer writes no tid2eid: the table is the caller's, not
      a parameter).
  Gemma 4        Router("softmax") (softmax over E, top-K, renormalised) on the router's own
      input, RMS-normalised (router_norm_eps = rms_norm_eps) times router.scale (d,) and d^-1/2,
      each weight times router.per_expert_scale (E,) of its expert (use_expert_scale=True);
      GELU-tanh GLU experts. The router sees the decoder layer's residual stream h and the experts
      pre_feedforward_layernorm_2(h): call the layer as layer(that, router_input=h).
      DiffusionGemma: the same in every decoder layer (no enable_moe_block).

Semantics that differ from transformers only where no real input reaches: group-limited selection
never picks an expert of a dropped group (DeepSeek-V2's, Mistral 4's and Mistral Large 4's
transformers code masks its probabilities to 0, which only matters if fewer than K kept experts
had a positive probability); ERNIE clamps the renormalising sum at moe_norm_min (1e-12), the
layer divides by the sum (at least K / E). One difference a real input can reach: A.X-K2's
transformers router masks a dropped group's sigmoid + selection bias to 0, not -inf, so where
fewer than K experts of the kept groups have sigmoid + bias > 0 (a selection bias below minus
their sigmoids) it picks experts of dropped groups, which the layer never does.
Training-only noise (Mixtral's router_jitter_noise, DBRX's moe_jitter_eps) is not modelled.
transformers' DeepSeek-V2 router ignores norm_topk_prob (False in the released checkpoints); the
layer follows it, as DeepSeek's own code does. Several transformers routers compute the logits
in float32 even for float64 weights, so a float64 comparison agrees to about 1e-7.

Not in scope (use `sonic_jax.routed_experts`, the experts on a routing you compute, with the
family's own router): PhiMoE (the sparsemixer sampling router), LongCat-Flash (zero-compute
experts), Switch (top-1) / NLLB-MoE (top-2), capacity-dropping with their own layouts,
Cohere2-MoE's "average" shared-expert combination, Inkling 2 and Inkling 2 Loop (softcapped SwiGLU
experts), Inkling (its router also scores the shared experts: the sigmoids of the K selected and of
the shared ones normalised together, the shared outputs weighted by theirs, all times route_scale
and a trained scalar), ZAYA (an MLP router on the block input plus the previous layer's router
state, over E + 1 classes, one a skip expert without compute), JetMoE (a (d,) bias added to the
block's output, which no layer parameter holds), HY-V4 and HY-V4-VL (their routed experts' SwiGLU
is clamped at swiglu_limit, their shared expert's is not: the layer gives both one activation),
A.X-K1 (DeepSeek-V3's block with a trained RMSNorm, post_mlp_layernorm, on its output), Muse Spark
(experts at moe_hidden_size between trained projections from and back to d, with an RMSNorm of
their input and of each expert's output), Doge's CDMoE (product keys over sqrt(E) x sqrt(E) rank-1
experts, its router reading the (T, 2 sqrt(E)) logits as (2, T, sqrt(E)): a token's scores are
other tokens'), ViTPose++'s backbone MoE MLP (experts chosen by a dataset index, their output
concatenated to a shared part), ERNIE-4.5-VL-MoE (each token routed within its modality's own
expert set), Step-3.7's layers that clamp after the SiLU (refused: see above), dots3's vision-tower
MoE (not mapped), Laguna configs whose moe_router_logit_softcapping softcaps the router logits
(refused: see above).
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
import types
from typing import Any, Callable, Mapping

import jax
import numpy as np

from sonic_jax import activations as acts
from sonic_jax.routing import Router

Array = np.ndarray

__all__ = ["FAMILIES", "Family", "GLU_OF_HIDDEN_ACT", "LayerParams", "PARAM_NAMES",
           "PerLayerFieldError", "WRAPPERS", "block_state_dict", "family", "hf_keys",
           "hf_state_from_layer", "layer_kwargs", "layer_params", "layer_params_from_hf",
           "load_into_layer", "moe_layer"]

# The layer's parameter names (attributes of `sonic_jax.layers.MoE`).

PARAM_NAMES = ("router", "w1", "w2", "b1", "b2", "router_bias", "selection_bias", "shared_in",
               "shared_out", "shared_gate", "router_scale", "expert_scale")

# Parameters that map as they are, each under its key in `Family` (a field of the same name).
_AS_THEY_ARE = ("router_bias", "router_scale", "expert_scale")

# transformers' hidden_act -> the layer's GLU activation (the experts compute act(gate) * up).
# The registries are read-only, as routing's and activations' are: a conversion must not change
# with a process-wide assignment.
GLU_OF_HIDDEN_ACT = types.MappingProxyType({
    "silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh",
    "gelu_new": "geglu_tanh", "relu": "reglu"})

# transformers' hidden_act -> the layer's activation for experts without a gate (A = act(H)).
_ACT_OF_HIDDEN_ACT = types.MappingProxyType({
    "relu2": "relu_sq", "relu": "relu", "silu": "silu", "swish": "silu", "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"})

_MISSING = object()


class PerLayerFieldError(ValueError):
  """What the config gives per decoder layer (a size, a routing, a clamp), asked for without a
  layer."""


def _get(config: Mapping[str, Any], *names: str, default: Any = _MISSING, layer: int | None = None):
  """The first of `names` that the config has (not None); per-layer lists need `layer`."""
  for name in names:
    value = config.get(name)
    if value is None:
      continue
    if isinstance(value, (list, tuple)):
      if layer is None:
        raise PerLayerFieldError(f"config[{name!r}] is a per-layer list {value}: pass layer=")
      _check_layer_type(layer)
      if not 0 <= layer < len(value):
        raise ValueError(f"layer must be a decoder layer's index in [0, {len(value)}) "
                         f"(config[{name!r}] has {len(value)} entries), got {layer!r}")
      value = value[layer]
    return value
  if default is _MISSING:
    raise ValueError(f"the {config.get('model_type')!r} config has none of the fields {names}")
  return default


def _number(config: Mapping[str, Any], name: str, default: float) -> float:
  """config[name] as a float (`default` where absent); anything but a real number is refused."""
  value = config.get(name, default)
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"config[{name!r}] must be a number, got {value!r}")
  return float(value)


def _glu(config: Mapping[str, Any], name: str = "hidden_act") -> str:
  act = config.get(name, "silu")
  if act not in GLU_OF_HIDDEN_ACT:
    raise ValueError(f"{name}={act!r} has no sonic_jax GLU activation (known: "
                     f"{sorted(GLU_OF_HIDDEN_ACT)})")
  return GLU_OF_HIDDEN_ACT[act]


def _act(config: Mapping[str, Any], name: str) -> str:
  """The activation of experts without a gate, from config[name] (transformers' hidden_act)."""
  act = config.get(name)
  if act not in _ACT_OF_HIDDEN_ACT:
    raise ValueError(f"{name}={act!r} has no sonic_jax activation (known: "
                     f"{sorted(_ACT_OF_HIDDEN_ACT)})")
  return _ACT_OF_HIDDEN_ACT[act]


def _shared(num: int, dim: int, gate: bool = False) -> dict:
  if not num or not dim:
    return dict(num_shared_experts=0, shared_expert_dim=None, shared_expert_gate=False)
  return dict(num_shared_experts=int(num), shared_expert_dim=int(dim), shared_expert_gate=gate)


def _size(name: str, value: Any) -> int:
  """A size field as an int: refused, naming it, where the config holds anything but a whole
  number (a float such as 32.7 or a string would otherwise be truncated or parsed)."""
  if isinstance(value, bool) or not (isinstance(value, numbers.Integral) or (
      isinstance(value, float) and value.is_integer())):
    raise ValueError(f"the config's {name} must be a whole number, got {value!r}")
  return int(value)


def _base(d, e, n, k, routing, activation="swiglu", **extra) -> dict:
  kw = dict(d_model=_size("hidden size", d), num_experts=_size("expert count", e),
            expert_dim=_size("expert width", n), top_k=_size("experts per token", k),
            activation=activation, routing=routing, gate_up_layout="concat", use_bias=False,
            use_router_bias=False, **_shared(0, 0))
  kw.update(extra)
  return kw


_E = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_K = ("num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k")


def _softmax_family(n_field: str, renorm: str | bool, shared: str | None = None,
                    shared_gate: bool = False):
  """Softmax over E, top-K, renormalised (renorm: True, False, or the config field saying so)."""

  def kwargs(c, layer):
    renormalize = renorm if isinstance(renorm, bool) else bool(c.get(renorm) or False)
    s = _get(c, shared) if shared else 0  # the block always has one: its width is required
    return _base(_get(c, "hidden_size"), _get(c, *_E, layer=layer), _get(c, n_field),
                 _get(c, *_K, layer=layer), Router("softmax", renormalize=renormalize),
                 _glu(c), **_shared(1, s, shared_gate))

  return kwargs


def _deepseek_v2(c, layer):
  method = c.get("topk_method") or "greedy"
  if method not in ("greedy", "group_limited_greedy"):
    raise ValueError(f"DeepSeek-V2 topk_method={method!r}: only 'greedy' and "
                     f"'group_limited_greedy' (transformers' DeepseekV2TopkRouter)")
  if c.get("mlp_bias"):
    raise ValueError("DeepSeek-V2 mlp_bias=True: the layer's shared experts have no biases")
  groups = method == "group_limited_greedy"
  router = Router("softmax", renormalize=bool(c.get("norm_topk_prob") or False),
                  n_group=int(_get(c, "n_group")) if groups else 1,
                  topk_group=int(_get(c, "topk_group")) if groups else 1, group_score="max",
                  routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0))
  n = _get(c, "moe_intermediate_size")
  return _base(_get(c, "hidden_size"), _get(c, *_E), n, _get(c, *_K), router, _glu(c),
               **_shared(c.get("n_shared_experts") or 0, n))


def _v3_router(c, scoring: str = "sigmoid") -> Router:
  """DeepSeek-V3's router (Mistral 4's on softmax scores): without a field, one group, not
  renormalised, factor 1."""
  n_group = int(c.get("n_group") or 1)
  return Router(scoring, renormalize=bool(c.get("norm_topk_prob") or False),
                renorm_epsilon=1e-20, n_group=n_group,
                topk_group=int(c.get("topk_group") or 1) if n_group > 1 else 1,
                group_score="top2_sum",
                routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0))


def _deepseek_ocr2(c, layer):
  """DeepSeek-V2's router that never renormalises (DeepSeek-OCR-2's and Unlimited-OCR's
  transformers routers, whatever a config's norm_topk_prob says)."""
  return _deepseek_v2({**c, "norm_topk_prob": False}, layer)


def _deepseek_v3(c, layer):
  """DeepSeek-V3's router (V3.2, GLM-4.5, GLM-4.7-Flash, dots.llm1, Kimi-K2, Sarvam share it).
  Without a field: one group, not renormalised, factor 1, no shared expert (dots.llm1's defaults;
  the other families' differ: `_families` passes them)."""
  n = _get(c, "moe_intermediate_size")
  return _base(_get(c, "hidden_size"), _get(c, *_E), n, _get(c, *_K), _v3_router(c), _glu(c),
               selection_bias=True, **_shared(c.get("n_shared_experts") or 0, n))


def _nemotron_h(c, layer):
  """NemotronH: DeepSeek-V3's router; experts and one shared expert of
  moe_shared_expert_intermediate_size (intermediate_size where it is 0, as transformers builds
  it) without a gate, down(act(up(x))), act mlp_hidden_act (ReLU squared)."""
  if c.get("moe_latent_size") is not None:
    raise ValueError("NemotronH moe_latent_size: its experts run between two latent projections "
                     "(fc1_latent_proj, fc2_latent_proj) that the layer does not have")
  if c.get("mlp_bias"):
    raise ValueError("NemotronH mlp_bias=True: the layer's shared expert has no biases")
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "moe_intermediate_size"),
               _get(c, *_K), _v3_router(c), _act(c, "mlp_hidden_act"), selection_bias=True,
               **_shared(1, _get(c, "moe_shared_expert_intermediate_size")
                         or _get(c, "intermediate_size")))


def _kolibri1(c, layer):
  """Kolibri-1: top-K of the logits plus the selection bias, each weight the sigmoid of its
  logit, renormalised (no epsilon) as norm_topk_prob says; one shared expert of
  shared_expert_intermediate_size."""
  router = Router("sigmoid", renormalize=bool(c.get("norm_topk_prob") or False),
                  selection_bias_on="logits")
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "moe_intermediate_size"),
               _get(c, *_K), router, _glu(c), selection_bias=True,
               **_shared(1, _get(c, "shared_expert_intermediate_size")))


def _mistral4(c, layer):
  """Mistral 4: softmax over E, selected within the topk_group best of n_group groups (a group's
  score the sum of its two best probabilities), renormalised (+1e-20) as norm_topk_prob says,
  times routed_scaling_factor; n_shared_experts shared experts of the experts' width. Without a
  field: one group, not renormalised, factor 1, no shared expert (`_families` passes the config
  class's defaults)."""
  n = _get(c, "moe_intermediate_size")
  return _base(_get(c, "hidden_size"), _get(c, *_E), n, _get(c, *_K), _v3_router(c, "softmax"),
               _glu(c), **_shared(c.get("n_shared_experts") or 0, n))


def _mistral_large4(c, layer):
  """Mistral 4's block, always renormalised (+1e-20)."""
  return _mistral4({**c, "norm_topk_prob": True}, layer)


def _glm5_next(c, layer):
  """GLM-5.3-Flash: DeepSeek-V3's router and shared experts; the experts' and the shared expert's
  SwiGLU takes min(gate, swiglu_limit) and up clipped to +-swiglu_limit."""
  if _glu(c) != "swiglu":  # the routed experts apply SiLU whatever hidden_act says
    raise ValueError(f"GLM-5.3-Flash hidden_act={c.get('hidden_act')!r}: only SiLU")
  kw = _deepseek_v3(c, layer)
  limit = c.get("swiglu_limit")
  if limit:
    kw["activation"] = acts.clamped_swiglu(alpha=1.0, limit=float(limit), up_offset=0.0)
  return kw


def _renamed(kwargs, **names: str):
  """`kwargs` for a config that calls some of its fields otherwise (field=its name there)."""

  def renamed(c, layer):
    return kwargs({**c, **{field: c[own] for field, own in names.items()
                           if c.get(own) is not None}}, layer)

  return renamed


def _defaults(kwargs, **values):
  """`kwargs` for a config whose absent fields take `values`: its transformers config class's
  defaults (transformers 5.24), where they differ from what `kwargs` falls back to."""

  def with_defaults(c, layer):
    return kwargs({**values, **c}, layer)

  return with_defaults


def _afmoe(c, layer):
  """Sigmoid scores, selection on scores + expert_bias, always renormalised, times route_scale."""
  router = Router("sigmoid", renorm_epsilon=1e-20,
                  routed_scaling_factor=float(c.get("route_scale") or 1.0))
  n = _get(c, "moe_intermediate_size")
  return _base(_get(c, "hidden_size"), _get(c, *_E), n, _get(c, *_K), router, _glu(c),
               selection_bias=True, **_shared(c.get("num_shared_experts") or 0, n))


def _hy_v3(c, layer):
  """Hy3: AFMoE's router, router_scaling_factor as route_scale, with the block's
  e_score_correction_bias; num_shared_experts shared experts of the experts' width in one MLP,
  of intermediate_size where num_shared_experts is 0 (transformers' HYV3MLP then falls back to
  it)."""
  if c.get("mlp_bias"):
    raise ValueError("Hy3 mlp_bias=True: the layer's shared experts have no biases")
  kw = _afmoe({**c, "route_scale": c.get("router_scaling_factor")}, layer)
  if not c.get("num_shared_experts"):
    kw.update(_shared(1, _get(c, "intermediate_size")))
  return kw


def _mimo_v2_flash(c, layer):
  """DeepSeek-V3's router and experts; the block has no shared experts, whatever the config
  (MiMo-V2-Flash; Beam, whose factor multiplies the summed routed output: the same)."""
  return _deepseek_v3({**c, "n_shared_experts": 0}, layer)


def _step3p5(c, layer):
  """Step-3.7's text model: sigmoid scores, selected on scores + the bias, renormalised (no
  epsilon); the routed output times moe_router_scaling_factor; one shared expert of
  share_expert_dim. Its experts apply SiLU whatever hidden_act says ("swigluoai" on the Hub)."""
  if c.get("mlp_bias"):
    raise ValueError("Step-3.7 mlp_bias=True: the layer's shared expert has no biases")
  # Clamped layers compute min(silu(gate), limit) * clip(up): the clamp follows the SiLU, which
  # no layer activation does (clamped_swiglu clamps the gate before it).
  clamps = {name: c.get(name) or [] for name in ("swiglu_limits", "swiglu_limits_shared")}
  clamped = sorted({i for v in clamps.values() for i, x in enumerate(v) if x})
  if layer is None and clamped:
    raise PerLayerFieldError(f"Step-3.7 clamps the SwiGLU of layers {clamped} (swiglu_limits, "
                             f"swiglu_limits_shared): pass layer=")
  if layer is not None and layer in clamped:
    raise ValueError(f"Step-3.7 layer {layer} clamps its SwiGLU after the SiLU (swiglu_limits, "
                     f"swiglu_limits_shared): no sonic_jax activation computes that")
  router = Router("sigmoid",
                  routed_scaling_factor=float(c.get("moe_router_scaling_factor") or 1.0))
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "moe_intermediate_size"), _get(c, *_K),
               router, "swiglu", selection_bias=True, **_shared(1, _get(c, "share_expert_dim")))


def _flint(c, layer):
  """Flint: sigmoid scores, top-K, renormalised (no epsilon) as norm_topk_prob says, no selection
  bias; one shared expert (no shared_expert_gate) of shared_expert_intermediate_size."""
  router = Router("sigmoid", renormalize=bool(c.get("norm_topk_prob") or False))
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "moe_intermediate_size"),
               _get(c, *_K), router, _glu(c),
               **_shared(1, _get(c, "shared_expert_intermediate_size")))


def _laguna(c, layer):
  """Laguna: sigmoid scores, selected on scores + the bias, always renormalised (no epsilon), times
  moe_routed_scaling_factor; one shared expert (no shared_expert_gate) of
  shared_expert_intermediate_size."""
  cap = c.get("moe_router_logit_softcapping")
  if cap and cap > 0:  # logits -> cap * tanh(logits / cap), which no Router computes
    raise ValueError(f"Laguna moe_router_logit_softcapping={cap!r}: the layer's router does not "
                     f"softcap its logits (only a cap <= 0, which transformers ignores)")
  if c.get("moe_apply_router_weight_on_input"):  # transformers refuses it too
    raise ValueError("Laguna moe_apply_router_weight_on_input=True: transformers does not "
                     "implement it (only False)")
  router = Router("sigmoid",
                  routed_scaling_factor=float(c.get("moe_routed_scaling_factor") or 1.0))
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "moe_intermediate_size"),
               _get(c, *_K), router, _glu(c), selection_bias=True,
               **_shared(1, _get(c, "shared_expert_intermediate_size")))


_SCORINGS = {"sqrtsoftplus": "sqrt_softplus", "sigmoid": "sigmoid", "softmax": "softmax"}


def _deepseek_v4_hashed(c, layer) -> bool:
  """Whether DeepSeek-V4's decoder layer `layer` is hash-routed (mlp_layer_types, or a
  checkpoint's num_hash_layers: the first layers)."""
  kinds = c.get("mlp_layer_types")
  if kinds is None:  # transformers' defaults: 43 layers, the first 3 hash-routed
    n, n_hash = int(c.get("num_hidden_layers", 43)), int(c.get("num_hash_layers", 3))
    kinds = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
  if layer is None:
    if len(set(kinds)) > 1:
      raise PerLayerFieldError(f"DeepSeek-V4's layers are routed two ways (mlp_layer_types "
                               f"{kinds}): pass layer=")
    layer = 0
  if not 0 <= layer < len(kinds):
    raise ValueError(f"layer={layer} is not a decoder layer of this DeepSeek-V4 config "
                     f"({len(kinds)} layers)")
  return kinds[layer] == "hash_moe"


def _deepseek_v4(c, layer):
  """DeepSeek-V4: sqrt(softplus) scores, selected on the scores plus the bias (top-K layers) or
  by a frozen table of each token id's experts (hash layers: the layer's expert_ids), always
  renormalised (+1e-20), times routed_scaling_factor; clamped SwiGLU experts and one shared
  expert of their width and activation."""
  scoring = _SCORINGS.get(c.get("scoring_func", "sqrtsoftplus"))
  if scoring is None:
    raise ValueError(f"DeepSeek-V4 scoring_func={c.get('scoring_func')!r}: only "
                     f"{sorted(_SCORINGS)}")
  if _glu(c) != "swiglu":
    raise ValueError(f"DeepSeek-V4 hidden_act={c.get('hidden_act')!r}: only SiLU")
  limit = c.get("swiglu_limit")
  act = acts.clamped_swiglu(alpha=1.0, limit=float(limit), up_offset=0.0) if limit else "swiglu"
  n = _get(c, "moe_intermediate_size", "intermediate_size")
  router = Router(scoring, renorm_epsilon=1e-20,
                  routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0))
  hashed = _deepseek_v4_hashed(c, layer)
  extra = dict(fixed_selection=True) if hashed else dict(selection_bias=True)
  return _base(_get(c, "hidden_size"), _get(c, *_E), n, _get(c, *_K), router, act, **extra,
               **_shared(1, n))


def _gemma4(c, layer):
  """Gemma 4: softmax over E of logits from the router's own normalisation of the block input,
  top-K, renormalised, times a trained per-expert scale; GELU-tanh GLU experts."""
  if not c.get("enable_moe_block"):
    raise ValueError("this Gemma 4 config has enable_moe_block=False: no MoE block")
  return _gemma4_moe(c, layer)


def _gemma4_moe(c, layer):
  """Gemma 4's MoE part, which DiffusionGemma's decoder layers all have."""
  return _base(_get(c, "hidden_size"), _get(c, "num_experts"), _get(c, "moe_intermediate_size"),
               _get(c, "top_k_experts"), Router("softmax"), _glu(c, "hidden_activation"),
               router_norm_eps=float(_get(c, "rms_norm_eps", default=1e-6)),
               use_expert_scale=True)


def _minimax_m2(c, layer):
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "intermediate_size"), _get(c, *_K),
               Router("sigmoid"), _glu(c), selection_bias=True)


def _minimax_m3(c, layer):
  """MiniMax-M2's router times routed_scaling_factor; gpt-oss's clamped SwiGLU (concat gate/up)
  in the experts and the shared MLP alike."""
  router = Router("sigmoid", routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0))
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "intermediate_size"), _get(c, *_K),
               router, _swiglu_oai(c), selection_bias=True,
               **_shared(1, c.get("shared_intermediate_size") or 0))


def _aria(c, layer):
  """Softmax over the K selected logits; SiLU experts, shared ones of hidden_act."""
  if c.get("mlp_bias"):
    raise ValueError("Aria mlp_bias=True: the layer's shared experts have no biases")
  if _glu(c) != "swiglu":  # the routed experts are SiLU whatever hidden_act says
    raise ValueError(f"Aria hidden_act={c.get('hidden_act')!r}: its shared experts would differ "
                     f"from its SiLU routed ones; the layer gives both one activation")
  n = _get(c, "intermediate_size")
  return _base(_get(c, "hidden_size"), _get(c, "moe_num_experts", *_E), n, _get(c, "moe_topk", *_K),
               Router("softmax"), "swiglu", **_shared(c.get("moe_num_shared_experts") or 0, n))


def _dots3(c, layer):
  """DeepSeek-V3's router; n_shared_experts shared experts of shared_experts_intermediate_size."""
  kw = _deepseek_v3(c, layer)
  kw.update(_shared(c.get("n_shared_experts") or 0, c.get("shared_experts_intermediate_size") or 0))
  return kw


def _granite_hybrid(c, layer):
  if _get(c, *_E, default=None) == 0:  # absent is not 0 (transformers: 8); _granite requires it
    raise ValueError("this GraniteMoeHybrid config has num_local_experts=0: no MoE block")
  return _granite(c, layer)


def _privacy_filter(c, layer):
  """gpt-oss's block with concat gate/up (its router's 1/K and the block's factor K cancel)."""
  return {**_gpt_oss(c, layer), "gate_up_layout": "concat"}


def _ernie(c, layer):
  if c.get("use_bias"):
    raise ValueError("ERNIE 4.5 use_bias=True: the layer's shared experts have no biases")
  n = _get(c, "moe_intermediate_size")
  return _base(_get(c, "hidden_size"), _get(c, "moe_num_experts", *_E), n,
               _get(c, "moe_k", *_K), Router("softmax"), _glu(c), selection_bias=True,
               **_shared(c.get("moe_num_shared_experts") or 0, n))


def _lfm2(c, layer):
  router = Router("sigmoid", renormalize=bool(c.get("norm_topk_prob")), renorm_epsilon=1e-6,
                  routed_scaling_factor=float(c.get("routed_scaling_factor") or 1.0))
  # LFM2-MoE's experts apply silu whatever hidden_act says
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "moe_intermediate_size"), _get(c, *_K),
               router, "swiglu", selection_bias=bool(c.get("use_expert_bias")))


def _hunyuan(c, layer):
  n = _get(c, "intermediate_size")
  return _base(_get(c, "hidden_size"), _get(c, "num_experts", *_E, layer=layer), n,
               _get(c, "moe_topk", *_K, layer=layer), Router("softmax"), _glu(c),
               **_shared(1, n))


def _swiglu_oai(c):
  """gpt-oss's clamped SwiGLU from swiglu_alpha and swiglu_limit (by name at its defaults)."""
  act = acts.clamped_swiglu(alpha=_number(c, "swiglu_alpha", 1.702),
                            limit=_number(c, "swiglu_limit", 7.0))
  return "clamped_swiglu" if act == acts.ACTIVATIONS["clamped_swiglu"] else act


def _gpt_oss(c, layer):
  """Top-K of (logits + router bias), softmax over the K: the softmax over E renormalised."""
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "intermediate_size"), _get(c, *_K),
               Router("softmax"), _swiglu_oai(c), gate_up_layout="interleaved", use_bias=True,
               use_router_bias=True)


def _llama4(c, layer):
  n = _get(c, "intermediate_size")
  return _base(_get(c, "hidden_size"), _get(c, *_E), n, _get(c, *_K),
               Router("sigmoid", renormalize=False, scale_input=True), _glu(c), **_shared(1, n))


def _granite(c, layer):
  s = c.get("shared_intermediate_size") or 0
  return _base(_get(c, "hidden_size"), _get(c, *_E), _get(c, "intermediate_size"), _get(c, *_K),
               Router("softmax"), _glu(c), **_shared(1, s))


def _dbrx(c, layer):
  ffn = c.get("ffn_config") or {}
  p = ffn.get("moe_normalize_expert_weights", 1.0)
  router = (Router("softmax", renormalize=False) if p is None
            else Router("softmax", renorm_p=float(p)))
  act = (ffn.get("ffn_act_fn") or {"name": "silu"}).get("name", "silu")
  return _base(_get(c, "d_model", "hidden_size"), ffn.get("moe_num_experts", 4),
               ffn.get("ffn_hidden_size", 3584), ffn.get("moe_top_k", 1), router,
               _glu({"act": act}, "act"))


@dataclasses.dataclass(frozen=True)
class Family:
  """How one transformers MoE block maps to the layer.

  model_type: the config's model_type (a multimodal model's: its text config's). block: the
  transformers class of the block. prefix: where the block's keys sit in the whole model's state
  dict ("{layer}": the decoder layer's index), the model that transformers' AutoModelForCausalLM
  builds (for the families with a multimodal model, its text model; Qwen3-VL-MoE's and
  Qwen3-Omni-MoE's multimodal model, the only one they have). multimodal_prefix: the same keys in
  the multimodal model where a family has both (its released checkpoints), which
  `block_state_dict` tries too (DiffusionGemma: its encoder's, tied to the decoder's).
  router: key of the router weight (E, d). experts: the experts' storage, "fused" ((E, 2n, d)
  gate_up_proj and (E, d, n) down_proj), "fused_xw" (Llama 4: (E, d, 2n) and (E, n, d)),
  "gpt_oss" (fused_xw with biases, gate/up as natural_layout says: gpt-oss interleaved), "dbrx"
  (separate w1, v1, w2) or "up" (NemotronH's experts without a gate: (E, n, d) up_proj and
  (E, d, n) down_proj).
  experts_prefix: the experts' key prefix. router_bias, selection_bias: keys (or None);
  selection_bias_shape: its shape in the state dict ((E,) or (1, E)). shared: the shared MLP's key
  prefix (or None), shared_kind "split" (gate_proj / up_proj / down_proj), "fused" (Granite's
  input_linear / output_linear), "gate_up" (MiniMax-M3's gate_up_proj / down_proj: the same
  (2s, d) and (d, s) Linears) or "up" (NemotronH's up_proj (s, d) / down_proj (d, s), no gate);
  shared_gate: key of the (1, d) shared-expert gate.
  natural_layout: the order of a "gpt_oss" storage's gate/up columns, the layer's default layout.
  router_scale, expert_scale: keys of Gemma 4's (d,) router input scale and (E,) per-expert scale.
  lookup: key of a table the caller reads, not a parameter (DeepSeek-V4's hash layers'
  gate.tid2eid: expert_ids = tid2eid[input_ids]); the converters pass over it.
  kwargs: config dict, layer index -> the layer's keyword arguments.
  dense_layers: the config class's defaults of the fields that make decoder layers dense
  (`_dense_layer`), where they do (DeepSeek-V3's first_k_dense_replace = 3): a config saved by
  transformers leaves out the fields equal to its class's defaults.
  """

  model_type: str
  block: str
  prefix: str
  kwargs: Callable[[Mapping[str, Any], int | None], dict]
  router: str = "gate.weight"
  experts: str = "fused"
  experts_prefix: str = "experts."
  router_bias: str | None = None
  selection_bias: str | None = None
  selection_bias_shape: str = "(E,)"
  shared: str | None = None
  shared_kind: str = "split"
  shared_gate: str | None = None
  natural_layout: str = "concat"
  router_scale: str | None = None
  expert_scale: str | None = None
  lookup: str | None = None
  multimodal_prefix: str | None = None
  dense_layers: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _leading_dense(count: int):
  """mlp_layer_types as a config class derives it without one: `count` dense layers, then MoE
  (a config without num_hidden_layers: as many as any index)."""
  def kinds(c):
    total = c.get("num_hidden_layers") or count + 1024
    return ["dense"] * min(count, total) + ["sparse"] * max(0, total - count)
  return kinds


# NemotronH's legacy hybrid_override_pattern: a letter per decoder layer's mixer.
_NEMOTRON_H_MIXERS = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}


def _nemotron_h_layers(c):
  """NemotronH's layers_block_type as its config class derives it without one: from a
  checkpoint's hybrid_override_pattern, else the class's four layers."""
  pattern = c.get("hybrid_override_pattern")
  if isinstance(pattern, str):
    return [_NEMOTRON_H_MIXERS.get(ch, ch) for ch in pattern]
  return ["linear_attention", "moe", "full_attention", "mlp"]


def _legacy_dense_layers(c):
  """mlp_layer_types as A.X-K2's config class derives it without one: MoE layers from
  first_k_dense_replace (1) on, those that moe_layer_freq (1) divides (a config without
  num_hidden_layers: as many as any index)."""
  first = c.get("first_k_dense_replace")
  first = 1 if first is None else first
  freq = c.get("moe_layer_freq") or 1
  total = c.get("num_hidden_layers") or first + 1024
  return ["sparse" if i >= first and i % freq == 0 else "dense" for i in range(total)]


# The decoder layers' dense-layer fields as transformers 5.24's config classes default them, by
# model_type: values, or functions of the config where a class derives the field (mlp_layer_types
# from a fixed count of dense layers, which first_k_dense_replace does not move there; A.X-K2's
# from its legacy first_k_dense_replace and moe_layer_freq; Step's moe_layers_enum, layers 3 on).
# The other families' defaults make no layer dense.
_DENSE_DEFAULTS = {
    **{t: dict(first_k_dense_replace=1) for t in (
        "dots3_note_text", "exaone_moe", "glm4_moe", "glm4v_moe_text", "kimi_linear",
        "sarvam_mla", "sarvam_moe")},
    **{t: dict(first_k_dense_replace=3) for t in ("deepseek_v3", "kimi_k2", "deepseek_v32",
                                                  "glm_moe_dsa")},
    **{t: dict(mlp_layer_types=_leading_dense(1)) for t in ("glm4_moe_lite", "mimo_v2_flash",
                                                              "laguna")},
    "glm5_next_text": dict(mlp_layer_types=_leading_dense(3)),
    "axk2": dict(mlp_layer_types=_legacy_dense_layers),
    "mistral_large4_text": dict(first_k_dense_replace=1),
    "step3p5": dict(moe_layers_enum=lambda c: list(range(3, c.get("num_hidden_layers") or 1027))),
    "bailing_hybrid": dict(first_k_dense_replace=2),
    "hy_v3": dict(mlp_layer_types=_leading_dense(1)),
    "beam": dict(mlp_layer_types=_leading_dense(3)),
    "nemotron_h": dict(layers_block_type=_nemotron_h_layers),
    "afmoe": dict(num_dense_layers=1),
    "lfm2_moe": dict(num_dense_layers=2),
    "jamba": dict(expert_layer_period=2, expert_layer_offset=1),
    "flint": dict(mlp_only_layers=[0, 1]),
    "ernie4_5_moe": dict(moe_layer_interval=1, moe_layer_start_index=1, moe_layer_end_index=-1),
    # (mlp_layer_types from first_k_dense_replace, which a config.json may give instead)
    "unlimited_ocr_text": dict(first_k_dense_replace=1),
}


def _families():
  mlp = "model.layers.{layer}.mlp."
  qwen_shared = dict(shared="shared_expert.", shared_gate="shared_expert_gate.weight")
  v3 = dict(selection_bias="gate.e_score_correction_bias", shared="shared_experts.")
  # A field that a config leaves out means its transformers config class's default: `_defaults`
  # gives a reader the family's where they differ from the reader's own fallback. Most
  # DeepSeek-V3-router configs renormalise and have one shared expert.
  one_shared = dict(norm_topk_prob=True, n_shared_experts=1)
  v3_defaults = dict(one_shared, n_group=8, topk_group=4, routed_scaling_factor=2.5)
  v3_shared_named = _renamed(_defaults(_deepseek_v3, **one_shared, routed_scaling_factor=2.5),
                             n_shared_experts="num_shared_experts")
  kimi_linear_names = dict(n_group="num_expert_group", norm_topk_prob="moe_renormalize",
                           n_shared_experts="num_shared_experts",
                           num_experts_per_tok="num_experts_per_token")
  fams = [
      Family("mixtral", "MixtralSparseMoeBlock", mlp,
             _softmax_family("intermediate_size", True)),
      Family("minimax", "MiniMaxSparseMoeBlock", mlp,
             _softmax_family("intermediate_size", True)),
      Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", mlp,
             _defaults(_softmax_family("moe_intermediate_size", "norm_topk_prob",
                                       "shared_expert_intermediate_size", shared_gate=True),
                       shared_expert_intermediate_size=5632), **qwen_shared),
      Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", mlp,
             _softmax_family("moe_intermediate_size", "norm_topk_prob")),
      Family("qwen3_next", "Qwen3NextSparseMoeBlock", mlp,
             _defaults(_softmax_family("moe_intermediate_size", "norm_topk_prob",
                                       "shared_expert_intermediate_size", shared_gate=True),
                       norm_topk_prob=True, shared_expert_intermediate_size=512), **qwen_shared),
      Family("qwen3_5_moe_text", "Qwen3_5MoeSparseMoeBlock", mlp,
             _defaults(_softmax_family("moe_intermediate_size", True,
                                       "shared_expert_intermediate_size", shared_gate=True),
                       shared_expert_intermediate_size=512), **qwen_shared,
             multimodal_prefix="model.language_model.layers.{layer}.mlp."),
      Family("qwen3_vl_moe_text", "Qwen3VLMoeTextSparseMoeBlock",
             "model.language_model.layers.{layer}.mlp.",
             _softmax_family("moe_intermediate_size", True)),
      Family("qwen3_omni_moe_text", "Qwen3OmniMoeThinkerTextSparseMoeBlock",
             "thinker.model.language_model.layers.{layer}.mlp.",
             _defaults(_softmax_family("moe_intermediate_size", "norm_topk_prob"),
                       norm_topk_prob=True)),
      # (the talker's config class has no default shared_expert_intermediate_size: required)
      Family("qwen3_omni_moe_talker_text", "Qwen3OmniMoeTalkerTextSparseMoeBlock",
             "talker.model.layers.{layer}.mlp.",
             _softmax_family("moe_intermediate_size", "norm_topk_prob",
                             "shared_expert_intermediate_size", shared_gate=True), **qwen_shared),
      # Qwen3-Next's block; the decoder layer's hyper-connections (its streams mixed into the
      # block's input, the output added back to each) are outside it
      Family("qwen4_exp_text", "Qwen4ExpTextSparseMoeBlock", mlp,
             _defaults(_softmax_family("moe_intermediate_size", "norm_topk_prob",
                                       "shared_expert_intermediate_size", shared_gate=True),
                       norm_topk_prob=True, shared_expert_intermediate_size=512), **qwen_shared,
             multimodal_prefix="model.language_model.layers.{layer}.mlp."),
      # softmax over E (logits in float32), top-K; one shared expert without a gate
      Family("lara_mini", "LaraMiniSparseMoeBlock", mlp,
             _defaults(_softmax_family("moe_intermediate_size", "norm_topk_prob",
                                       "shared_expert_intermediate_size"),
                       norm_topk_prob=True, shared_expert_intermediate_size=512),
             shared="shared_expert."),
      Family("mellum", "MellumSparseMoeBlock", mlp,
             _defaults(_softmax_family("moe_intermediate_size", "norm_topk_prob"),
                       norm_topk_prob=True)),
      Family("flint", "FlintSparseMoeBlock", mlp,
             _defaults(_flint, norm_topk_prob=True, shared_expert_intermediate_size=1024),
             shared="shared_expert."),
      Family("laguna", "LagunaSparseMoeBlock", mlp,
             _defaults(_laguna, shared_expert_intermediate_size=512),
             selection_bias="gate.e_score_correction_bias", shared="shared_experts."),
      Family("olmoe", "OlmoeSparseMoeBlock", mlp,
             _softmax_family("intermediate_size", "norm_topk_prob")),
      Family("flex_olmo", "FlexOlmoSparseMoeBlock", mlp,
             _softmax_family("intermediate_size", "norm_topk_prob")),
      Family("jamba", "JambaSparseMoeBlock", "model.layers.{layer}.feed_forward.",
             _softmax_family("intermediate_size", False), router="router.weight"),
      Family("deepseek_v2", "DeepseekV2Moe", mlp, _defaults(_deepseek_v2, n_shared_experts=2),
             shared="shared_experts."),
      Family("deepseek_v3", "DeepseekV3MoE", mlp, _defaults(_deepseek_v3, **v3_defaults), **v3,
             multimodal_prefix="model.language_model.layers.{layer}.mlp."),
      Family("deepseek_v32", "DeepseekV32MoE", mlp, _defaults(_deepseek_v3, **v3_defaults),
             **v3),
      Family("deepseek_v4", "DeepseekV4SparseMoeBlock", mlp,
             _defaults(_deepseek_v4, routed_scaling_factor=1.5, swiglu_limit=10.0), **v3,
             lookup="gate.tid2eid"),
      Family("glm4_moe", "Glm4MoeMoE", mlp, _defaults(_deepseek_v3, **one_shared), **v3),
      Family("glm4_moe_lite", "Glm4MoeLiteMoE", mlp,
             _defaults(_deepseek_v3, **one_shared, routed_scaling_factor=1.8), **v3),
      Family("glm5_next_text", "Glm5NextTextMoE", "model.language_model.layers.{layer}.mlp.",
             _defaults(_glm5_next, **one_shared, routed_scaling_factor=2.5, swiglu_limit=10.0),
             **v3),
      Family("glm_moe_dsa", "GlmMoeDsaMoE", mlp,
             _defaults(_deepseek_v3, **one_shared, routed_scaling_factor=2.5), **v3),
      Family("glm4v_moe_text", "Glm4vMoeTextMoE", "model.language_model.layers.{layer}.mlp.",
             _defaults(_deepseek_v3, **one_shared), **v3),
      Family("deepseek_ocr2_text", "DeepseekOcr2TextMoe",
             "model.language_model.layers.{layer}.mlp.",
             _defaults(_deepseek_ocr2, n_shared_experts=2), shared="shared_experts."),
      # DeepSeek-OCR-2's block under Unlimited-OCR's text config (one group by default)
      Family("unlimited_ocr_text", "UnlimitedOcrTextMoe",
             "model.language_model.layers.{layer}.mlp.",
             _defaults(_deepseek_ocr2, n_shared_experts=2, n_group=1, topk_group=1),
             shared="shared_experts."),
      # Kimi-K2's config.json names DeepSeek-V3's model "kimi_k2" (Kimi-K2.5's text_config too,
      # which transformers reads as a DeepseekV3Config: its defaults)
      Family("kimi_k2", "DeepseekV3MoE", mlp, _defaults(_deepseek_v3, **v3_defaults), **v3,
             multimodal_prefix="model.language_model.layers.{layer}.mlp."),
      Family("dots1", "Dots1MoE", mlp, _deepseek_v3, **v3),
      Family("kimi_linear", "KimiLinearMoE", mlp,
             _renamed(_defaults(_deepseek_v3, **one_shared, routed_scaling_factor=2.446),
                      **kimi_linear_names), **v3),
      Family("exaone_moe", "ExaoneMoeSparseMoEBlock", mlp, v3_shared_named, **v3),
      # transformers runs Sarvam on GLM-4.5's and DeepSeek-V3's models
      Family("sarvam_moe", "Glm4MoeMoE", mlp, v3_shared_named, **v3),
      Family("sarvam_mla", "DeepseekV3MoE", mlp, v3_shared_named, **v3),
      Family("afmoe", "AfmoeSparseMoeBlock", mlp, _defaults(_afmoe, num_shared_experts=2),
             router="router.gate.weight", selection_bias="expert_bias", shared="shared_experts."),
      Family("mimo_v2_flash", "MiMoV2FlashMoE", mlp,
             _defaults(_mimo_v2_flash, norm_topk_prob=True),
             selection_bias="gate.e_score_correction_bias"),
      Family("beam", "BeamMoE", mlp,
             _defaults(_mimo_v2_flash, norm_topk_prob=True, n_group=8, topk_group=4,
                       routed_scaling_factor=2.5),
             selection_bias="gate.e_score_correction_bias"),
      Family("nemotron_h", "NemotronHMoE", "model.layers.{layer}.mixer.",
             _defaults(_nemotron_h, norm_topk_prob=True, mlp_hidden_act="relu2",
                       moe_shared_expert_intermediate_size=7688, intermediate_size=21504),
             experts="up", selection_bias="gate.e_score_correction_bias",
             shared="shared_experts.", shared_kind="up"),
      Family("kolibri1", "Kolibri1SparseMoeBlock", mlp,
             _defaults(_kolibri1, shared_expert_intermediate_size=512),
             selection_bias="gate.e_score_correction_bias", shared="shared_experts."),
      # Step-3.7's text config (model_type "step3p5"), under its multimodal model's keys; its
      # legacy name share_expert_dims sets share_expert_dim, as in transformers
      Family("step3p5", "Step3p7SparseMoeBlock", "model.language_model.layers.{layer}.mlp.",
             _defaults(_renamed(_step3p5, share_expert_dim="share_expert_dims"),
                       share_expert_dim=1280),
             selection_bias="gate.e_score_correction_bias", shared="shared_experts."),
      # Ling 3.0: Kimi-Linear's block and field names
      Family("bailing_hybrid", "BailingHybridMoE", mlp,
             _renamed(_defaults(_deepseek_v3, **v3_defaults), **kimi_linear_names), **v3),
      Family("mistral4", "Mistral4MoE", mlp, _defaults(_mistral4, **one_shared),
             shared="shared_experts."),
      # (its only model is the multimodal one)
      Family("mistral_large4_text", "MistralLarge4TextMoE",
             "model.language_model.layers.{layer}.mlp.",
             _defaults(_mistral_large4, n_shared_experts=1), shared="shared_experts."),
      # DeepSeek-V3.2's block; A.X-K2-Light's config has no groups (n_group None)
      Family("axk2", "AXK2MoE", mlp,
             _defaults(_deepseek_v3, **one_shared, routed_scaling_factor=2.5), **v3),
      Family("solar_open", "SolarOpenMoE", mlp, _defaults(_deepseek_v3, **one_shared), **v3),
      Family("minimax_m2", "MiniMaxM2SparseMoeBlock", mlp, _minimax_m2,
             selection_bias="e_score_correction_bias"),
      Family("minimax_m3_vl_text", "MiniMaxM3VLSparseMoeBlock", mlp,
             _defaults(_minimax_m3, routed_scaling_factor=2.0, shared_intermediate_size=3072),
             selection_bias="gate.e_score_correction_bias", shared="shared_experts.",
             shared_kind="gate_up", multimodal_prefix="model.language_model.layers.{layer}.mlp."),
      Family("aria_text", "AriaTextMoELayer", mlp, _defaults(_aria, moe_num_shared_experts=2),
             router="router.weight", experts="fused_xw", shared="shared_experts.",
             multimodal_prefix="model.language_model.layers.{layer}.mlp."),
      Family("dots3_note_text", "Dots3NoteTextMoE", mlp,
             _defaults(_dots3, **one_shared, shared_experts_intermediate_size=1536), **v3,
             multimodal_prefix="model.language_model.layers.{layer}.mlp."),
      Family("granitemoe_swa", "GraniteMoeSWAMoE + the decoder layer's GraniteMoeSWAMLP",
             "model.layers.{layer}.", _granite, router="block_sparse_moe.router.weight",
             experts_prefix="block_sparse_moe.experts.", shared="shared_mlp.",
             shared_kind="fused"),
      Family("granitemoehybrid",
             "GraniteMoeHybridMoE + the decoder layer's GraniteMoeHybridMLP",
             "model.layers.{layer}.", _defaults(_granite_hybrid, shared_intermediate_size=1024),
             router="block_sparse_moe.router.weight",
             experts_prefix="block_sparse_moe.experts.", shared="shared_mlp.",
             shared_kind="fused"),
      Family("openai_privacy_filter", "OpenAIPrivacyFilterMLP", mlp, _privacy_filter,
             router="router.weight", experts="gpt_oss", router_bias="router.bias"),
      Family("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", mlp,
             _defaults(_ernie, moe_num_shared_experts=2),
             selection_bias="gate.moe_statics.e_score_correction_bias",
             selection_bias_shape="(1, E)", shared="shared_experts."),
      Family("lfm2_moe", "Lfm2MoeSparseMoeBlock", "model.layers.{layer}.feed_forward.",
             _defaults(_lfm2, norm_topk_prob=True, use_expert_bias=True),
             selection_bias="expert_bias"),
      Family("hunyuan_v1_moe", "HunYuanMoEV1Moe", mlp, _hunyuan, router="gate.wg.weight",
             shared="shared_mlp."),
      Family("hy_v3", "HYV3MoE", mlp,
             _defaults(_hy_v3, num_shared_experts=1, router_scaling_factor=2.826,
                       intermediate_size=13312),
             selection_bias="e_score_correction_bias", shared="shared_experts."),
      Family("gpt_oss", "GptOssMLP", mlp, _gpt_oss, router="router.weight", experts="gpt_oss",
             router_bias="router.bias", natural_layout="interleaved"),
      Family("llama4_text", "Llama4TextMoe", "model.layers.{layer}.feed_forward.", _llama4,
             router="router.weight", experts="fused_xw", shared="shared_expert.",
             multimodal_prefix="language_model.model.layers.{layer}.feed_forward."),
      Family("granitemoe", "GraniteMoeMoE", "model.layers.{layer}.block_sparse_moe.", _granite,
             router="router.weight"),
      Family("granitemoeshared", "GraniteMoeSharedMoE + the decoder layer's GraniteMoeSharedMLP",
             "model.layers.{layer}.", _granite, router="block_sparse_moe.router.weight",
             experts_prefix="block_sparse_moe.experts.", shared="shared_mlp.",
             shared_kind="fused"),
      Family("dbrx", "DbrxFFN", "transformer.blocks.{layer}.ffn.", _dbrx,
             router="router.layer.weight", experts="dbrx", experts_prefix="experts.mlp."),
      # The MoE part of the decoder layer: its router and experts, keys relative to the layer.
      Family("gemma4_text", "Gemma4TextRouter + Gemma4TextExperts of the decoder layer",
             "model.layers.{layer}.", _defaults(_gemma4, hidden_activation="gelu_pytorch_tanh"),
             router="router.proj.weight",
             router_scale="router.scale", expert_scale="router.per_expert_scale",
             multimodal_prefix="model.language_model.layers.{layer}."),
      # Gemma 4's in every decoder layer of DiffusionGemmaForBlockDiffusion's diffusion decoder,
      # whose weights its encoder ties to its own (in memory under both; the Hub: the decoder's)
      Family("diffusion_gemma_text",
             "DiffusionGemmaTextRouter + DiffusionGemmaTextExperts of the decoder layer",
             "model.decoder.layers.{layer}.",
             _defaults(_gemma4_moe, hidden_activation="gelu_pytorch_tanh"),
             router="router.proj.weight",
             router_scale="router.scale", expert_scale="router.per_expert_scale",
             multimodal_prefix="model.encoder.language_model.layers.{layer}."),
  ]
  return {f.model_type: dataclasses.replace(f, dense_layers=_DENSE_DEFAULTS.get(f.model_type, {}))
          for f in fams}


FAMILIES: Mapping[str, Family] = types.MappingProxyType(_families())


# A multimodal config's model_type -> the model_type of its text_config (the language model's).
WRAPPERS = types.MappingProxyType({
    "gemma4": "gemma4_text", "llama4": "llama4_text", "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text", "qwen3_omni_moe_thinker": "qwen3_omni_moe_text",
    "qwen3_omni_moe_talker": "qwen3_omni_moe_talker_text", "glm5_next": "glm5_next_text",
    "glm4v_moe": "glm4v_moe_text", "deepseek_ocr2": "deepseek_ocr2_text",
    "kimi_k25": "deepseek_v3", "step3p7": "step3p5", "minimax_m3_vl": "minimax_m3_vl_text",
    "aria": "aria_text", "dots3_note": "dots3_note_text",
    "mistral_large4": "mistral_large4_text", "qwen4_exp": "qwen4_exp_text",
    "unlimited_ocr": "unlimited_ocr_text", "diffusion_gemma": "diffusion_gemma_text",
    "nemotron_h_omni": "nemotron_h", "nemo_speechlm": "nemotron_h"})

# A multimodal config.json's other name for its text config, read where it has no text_config:
# Unlimited-OCR's released one holds it as language_config (transformers builds its own text
# config class from it, whatever model_type it names), NemotronH-Omni's as llm_config.
_LEGACY_TEXT_CONFIGS = {"unlimited_ocr": "language_config", "nemotron_h_omni": "llm_config"}


def _names_a_model(config) -> bool:
  """Whether config is a config (a mapping or a transformers config object) with a model_type."""
  try:
    return "model_type" in _as_mapping(config)
  except TypeError:
    return False


def _as_mapping(config) -> Mapping[str, Any]:
  if not isinstance(config, Mapping) and callable(getattr(config, "to_dict", None)):
    config = config.to_dict()  # a transformers config object
  if not isinstance(config, Mapping):
    raise TypeError(f"config must be a dict (a transformers config's to_dict(), or a "
                    f"checkpoint's config.json), got {type(config).__name__}")
  return config


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
  """A multimodal config's text config (`WRAPPERS`; its model_type set where a checkpoint's
  config.json leaves it out; `_LEGACY_TEXT_CONFIGS`' where it has no text_config); any other
  config as it is."""
  config = _as_mapping(config)
  text_type = WRAPPERS.get(config.get("model_type"))
  legacy = config.get(_LEGACY_TEXT_CONFIGS.get(config.get("model_type"), ""))
  if text_type is not None and config.get("text_config") is None and isinstance(legacy, Mapping):
    return {**legacy, "model_type": text_type}
  if text_type is None or not isinstance(config.get("text_config"), Mapping):
    return config
  return {"model_type": text_type, **config["text_config"]}


def family(config: Mapping[str, Any] | str) -> Family:
  """The `Family` of a config dict (or of a model_type, a multimodal model's included)."""
  if not isinstance(config, str):
    config = _as_mapping(config)
  model_type = (WRAPPERS.get(config, config) if isinstance(config, str)
                else _text_config(config).get("model_type"))
  if model_type not in FAMILIES:
    inner = [] if isinstance(config, str) else [
        f"config[{k!r}]['text_config']" for k, v in config.items()
        if isinstance(v, Mapping) and isinstance(v.get("text_config"), Mapping)]
    hint = f"; pass its language model's config, {' or '.join(inner)}" if inner else ""
    near = difflib.get_close_matches(str(model_type), FAMILIES, n=3)
    hint += f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
    raise ValueError(f"model_type {model_type!r} is not a supported MoE family{hint} (for a "
                     f"family whose router this module does not map, run its router and "
                     f"sonic_jax.routed_experts: this module's docstring, \"Not in scope\"); "
                     f"supported: {sorted(FAMILIES)}")
  return FAMILIES[model_type]


def layer_kwargs(config: Mapping[str, Any], *, gate_up_layout: str | None = None,
                 bias_update_rate: float = 1e-3, layer: int | None = None) -> dict:
  """Keyword arguments of `sonic_jax.layers.MoE` for the family's MoE block.

  config: the transformers config as a dict (`config.to_dict()`, or a checkpoint's config.json).
  gate_up_layout: the layer's gate/up layout (default: the family's, "concat"; gpt-oss
    "interleaved"); pass the same to the weight converters. bias_update_rate: the rate of the
    selection bias for families that have one (the config does not say; DeepSeek-V3's paper uses
    0.001). layer: the decoder layer's index, for configs that differ by layer (per-layer
    lists: Hunyuan's, DeepSeek-V4's layer types, Step-3.7's limits, a per-layer E or K).
  Returns d_model, num_experts, expert_dim, top_k, activation, routing (a `Router`),
  gate_up_layout, use_bias, use_router_bias, num_shared_experts, shared_expert_dim,
  shared_expert_gate and, with a selection bias, bias_update_rate (Gemma 4: router_norm_eps and
  use_expert_scale too; DeepSeek-V4's hash layers: fixed_selection). They describe the model's MoE
  layers (families that mix in dense layers, first_k_dense_replace and the like, say which).
  A dense decoder layer (first_k_dense_replace, mlp_only_layers, moe_layers and the like, as
  transformers' decoder layers read them) is refused by index.
  A field the config leaves out means its transformers config class's default (transformers 5.24),
  as transformers reads the config; most families require the routed experts' sizes (hidden size,
  expert count and width, K): a ValueError names the missing one.
  """
  config = _text_config(config)
  fam = family(config)
  _check_moe_layer(config, fam, layer)
  kw = fam.kwargs(config, layer)
  if kw["num_experts"] == 0:  # where _dense_layer has no layer to say it of
    raise ValueError(f"this {fam.model_type} config has num_experts=0: its decoder layers are "
                     f"dense ones, without an MoE block")
  if kw.pop("selection_bias", False):
    if not bias_update_rate > 0:
      raise ValueError(f"{fam.model_type} has a selection bias: bias_update_rate must be > 0")
    kw["bias_update_rate"] = float(bias_update_rate)
  if gate_up_layout is not None:
    if gate_up_layout not in acts.GATE_UP_LAYOUTS:
      raise ValueError(f"gate_up_layout must be one of {acts.GATE_UP_LAYOUTS}, got "
                       f"{gate_up_layout!r}")
    kw["gate_up_layout"] = gate_up_layout
  return kw


def _dense_reason(config: Mapping[str, Any], fam: Family, layer: int | None) -> str | None:
  """Why decoder layer `layer` is dense (`_dense_layer`), the fields a config leaves out read at
  their class defaults (a field given as None is absent: its class derives or defaults it)."""
  defaults = {k: v(config) if callable(v) else v for k, v in fam.dense_layers.items()
              if config.get(k) is None}
  return _dense_layer({**config, **defaults}, layer)


def _check_moe_layer(config: Mapping[str, Any], fam: Family, layer: int | None) -> None:
  """A decoder layer index in range whose layer has an MoE block, else a ValueError naming it."""
  _check_layer(config, layer)
  dense = _dense_reason(config, fam, layer)
  if dense:
    raise ValueError(f"decoder layer {layer} of this {fam.model_type} config is a dense one "
                     f"({dense}): it has no MoE block")


def _check_layer_type(layer) -> None:
  if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
    raise TypeError(f"layer must be a decoder layer's index (an int), got "
                    f"{type(layer).__name__}")


def _check_layer(config: Mapping[str, Any], layer: int | None) -> None:
  if layer is None:
    return
  count = config.get("num_hidden_layers")
  if count is None:  # NemotronH's is a property of its config class: one mixer a layer
    mixers = config.get("layers_block_type") or config.get("hybrid_override_pattern")
    count = len(mixers) if isinstance(mixers, (str, list, tuple)) else None
  mtp = config.get("num_nextn_predict_layers") or 0
  if isinstance(count, numbers.Integral):  # multi-token-prediction layers follow the decoder's
    count += mtp
  _check_layer_type(layer)
  if layer < 0 or (isinstance(count, numbers.Integral) and layer >= count):
    within = f" in [0, {count})" if isinstance(count, numbers.Integral) else " (>= 0)"
    if mtp and isinstance(count, numbers.Integral):
      within += f" (the last {mtp}: multi-token-prediction layers)"
    raise ValueError(f"layer must be a decoder layer's index{within}, got {layer!r}")


def _dense_layer(c: Mapping[str, Any], layer: int | None) -> str | None:
  """Why decoder layer `layer` is a dense MLP, by the fields the config gives with which
  transformers' decoder layers choose (as its modeling code reads them), or None."""
  if layer is None:
    return None
  get = lambda name: c.get(name) if isinstance(c.get(name), (int, list, tuple)) else None
  kinds = get("mlp_layer_types")  # where a config has it, transformers reads it alone
  if kinds is not None:
    return "mlp_layer_types says dense" if layer < len(kinds) and kinds[layer] == "dense" else None
  mixers = get("layers_block_type")  # NemotronH's: a layer's one mixer, "moe" the block's
  if mixers is not None:
    if layer < len(mixers) and mixers[layer] != "moe":
      return f"layers_block_type says {mixers[layer]!r}"
    return None
  enum = c.get("moe_layers_enum")  # Step's hub configs: its MoE layers, "3,4,..." or a list
  if enum is not None and isinstance(enum, (str, list, tuple)):
    items = enum.split(",") if isinstance(enum, str) else enum
    if layer not in {int(i) for i in items if str(i).strip()}:
      return "moe_layers_enum does not list it"
    return None
  period, offset = get("expert_layer_period"), get("expert_layer_offset")  # Jamba's
  if period and offset is not None and layer % period != offset:
    return f"expert_layer_period={period}, expert_layer_offset={offset}"
  if get("first_k_dense_replace") is not None and layer < c["first_k_dense_replace"]:
    return f"first_k_dense_replace={c['first_k_dense_replace']}"
  if get("num_dense_layers") is not None and layer < c["num_dense_layers"]:
    return f"num_dense_layers={c['num_dense_layers']}"
  if get("mlp_only_layers") is not None and layer in c["mlp_only_layers"]:
    return f"in mlp_only_layers {list(c['mlp_only_layers'])}"
  if c.get("num_experts") == 0:  # Qwen2/3-MoE's decoder layers: experts only where > 0
    return "num_experts=0"
  step = get("decoder_sparse_step")
  if step and (layer + 1) % step:
    return f"decoder_sparse_step={step}"
  if get("moe_layers") is not None and layer not in c["moe_layers"]:
    return f"not in moe_layers {list(c['moe_layers'])}"
  step = get("interleave_moe_layer_step")  # Llama 4's, where moe_layers is not given
  if get("moe_layers") is None and step and (layer + 1) % step:
    return f"interleave_moe_layer_step={step}"
  if all(get(k) is not None for k in ("moe_layer_interval", "moe_layer_start_index",
                                       "moe_layer_end_index")):
    end = c["moe_layer_end_index"]  # -1: the last layer
    end = (c.get("num_hidden_layers") or layer + 1) - 1 if end == -1 else end
    if not ((layer + 1) % c["moe_layer_interval"] == 0
            and c["moe_layer_start_index"] <= layer <= end):
      return (f"moe_layer_interval={c['moe_layer_interval']}, moe_layer_start_index="
              f"{c['moe_layer_start_index']}, moe_layer_end_index={c['moe_layer_end_index']}")
  return None


# --- gate/up columns in NumPy (as `sonic_jax.activations`, without JAX) -------------------------

def _split(w: Array, layout: str) -> tuple[Array, Array]:
  if layout == "concat":
    half = w.shape[-1] // 2
    return w[..., :half], w[..., half:]
  return w[..., 0::2], w[..., 1::2]


def _merge(gate: Array, up: Array, layout: str) -> Array:
  if layout == "concat":
    return np.concatenate([gate, up], axis=-1)
  return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def _relayout(w: Array, source: str, target: str) -> Array:
  return w if source == target else _merge(*_split(w, source), target)


def _t(w: Array) -> Array:
  """Swaps the last two axes (a copy, C-contiguous)."""
  return np.ascontiguousarray(np.swapaxes(np.asarray(w), -1, -2))


def _layout(fam: Family, gate_up_layout: str | None) -> str:
  layout = fam.natural_layout if gate_up_layout is None else gate_up_layout
  if layout not in acts.GATE_UP_LAYOUTS:
    raise ValueError(f"gate_up_layout must be one of {acts.GATE_UP_LAYOUTS}, got {layout!r}")
  return layout


def _param_shapes(config: Mapping[str, Any], layer: int | None) -> dict[str, tuple[int, ...]]:
  """The shapes of the layer's parameters for this config (`PARAM_NAMES`); a config whose sizes
  differ by layer needs the layer (a PerLayerFieldError says so): unchecked, a block of the
  wrong layer, or transposed, would convert."""
  kw = layer_kwargs(config, layer=layer)
  d, e, n = kw["d_model"], kw["num_experts"], kw["expert_dim"]
  width = acts.get_activation(kw["activation"]).width_multiplier()
  s_dim = kw["num_shared_experts"] * (kw["shared_expert_dim"] or n)
  return {"router": (d, e), "w1": (e, d, width * n), "w2": (e, n, d), "b1": (e, width * n),
          "b2": (e, d), "router_bias": (e,), "selection_bias": (e,), "router_scale": (d,),
          "expert_scale": (e,), "shared_in": (d, width * s_dim), "shared_out": (s_dim, d),
          "shared_gate": (d, 1)}


def _check_shapes(params: Mapping[str, Any], want: Mapping[str, tuple[int, ...]], source: str):
  bad = {k: (tuple(v.shape), want[k]) for k, v in params.items()
         if k in want and tuple(v.shape) != want[k]}
  if bad:
    raise ValueError(f"{source}: shapes that do not fit the config ((given, expected) per layer "
                     f"parameter): {bad}")


# shared_kind -> a shared MLP of two Linears: the names of its input Linear ((2s, d) gate rows
# then up rows, or (s, d) without a gate) and its (d, s) output Linear, and whether it is gated
_TWO_LINEAR_SHARED = {"fused": ("input_linear", "output_linear", True),
                      "gate_up": ("gate_up_proj", "down_proj", True),
                      "up": ("up_proj", "down_proj", False)}


def _shared_keys(fam: Family) -> tuple[str, ...]:
  if fam.shared is None:
    return ()
  if fam.shared_kind in _TWO_LINEAR_SHARED:
    return tuple(fam.shared + f"{p}.weight" for p in _TWO_LINEAR_SHARED[fam.shared_kind][:2])
  return tuple(fam.shared + f"{p}_proj.weight" for p in ("gate", "up", "down"))


def _expert_keys(fam: Family) -> tuple[str, ...]:
  p = fam.experts_prefix
  if fam.experts == "dbrx":
    return (p + "w1", p + "v1", p + "w2")
  if fam.experts == "gpt_oss":
    return (p + "gate_up_proj", p + "gate_up_proj_bias", p + "down_proj", p + "down_proj_bias")
  if fam.experts == "up":
    return (p + "up_proj", p + "down_proj")
  return (p + "gate_up_proj", p + "down_proj")


def hf_keys(config: Mapping[str, Any], *, layer: int | None = None) -> tuple[str, ...]:
  """The keys of the family's block state dict that the converters read and write (a shared
  expert's only where the config has one); layer: the decoder layer's index where the family's
  layers differ (DeepSeek-V4's hash layers have no selection bias)."""
  config = _text_config(config)
  fam = family(config)
  parts = _block_parts(config, fam, layer)
  keys = (fam.router,) + _expert_keys(fam)
  keys += tuple(getattr(fam, name) for name in _AS_THEY_ARE if getattr(fam, name))
  if "selection_bias" in parts:
    keys += (fam.selection_bias,)
  if "shared_in" in parts:
    keys += _shared_keys(fam)
  if "shared_gate" in parts:
    keys += (fam.shared_gate,)
  return keys


def _block_parts(config: Mapping[str, Any], fam: Family, layer: int | None) -> set[str]:
  """The layer's parameters that decoder layer `layer`'s block holds (`PARAM_NAMES`); the layer
  checked (`_check_moe_layer`). Without a layer, a config of per-layer lists answers for layer 0:
  which parts exist does not vary by layer there."""
  _check_moe_layer(config, fam, layer)
  kw = fam.kwargs(config, 0 if layer is None and _has_lists(config) else layer)
  parts = {"router", "w1", "w2", *(name for name in _AS_THEY_ARE if getattr(fam, name))}
  parts |= {"b1", "b2"} if fam.experts == "gpt_oss" else set()
  parts |= {"selection_bias"} if kw.get("selection_bias") else set()
  if kw["num_shared_experts"]:
    parts |= {"shared_in", "shared_out"} | ({"shared_gate"} if kw["shared_expert_gate"] else set())
  return parts


# Weights are floating point, at least 16 bits: 8-bit ones are quantized (with scales to apply).
_WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _as_array(key: str, value: Any) -> np.ndarray:
  """state_dict[key] as a NumPy array of a weight dtype, or a TypeError naming the key."""
  try:
    a = np.asarray(value)
  except (TypeError, ValueError, RuntimeError) as e:
    raise TypeError(f"state_dict[{key!r}] ({type(value).__name__}) is not a NumPy array ({e}); "
                    f"a torch tensor: tensor.detach().float().cpu().numpy()") from None
  if a.dtype.name not in _WEIGHT_DTYPES:
    hint = ("8-bit weights are quantized: dequantize them first (their *_scale_inv)"
            if a.dtype.itemsize == 1 else
            "bfloat16 saved by NumPy loads as raw bytes: a.view(ml_dtypes.bfloat16)"
            if a.dtype.kind == "V" else "weights are floating point")
    raise TypeError(f"state_dict[{key!r}] has dtype {a.dtype}, not one of {_WEIGHT_DTYPES}: "
                    f"{hint}")
  return a


class LayerParams(dict):
  """The layer's parameter arrays by name (`PARAM_NAMES`), and `gate_up_layout`: the order of
  the gate and up columns in w1, b1 and shared_in (None where not known). A pytree whose
  `jax.tree.map` and copies keep the layout; a plain dict made of it (`{**params}`) loses it."""

  def __init__(self, arrays=(), gate_up_layout: str | None = None):
    super().__init__(arrays)
    self.gate_up_layout = gate_up_layout

  def copy(self) -> LayerParams:
    return LayerParams(self, self.gate_up_layout)

  def __or__(self, other) -> LayerParams:
    return LayerParams({**self, **other}, self.gate_up_layout)


jax.tree_util.register_pytree_with_keys(
    LayerParams,
    lambda p: ([(jax.tree_util.DictKey(k), p[k]) for k in sorted(p)], (tuple(sorted(p)),
                                                                        p.gate_up_layout)),
    lambda aux, children: LayerParams(zip(aux[0], children), aux[1]))


def _few(keys, count=10):
  return f"{keys[:count]}{f' and {len(keys) - count} more' if len(keys) > count else ''}"


def _has_lists(config):
  return any(isinstance(config.get(k), (list, tuple)) for k in ("num_experts", "moe_topk"))


def layer_params_from_hf(config: Mapping[str, Any], state_dict: Mapping[str, Any], *,
                         gate_up_layout: str | None = None,
                         layer: int | None = None) -> LayerParams:
  """The layer's parameter arrays (names as `MoE`'s attributes: router, w1, w2, b1, b2,
  router_bias, selection_bias, shared_in, shared_out, shared_gate, router_scale, expert_scale;
  only those the family has)
  from the block's state dict (keys relative to the block; values NumPy arrays or anything
  `np.asarray` takes). Exact: only transposes, reshapes and column reorders; dtypes kept.

  gate_up_layout: the target layer's layout (default the family's; the result's
  `gate_up_layout`, which `load_into_layer` checks against the layer's). layer: as `hf_keys`.
  Raises a ValueError naming the keys that are missing or not understood (a shared-expert bias,
  say), a TypeError naming one that is not a float16, bfloat16, float32 or float64 array
  (quantized 8-bit weights, say; a torch tensor: `tensor.detach().float().cpu().numpy()`).
  """
  config = _text_config(config)
  fam = family(config)
  layout = _layout(fam, gate_up_layout)
  want = hf_keys(config, layer=layer)
  sd = {k: _as_array(k, v) for k, v in state_dict.items() if k != fam.lookup}
  missing = [k for k in want if k not in sd]
  extra = [k for k in sd if k not in want]
  if missing or extra:
    # A whole model's state dict (a real one has 10^5 keys), or one block's keys with their
    # model's prefix, is named by a few and pointed at block_state_dict.
    prefixed = any(k.endswith("." + w) for k in extra for w in want)
    whole = ("; a whole model's state dict, or one block's keys with their model's prefix? "
             "hf.block_state_dict(config, state_dict, layer=...) takes one layer's block out of it"
             if len(extra) > 2 * len(want) or prefixed else "")
    raise ValueError(f"{fam.model_type} block state dict: missing keys {missing}, unexpected "
                     f"keys {_few(extra)} (expected exactly {list(want)}){whole}")
  want_shapes = _param_shapes(config, layer)
  try:
    out = _params_of_state(config, fam, sd, layout)
  except (ValueError, IndexError, np.exceptions.AxisError) as e:
    raise ValueError(f"{fam.model_type} block state dict: its shapes "
                     f"{ {k: tuple(v.shape) for k, v in sd.items()} } do not fit the config "
                     f"(the layer's: {want_shapes}): {e}") from None
  _check_shapes(out, want_shapes, f"{fam.model_type} block state dict")
  return LayerParams(out, layout)


def _params_of_state(config, fam: Family, sd: Mapping[str, np.ndarray], layout: str) -> dict:
  out = {"router": _t(sd[fam.router])}
  p = fam.experts_prefix
  if fam.experts == "fused":
    out["w1"] = _relayout(_t(sd[p + "gate_up_proj"]), "concat", layout)
    out["w2"] = _t(sd[p + "down_proj"])
  elif fam.experts == "fused_xw":
    out["w1"] = _relayout(sd[p + "gate_up_proj"].copy(), "concat", layout)
    out["w2"] = sd[p + "down_proj"].copy()
  elif fam.experts == "up":  # no gate: no gate/up columns to order
    out["w1"] = _t(sd[p + "up_proj"])
    out["w2"] = _t(sd[p + "down_proj"])
  elif fam.experts == "gpt_oss":
    out["w1"] = _relayout(sd[p + "gate_up_proj"].copy(), fam.natural_layout, layout)
    out["b1"] = _relayout(sd[p + "gate_up_proj_bias"].copy(), fam.natural_layout, layout)
    out["w2"] = sd[p + "down_proj"].copy()
    out["b2"] = sd[p + "down_proj_bias"].copy()
  else:  # dbrx: (E * n, d) each
    e = int(layer_kwargs(config)["num_experts"])
    gate, up, down = (sd[p + k].reshape(e, -1, sd[p + k].shape[-1]) for k in ("w1", "v1", "w2"))
    out["w1"] = _merge(_t(gate), _t(up), layout)
    out["w2"] = down.copy()
  for name in _AS_THEY_ARE:
    if getattr(fam, name):
      out[name] = sd[getattr(fam, name)].copy()
  if fam.selection_bias and fam.selection_bias in sd:
    out["selection_bias"] = sd[fam.selection_bias].reshape(-1).copy()
  if fam.shared and _shared_keys(fam)[0] in sd:
    if fam.shared_kind in _TWO_LINEAR_SHARED:
      w_in, w_out = (sd[k] for k in _shared_keys(fam))
      gated = _TWO_LINEAR_SHARED[fam.shared_kind][2]
      out["shared_in"] = _relayout(_t(w_in), "concat", layout) if gated else _t(w_in)
    else:
      gate, up, w_out = (sd[k] for k in _shared_keys(fam))
      out["shared_in"] = _merge(_t(gate), _t(up), layout)
    out["shared_out"] = _t(w_out)
    if fam.shared_gate and fam.shared_gate in sd:
      out["shared_gate"] = _t(sd[fam.shared_gate])
  return out


def hf_state_from_layer(config: Mapping[str, Any], params: Mapping[str, Any], *,
                        gate_up_layout: str | None = None,
                        layer: int | None = None) -> dict[str, Array]:
  """The block's state dict from the layer's parameter arrays (`layer_params`): the inverse of
  `layer_params_from_hf`, exact. gate_up_layout: the arrays' layout, required where `params` do
  not carry one (`layer_params` of a layer does; of a State, the layer's must be passed). Parts
  absent from `params` (selection_bias, say, when mapping gradients) are left out; a part the
  family's block has no place for (biases for Mixtral, say) is refused, not dropped. Being a
  permutation of entries, it maps the layer's gradients to the block's parameters' gradients
  too. layer: as `hf_keys` (configs with per-layer lists need it); a ValueError names the
  parameters whose shapes do not fit the config."""
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be a mapping of the layer's parameter names to arrays, got "
                    f"{type(params).__name__} (for an MoE layer: "
                    f"hf_state_from_layer(config, layer_params(module)))")
  config = _text_config(config)
  fam = family(config)
  known = getattr(params, "gate_up_layout", None)
  if gate_up_layout is not None and known is not None and gate_up_layout != known:
    raise ValueError(f"gate_up_layout={gate_up_layout!r}, but params hold the "
                     f"{known!r} layout (layer_params reads it from the layer)")
  if gate_up_layout is None and known is None:
    # The family's layout would be a guess: a layer of the other one would map its gate and up
    # columns crosswise, silently.
    raise ValueError("params do not say their gate/up layout (an nnx.State's, gradients say): "
                     "pass gate_up_layout=layer.gate_up_layout, or layer_params(layer)")
  layout = _layout(fam, gate_up_layout if gate_up_layout is not None else known)
  prm = {k: np.asarray(v) for k, v in params.items() if v is not None}
  unknown = [k for k in prm if k not in PARAM_NAMES]
  if unknown:
    raise ValueError(f"unknown layer parameter names {unknown} (known: {PARAM_NAMES})")
  for k in ("router", "w1", "w2"):
    if k not in prm:
      raise ValueError(f"params must hold {k!r}")
  if unplaced := sorted(set(prm) - _block_parts(config, fam, layer)):
    raise ValueError(f"the {fam.model_type} block of this config has no place for the layer's "
                     f"{unplaced}: they would be dropped, and the block would compute something "
                     f"else than the layer")
  _check_shapes(prm, _param_shapes(config, layer), "params")
  sd = {fam.router: _t(prm["router"])}
  p = fam.experts_prefix
  if fam.experts == "fused":
    sd[p + "gate_up_proj"] = _t(_relayout(prm["w1"], layout, "concat"))
    sd[p + "down_proj"] = _t(prm["w2"])
  elif fam.experts == "fused_xw":
    sd[p + "gate_up_proj"] = np.ascontiguousarray(_relayout(prm["w1"], layout, "concat"))
    sd[p + "down_proj"] = prm["w2"].copy()
  elif fam.experts == "up":
    sd[p + "up_proj"] = _t(prm["w1"])
    sd[p + "down_proj"] = _t(prm["w2"])
  elif fam.experts == "gpt_oss":
    sd[p + "gate_up_proj"] = np.ascontiguousarray(_relayout(prm["w1"], layout,
                                                            fam.natural_layout))
    if "b1" in prm:
      sd[p + "gate_up_proj_bias"] = np.ascontiguousarray(
          _relayout(prm["b1"], layout, fam.natural_layout))
    sd[p + "down_proj"] = prm["w2"].copy()
    if "b2" in prm:
      sd[p + "down_proj_bias"] = prm["b2"].copy()
  else:
    gate, up = _split(prm["w1"], layout)
    e, n, d = prm["w2"].shape
    sd[p + "w1"] = _t(gate).reshape(e * n, d)
    sd[p + "v1"] = _t(up).reshape(e * n, d)
    sd[p + "w2"] = prm["w2"].reshape(e * n, d).copy()
  for name in _AS_THEY_ARE:
    if getattr(fam, name) and name in prm:
      sd[getattr(fam, name)] = prm[name].copy()
  if fam.selection_bias and "selection_bias" in prm:
    shape = (1, -1) if fam.selection_bias_shape == "(1, E)" else (-1,)
    sd[fam.selection_bias] = prm["selection_bias"].reshape(shape).copy()
  if fam.shared and "shared_in" in prm:
    keys = _shared_keys(fam)
    if fam.shared_kind in _TWO_LINEAR_SHARED:
      gated = _TWO_LINEAR_SHARED[fam.shared_kind][2]
      sd[keys[0]] = _t(_relayout(prm["shared_in"], layout, "concat") if gated
                       else prm["shared_in"])
    else:
      gate, up = _split(prm["shared_in"], layout)
      sd[keys[0]], sd[keys[1]] = _t(gate), _t(up)
    sd[keys[-1]] = _t(prm["shared_out"])
  if fam.shared_gate and "shared_gate" in prm:
    sd[fam.shared_gate] = _t(prm["shared_gate"])
  return sd


# A Hub checkpoint (what transformers' save_pretrained writes) names some blocks' modules and
# tensors otherwise than the in-memory state dict, which transformers converts them to on loading.
# Module names standing for "mlp" in the block's prefix: Mixtral's, MiniMax's and Kimi-Linear's
# block_sparse_moe, DeepSeek-V4's ffn.
_HUB_MODULES = (".block_sparse_moe.", ".ffn.")
# Families whose Hub checkpoint holds the block's modules as the decoder layer's own (Mistral
# Large 4's layers.{i}.gate, layers.{i}.experts.{e}.w1, layers.{i}.shared_experts.w1, ...).
_HUB_IN_LAYER = ("mistral_large4_text",)
# Where released checkpoints root their decoder layers, beside the family's own prefixes: Step-3.7
# and DeepSeek-OCR-2 under "model.layers.", MiniMax-M3-VL and Kimi-K2.5 under their language
# model's "language_model.model.layers.", DeepSeek-V4 and Mistral Large 4 under "layers.",
# NemotronH under "backbone.layers." (transformers moves each to the model's own prefix when it
# loads them).
_HUB_ROOTS = ("model.", "model.language_model.", "language_model.model.", "", "backbone.")


def _rooted(prefixes: list[str]) -> list[str]:
  """prefixes, then each under the other `_HUB_ROOTS` (its part before "layers.{i}." replaced),
  without repeats."""
  out = list(prefixes)
  for p in prefixes:
    at = p.find("layers.")
    if at >= 0 and p[:at] in _HUB_ROOTS:
      out += [root + p[at:] for root in _HUB_ROOTS if root + p[at:] not in out]
  return out


# (Hub name, in-memory name), relative to the module that holds the experts: Granite's, Aria's,
# DeepSeek-V4's, the selection biases of Sarvam, Bailing, EXAONE, MiniMax-M3 and ERNIE, Hy3's
# router, bias and shared MLP, Laguna's bias and shared expert. Each renames only into a key the
# family reads that the checkpoint lacks.
_HUB_RENAMES = (
    ("input_linear.weight", "experts.gate_up_proj"),
    ("output_linear.weight", "experts.down_proj"),
    ("router.layer.weight", "router.weight"),
    ("experts.fc1.weight", "experts.gate_up_proj"),
    ("experts.fc2.weight", "experts.down_proj"),
    ("gate.bias", "gate.e_score_correction_bias"),
    ("gate.expert_bias", "gate.e_score_correction_bias"),
    ("e_score_correction_bias", "gate.e_score_correction_bias"),
    ("moe_statics.e_score_correction_bias", "gate.moe_statics.e_score_correction_bias"),
    ("shared_experts.w1.weight", "shared_experts.gate_proj.weight"),
    ("shared_experts.w3.weight", "shared_experts.up_proj.weight"),
    ("shared_experts.w2.weight", "shared_experts.down_proj.weight"),
    ("router.gate.weight", "gate.weight"),
    ("expert_bias", "e_score_correction_bias"),
    ("shared_mlp.gate_proj.weight", "shared_experts.gate_proj.weight"),
    ("shared_mlp.up_proj.weight", "shared_experts.up_proj.weight"),
    ("shared_mlp.down_proj.weight", "shared_experts.down_proj.weight"),
    ("experts.e_score_correction_bias", "gate.e_score_correction_bias"),
    ("shared_expert.gate_proj.weight", "shared_experts.gate_proj.weight"),
    ("shared_expert.up_proj.weight", "shared_experts.up_proj.weight"),
    ("shared_expert.down_proj.weight", "shared_experts.down_proj.weight"),
)
# Experts stored one by one, experts.{e}.<gate>.weight (n, d), <up> (n, d), <down> (d, n): fused
# as transformers does into gate_up_proj (E, 2n, d), gate rows first, and down_proj (E, d, n);
# experts without a gate (NemotronH's) stacked into up_proj (E, n, d) and down_proj (E, d, n).
_HUB_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
_HUB_UP_EXPERT_NAMES = (("up_proj", "down_proj"),)
# Parts of a block that a Hub checkpoint holds beside it, under its decoder layer: (Hub name
# relative to the decoder layer, in-memory name relative to the block). Kolibri-1's selection bias.
_HUB_LAYER_PARTS = {"kolibri1": (("moe.router.expert_bias", "gate.e_score_correction_bias"),)}
# Step-3.5/3.7's Hub layout holds the block's parts as its decoder layer's: (Hub name relative to
# the decoder layer, in-memory name relative to the block); its experts' halves moe.gate_proj and
# moe.up_proj (E, n, d) are concatenated into experts.gate_up_proj (E, 2n, d), gate first.
_HUB_LAYER_NAMES = {"step3p5": (
    ("moe.gate.weight", "gate.weight"),
    ("moe.router_bias", "gate.e_score_correction_bias"),
    ("moe.down_proj.weight", "experts.down_proj"),
    ("share_expert.gate_proj.weight", "shared_experts.gate_proj.weight"),
    ("share_expert.up_proj.weight", "shared_experts.up_proj.weight"),
    ("share_expert.down_proj.weight", "shared_experts.down_proj.weight"))}
_HUB_LAYER_GATE_UP = ("moe.gate_proj.weight", "moe.up_proj.weight")


def _from_hub_layer(mine: list[str], get: Callable[[str], Any], fam: Family,
                    want: set[str]) -> tuple[dict[str, Any], list[str]]:
  """The in-memory block of a decoder layer's Hub keys `mine` (Step-3.5/3.7's layout), and the
  keys under its parts' modules that it does not read."""
  present = set(mine)
  out = {memory: get(hub) for hub, memory in _HUB_LAYER_NAMES[fam.model_type]
         if hub in present and memory in want}
  if all(k in present for k in _HUB_LAYER_GATE_UP):
    out[fam.experts_prefix + "gate_up_proj"] = np.concatenate(
        [np.asarray(get(k)) for k in _HUB_LAYER_GATE_UP], axis=1)
  read = {hub for hub, _ in _HUB_LAYER_NAMES[fam.model_type]} | set(_HUB_LAYER_GATE_UP)
  modules = tuple({hub.split(".")[0] + "." for hub in read})
  return out, sorted(k for k in mine if k.startswith(modules) and k not in read)


def _from_hub(keys: list[str], get: Callable[[str], Any], fam: Family, want: set[str],
              num_experts: int | None) -> tuple[dict[str, Any], set[str]]:
  """The in-memory entries that a Hub checkpoint's block keys `keys` (relative to the block)
  stand for, and the keys they were made from; get(key) reads a value. num_experts: the config's
  E for the layer, which experts stored one by one must number (None: not checked)."""
  out, used = {}, set()
  present = set(keys)
  module = fam.experts_prefix[:-len("experts.")] if fam.experts_prefix.endswith(
      "experts.") else ""
  for hub, mine in _HUB_RENAMES:
    if module + mine in want and module + mine not in present and module + hub in present:
      out[module + mine] = get(module + hub)
      used.add(module + hub)
  if fam.shared is not None and fam.shared_kind == "gate_up":  # MiniMax-M3's shared expert
    fused_shared = fam.shared + "gate_up_proj.weight"
    halves = [fam.shared + f"{name}.weight" for name in ("gate_proj", "up_proj")]
    if fused_shared not in present and all(k in present for k in halves):
      out[fused_shared] = np.concatenate([np.asarray(get(k)) for k in halves], axis=0)
      used.update(halves)
  p = fam.experts_prefix
  fused = _expert_keys(fam)
  if fam.experts not in ("fused", "up") or any(k in present for k in fused):
    return out, used
  for names in _HUB_UP_EXPERT_NAMES if fam.experts == "up" else _HUB_EXPERT_NAMES:
    per = {name: {} for name in names}
    for k in keys:
      parts = k[len(p):].split(".") if k.startswith(p) else ()
      if len(parts) == 3 and parts[0].isdigit() and parts[1] in per and parts[2] == "weight":
        per[parts[1]][int(parts[0])] = k
    if not any(per.values()):
      continue
    count = max(max(found, default=-1) for found in per.values()) + 1
    if num_experts is not None and count < num_experts:
      count = num_experts  # the missing ones named below: a shard of the checkpoint left out?
    elif num_experts is not None and count > num_experts:
      raise ValueError(f"{fam.model_type} block: experts stored one by one number {count}, the "
                       f"config's E is {num_experts}")
    missing = sorted(f"{p}{e}.{name}.weight" for name in names for e in range(count)
                     if e not in per[name])
    if missing:
      raise ValueError(f"{fam.model_type} block: experts stored one by one lack "
                       f"{missing[:6]}{' ...' if len(missing) > 6 else ''} (a checkpoint in "
                       f"several files: read them all)")
    arrays = [[np.asarray(get(per[name][e])) for e in range(count)] for name in names]
    for name, found in zip(names, arrays):
      _check_experts_agree(fam.model_type, [per[name][e] for e in range(count)], found)
    if len(names) == 2:  # no gate: up and down as they are
      out[fused[0]], out[fused[1]] = (np.stack(found) for found in arrays)
    else:
      gate, up, down = arrays
      if gate[0].shape[1:] != up[0].shape[1:]:
        raise ValueError(f"{fam.model_type} block: {per[names[0]][0]} {gate[0].shape} and "
                         f"{per[names[1]][0]} {up[0].shape} differ in their input width")
      out[fused[0]] = np.stack([np.concatenate([g, u], axis=0) for g, u in zip(gate, up)])
      out[fused[1]] = np.stack(down)
    used.update(k for found in per.values() for k in found.values())
    break
  return out, used


def _check_experts_agree(model_type, keys, arrays):
  """Refuses, by key, the experts stored one by one whose tensor's shape is not the others' (a
  transposed or truncated tensor) before they are stacked."""
  shapes = [a.shape for a in arrays]
  if len(set(shapes)) == 1:
    return
  common = max(sorted(set(shapes)), key=shapes.count)
  if 2 * shapes.count(common) > len(shapes):  # the odd ones, against the most experts' shape
    odd = [f"{k} {shape}" for k, shape in zip(keys, shapes) if shape != common]
    raise ValueError(f"{model_type} block: experts stored one by one differ in shape: "
                     f"{_few(odd)}, the others' is {common}")
  raise ValueError(f"{model_type} block: experts stored one by one differ in shape: "
                   f"{_few([f'{k} {shape}' for k, shape in zip(keys, shapes)])}")


def block_state_dict(config: Mapping[str, Any], state_dict: Mapping[str, Any], *,
                     layer: int) -> dict[str, Any]:
  """Decoder layer `layer`'s MoE block out of a whole model's state dict: the entries under the
  family's prefix ("model.layers.{layer}.mlp." and the like; or, for a family with a
  `multimodal_prefix`, its multimodal model's), the prefix removed. The family's keys only
  (Granite's prefix is the whole decoder layer), DeepSeek-V4's hash table gate.tid2eid among them
  where the layer has one.

  The state dict is transformers' in-memory one (a model's `state_dict()`) or a Hub checkpoint's
  (what `save_pretrained` writes: its files' tensors, e.g. by `safetensors.flax.load_file`, which
  reads bfloat16, where safetensors.numpy does not), which this converts as transformers does
  when it loads one: experts stored one by one
  (`experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`, or Mixtral's `w1`, `w3`, `w2`) are
  stacked into the fused tensors, and the modules and tensors some families name otherwise are
  read under their in-memory names (Mixtral's, MiniMax's and Kimi-Linear's `block_sparse_moe`,
  DeepSeek-V4's `ffn` and its shared experts' `w1`-`w3`, Granite's `input_linear`,
  `output_linear` and `router.layer`, Aria's `fc1` and `fc2`, selection biases outside `gate`,
  MiniMax-M3's shared expert's `gate_proj` and `up_proj`, Hy3's `router.gate` and `shared_mlp`,
  Laguna's `shared_expert`, Step-3.5/3.7's decoder-layer `moe.*` and `share_expert.*`,
  Kolibri-1's decoder-layer `moe.router.expert_bias`, Mistral Large 4's block held by the decoder
  layer, its experts' and shared experts' `w1`-`w3`; NemotronH's experts
  `experts.{e}.up_proj.weight` and `down_proj` are stacked into `up_proj` and `down_proj`). Only
  the layer's values are read (any Mapping, a lazy one too). A ValueError names keys under the
  block's modules that are not read (quantization scales, say), an index outside the config's
  layers, and why a layer has no MoE block (a dense layer).
  The decoder layers are looked for under the family's prefixes, then under the roots released
  checkpoints use ("model.layers.{i}." for Step-3.7 and DeepSeek-OCR-2,
  "language_model.model.layers.{i}." for MiniMax-M3-VL and Kimi-K2.5, "layers.{i}." for
  DeepSeek-V4 and Mistral Large 4, "backbone.layers.{i}." for NemotronH), the first with the
  block's keys taken."""
  if not _names_a_model(config) and _names_a_model(state_dict):
    raise TypeError("block_state_dict takes (config, state_dict, layer=...): the config came "
                    "second")
  config = _text_config(config)
  fam = family(config)
  _check_layer_type(layer)  # required here: _check_layer lets None through
  _check_layer(config, layer)
  try:
    num_experts = int(layer_kwargs(config, layer=layer)["num_experts"])
  except ValueError:  # a dense layer: said below, where no block is found
    num_experts = None
  want = set(_expert_keys(fam) + (fam.router, fam.selection_bias, fam.shared_gate, fam.lookup)
             + tuple(getattr(fam, name) for name in _AS_THEY_ARE) + _shared_keys(fam)) - {None}
  own = [p.format(layer=layer) for p in (fam.prefix, fam.multimodal_prefix) if p]
  rooted = _rooted(own)
  hub_modules = _HUB_MODULES + ((".",) if fam.model_type in _HUB_IN_LAYER else ())
  prefixes = rooted + [p.replace(".mlp.", hub) for p in rooted if p.endswith(".mlp.")
                       for hub in hub_modules]
  # The block's modules (experts., gate., shared_expert., ...): a key under one of them that is
  # not read (a quantized checkpoint's scales) is refused, not dropped.
  modules = tuple({k.split(".")[0] + "." for k in want})
  names = list(state_dict.keys())
  for prefix in prefixes:
    mine = [k[len(prefix):] for k in names if k.startswith(prefix)]
    get = lambda k, prefix=prefix: state_dict[prefix + k]
    out = {k: get(k) for k in mine if k in want}
    hub, used = _from_hub(mine, get, fam, want, num_experts)
    out.update(hub)
    if out and prefix.endswith(".mlp.") and fam.model_type in _HUB_LAYER_PARTS:
      beside = prefix[:-len("mlp.")]
      out.update({memory: state_dict[beside + hub_name] for hub_name, memory in
                  _HUB_LAYER_PARTS[fam.model_type]
                  if memory in want and memory not in out and beside + hub_name in state_dict})
    if out:
      unread = sorted(k for k in mine if k not in want and k not in used
                      and k.startswith(modules))
      if unread:
        raise ValueError(
            f"{fam.model_type} block under {prefix!r}: keys not read {unread[:6]}"
            f"{' ...' if len(unread) > 6 else ''} (read: {sorted(out)}): a quantized "
            f"checkpoint (its scales) is dequantized by loading the model with transformers, "
            f"then taking its state_dict()")
      return out
  for prefix in (p[:-len("mlp.")] for p in rooted
                 if p.endswith(".mlp.") and fam.model_type in _HUB_LAYER_NAMES):
    mine = [k[len(prefix):] for k in names if k.startswith(prefix)]
    out, unread = _from_hub_layer(mine, lambda k, prefix=prefix: state_dict[prefix + k], fam,
                                  want)
    if out:
      if unread:
        raise ValueError(f"{fam.model_type} decoder layer under {prefix!r}: keys not read "
                         f"{unread[:6]}{' ...' if len(unread) > 6 else ''}")
      return out
  dense = _dense_reason(config, fam, layer)
  raise ValueError(f"no {fam.model_type} MoE block under {' or '.join(map(repr, own))} (or a Hub "
                   f"checkpoint's root or name for it: {_few(rooted, 4)}) in the state dict"
                   + (f": decoder layer {layer} is a dense one ({dense})" if dense else ""))


# --- the nnx layer -------------------------------------------------------------------------------

def _variable(tree, name):
  if isinstance(tree, Mapping):
    return tree[name] if name in tree else None
  return getattr(tree, name, None)


def layer_params(module, gate_up_layout: str | None = None) -> LayerParams:
  """The parameter arrays of `module`, an `MoE` layer, or of an `nnx.State` with its names
  (gradients from `nnx.grad`, say), as NumPy arrays; parts the layer lacks are left out. Their
  gate/up layout is the layer's; a State does not say it: pass its layer's
  (`layer.gate_up_layout`), which `hf_state_from_layer` needs. (Elsewhere in this module `layer`
  is a decoder layer's index.)"""
  own = getattr(module, "gate_up_layout", None)
  if gate_up_layout is not None and own is not None and gate_up_layout != own:
    raise ValueError(f"gate_up_layout={gate_up_layout!r}, but the layer's is {own!r}")
  out = LayerParams(gate_up_layout=own if own is not None else gate_up_layout)
  for name in PARAM_NAMES:
    v = _variable(module, name)
    if v is None:
      continue
    value = v[...] if hasattr(v, "__getitem__") and not isinstance(v, np.ndarray) else v
    out[name] = np.asarray(value)
  return out


def load_into_layer(module, params: Mapping[str, Any], *,
                    gate_up_layout: str | None = None) -> None:
  """Sets the variables of `module`, an `MoE` layer, to `params` (from `layer_params_from_hf`), each
  cast to the variable's dtype (the selection bias stays float32) and placed as the variable is
  (a sharded layer stays sharded). gate_up_layout: the layout of params' w1 and b1 columns where
  params do not carry one (a plain dict), required then for a GLU layer. Raises a ValueError for
  a name the layer lacks, a shape that differs, a part of the layer that `params` does not set,
  or params of another gate/up layout than a GLU layer's."""
  present = {n for n in PARAM_NAMES if _variable(module, n) is not None}
  unknown = sorted(set(params) - present)
  unset = sorted(present - set(params))
  if unknown or unset:
    raise ValueError(f"params and the layer differ: the layer has no {unknown}; params do not "
                     f"set {unset}")
  values = {name: np.asarray(value) for name, value in params.items()}
  olds = {name: _variable(module, name)[...] for name in values}
  for name, value in values.items():
    if tuple(value.shape) != tuple(olds[name].shape):
      raise ValueError(f"{name}: the layer's shape is {tuple(olds[name].shape)}, params give "
                       f"{tuple(value.shape)}")
  known = getattr(params, "gate_up_layout", None)
  if gate_up_layout is not None and known is not None and gate_up_layout != known:
    raise ValueError(f"gate_up_layout={gate_up_layout!r}, but params hold the {known!r} layout")
  known = known if known is not None else gate_up_layout
  if acts.get_activation(module.activation).is_glu:
    if known is None:
      raise ValueError(f"params do not say their gate/up layout (a plain mapping): pass "
                       f"gate_up_layout= (the layer takes {module.gate_up_layout!r}), or "
                       f"layer_params_from_hf's result")
    if known != module.gate_up_layout:
      raise ValueError(f"params hold w1 in the {known!r} gate/up layout, the layer takes "
                       f"{module.gate_up_layout!r}: layer_params_from_hf(..., gate_up_layout="
                       f"{module.gate_up_layout!r})")
  for name, value in values.items():
    # Placed as the old value is: an assignment into a variable sharded on an explicit mesh
    # would run a program on one device.
    _variable(module, name).set_value(jax.device_put(value.astype(olds[name].dtype),
                                                     olds[name].sharding))


def moe_layer(config: Mapping[str, Any], state_dict: Mapping[str, Any] | None = None, *,
              gate_up_layout: str | None = None, bias_update_rate: float = 1e-3,
              layer: int | None = None, rngs=None, **overrides):
  """A `sonic_jax.layers.MoE` for the family's block (`layer_kwargs`), with the block's weights
  loaded when `state_dict` is given. overrides: further `MoE` arguments (param_dtype, dtype,
  backend, load_balance_coef, ...); the parameters are the layer's `param_dtype` (float32 by
  default) whatever the state dict's dtype: pass param_dtype=jnp.bfloat16 to keep a bfloat16
  checkpoint's memory; the auxiliary losses' coefficients are the layer's defaults,
  not the config's (router_aux_loss_coef and the like, whose loss formulas differ by family), so
  a fine-tuning run passes its own. gate_up_layout, bias_update_rate, layer: as `layer_kwargs`
  (layer also sets the keys the block's state dict holds: `layer_params_from_hf`). state_dict: the
  block's, keys relative to it (`block_state_dict` takes it out of a whole model's). rngs: default
  `nnx.Rngs(0)` (the initial values are overwritten when a state dict is given)."""
  from flax import nnx
  from sonic_jax.layers import MoE
  kw = layer_kwargs(config, gate_up_layout=gate_up_layout, bias_update_rate=bias_update_rate,
                    layer=layer)
  kw.update(overrides)
  m = MoE(**kw, rngs=rngs if rngs is not None else nnx.Rngs(0))
  if state_dict is not None:
    load_into_layer(m, layer_params_from_hf(config, state_dict,
                                            gate_up_layout=kw["gate_up_layout"], layer=layer))
  return m
