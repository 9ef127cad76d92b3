"""Reference values of Hugging Face transformers' own MoE blocks, for `tests/test_families.py`.

Runs under an interpreter that has torch and transformers (and needs no JAX):

    python tests/hf_reference.py --out DIR [--size cpu|gpu] [--seed S] [CASE ...]

writes DIR/<case>.npz for each case (default: all of `CASES`); at size "gpu" its floats are float32,
compressed (the bfloat16 comparison needs no more, and the files are small enough to copy). `test_families.py` imports this
module in-process where torch and transformers import, and runs it as a script otherwise.

Each case builds its family's MoE block from transformers with a tiny random config, in float64 and
eval mode ("eager" experts), gives every parameter and buffer random values (float32-representable:
several routers compute in float32, and exact inputs keep that from adding rounding of its own),
random router weights large enough that the routing matters, nonzero biases, a small random
selection bias (e_score_correction_bias and the like), runs it on a random input (B, S, d) and
backpropagates a random output cotangent with torch autograd. The .npz holds:

  config_json        the config, `config.to_json_string(use_diff=False)`
  model_type         the config's model_type
  param/<key>        the block's state dict, keys exactly as `block.state_dict()`
  hub/<key>          the same block as decoder layer 0 of a Hub checkpoint (`hub_checkpoint`)
  input, cotangent   x (B, S, d) and dL/dy
  output             y (B, S, d)
  grad_input         dL/dx
  grad/<key>         dL/dp for every parameter that has a gradient
  router_logits      (T, E) the router's logits (a forward hook on the router module)
  expert_ids         (T, K) a hash-routed layer's fixed selection, tid2eid[input_ids] (DeepSeek-V4;
                     its random token ids are the case's), for the layer's expert_ids
  lb_loss, lb_loss_masked, lb_mask
                     transformers' `load_balancing_loss_func` over two "layers" (the logits and
                     half of them), without and with an attention mask `lb_mask` (B, S)

Nothing at module level imports torch: `CASES` is plain data.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
  """One block to run: class `block` of transformers.models.`module`, built from the config class
  of `model_type` with the sizes of `SIZES` and `overrides`.

  router: the attribute path of the module whose forward gives the router logits, at output
    index `logits_index` (None: the output is the logits).
  fields: the config's names for (d, E, n, K). overrides: (field, value) pairs, a value "2n" meaning
  twice n; gpu_overrides: replace them at size "gpu" where given.
  """

  model_type: str
  module: str
  block: str
  router: str
  logits_index: int | None = 0
  fields: tuple[str, str, str, str] = ("hidden_size", "num_local_experts", "intermediate_size",
                                       "num_experts_per_tok")
  overrides: tuple[tuple[str, object], ...] = ()
  top_k: int = 2
  gpu_overrides: tuple[tuple[str, object], ...] | None = None  # in place of overrides at "gpu"


_ATTN = (("num_attention_heads", 4), ("num_key_value_heads", 2), ("num_hidden_layers", 1))
_QWEN_FIELDS = ("hidden_size", "num_experts", "moe_intermediate_size", "num_experts_per_tok")
_V3_FIELDS = ("hidden_size", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
# DeepSeek-V3's router with groups, and with one group (GLM-4.5)
_V3 = (("n_shared_experts", 1), ("n_group", 4), ("topk_group", 2), ("norm_topk_prob", True),
       ("routed_scaling_factor", 2.5))
# DeepSeek-V2's group-limited router: one group of 4 kept, K = 2 from it (with K <= topk_group a
# max-scored group limit never changes the top-K)
_V2 = (("n_shared_experts", 2), ("topk_method", "group_limited_greedy"), ("n_group", 2),
       ("topk_group", 1), ("routed_scaling_factor", 1.5))
# DeepSeek-V3's under Kimi-Linear's field names
_KIMI_FIELDS = ("hidden_size", "num_experts", "moe_intermediate_size", "num_experts_per_token")
_KIMI = (("num_shared_experts", 1), ("num_expert_group", 4), ("topk_group", 2),
         ("moe_renormalize", True), ("routed_scaling_factor", 2.5))
_GLM = (("n_shared_experts", 1), ("n_group", 1), ("topk_group", 1), ("norm_topk_prob", True),
        ("routed_scaling_factor", 2.5))

# A family whose block computes what another family's does takes that family's overrides (under
# its own field names): its layer is then the same program, compiled once in a test run.
_V4_FIELDS = ("hidden_size", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
_V4_GPU = (("routed_scaling_factor", 1.5), ("vocab_size", 64), ("num_key_value_heads", 1),
           ("head_dim", 8), ("q_lora_rank", 16), ("o_lora_rank", 16))
_V4 = _V4_GPU + (("swiglu_limit", 1.25),)

CASES: dict[str, Case] = {
    "mixtral": Case("mixtral", "mixtral", "MixtralSparseMoeBlock", "gate"),
    "minimax": Case("minimax", "minimax", "MiniMaxSparseMoeBlock", "gate"),
    "qwen2_moe": Case("qwen2_moe", "qwen2_moe", "Qwen2MoeSparseMoeBlock", "gate",
                      fields=_QWEN_FIELDS,
                      overrides=(("shared_expert_intermediate_size", "2n"),
                                 ("norm_topk_prob", False))),
    "qwen3_moe": Case("qwen3_moe", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate",
                      fields=_QWEN_FIELDS, overrides=(("norm_topk_prob", True),)),
    "qwen3_next": Case("qwen3_next", "qwen3_next", "Qwen3NextSparseMoeBlock", "gate",
                       fields=_QWEN_FIELDS,
                       overrides=(("shared_expert_intermediate_size", "n"),
                                  ("norm_topk_prob", True))),
    # Qwen3-Next's block, always renormalised
    "qwen3_5_moe_text": Case("qwen3_5_moe_text", "qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock", "gate",
                             fields=_QWEN_FIELDS,
                             overrides=(("shared_expert_intermediate_size", "n"),)),
    # Qwen3-MoE's block, always renormalised
    "qwen3_vl_moe_text": Case("qwen3_vl_moe_text", "qwen3_vl_moe", "Qwen3VLMoeTextSparseMoeBlock",
                              "gate", fields=_QWEN_FIELDS),
    "qwen3_omni_moe_text": Case("qwen3_omni_moe_text", "qwen3_omni_moe",
                                "Qwen3OmniMoeThinkerTextSparseMoeBlock", "gate",
                                fields=_QWEN_FIELDS, overrides=(("norm_topk_prob", True),)),
    "qwen3_omni_moe_talker_text": Case("qwen3_omni_moe_talker_text", "qwen3_omni_moe",
                                       "Qwen3OmniMoeTalkerTextSparseMoeBlock", "gate",
                                       fields=_QWEN_FIELDS,
                                       overrides=(("shared_expert_intermediate_size", "2n"),
                                                  ("norm_topk_prob", False))),
    # Qwen3-Next's block
    "qwen4_exp_text": Case("qwen4_exp_text", "qwen4_exp", "Qwen4ExpTextSparseMoeBlock", "gate",
                           fields=_QWEN_FIELDS,
                           overrides=(("shared_expert_intermediate_size", "n"),
                                      ("norm_topk_prob", True))),
    # Granite-with-shared's program (Router("softmax"), an ungated shared MLP of width 2n)
    "lara_mini": Case("lara_mini", "lara_mini", "LaraMiniSparseMoeBlock", "gate",
                      fields=_QWEN_FIELDS,
                      overrides=(("shared_expert_intermediate_size", "2n"),
                                 ("norm_topk_prob", True))),
    # Qwen3-MoE's block
    "mellum": Case("mellum", "mellum", "MellumSparseMoeBlock", "gate", fields=_QWEN_FIELDS,
                   overrides=(("norm_topk_prob", True),)),
    "flint": Case("flint", "flint", "FlintSparseMoeBlock", "gate", fields=_QWEN_FIELDS,
                  overrides=(("shared_expert_intermediate_size", "2n"),
                             ("norm_topk_prob", True))),
    # Step-3.7's program (sigmoid, the bias, renormalised without an epsilon, times 2.5)
    "laguna": Case("laguna", "laguna", "LagunaSparseMoeBlock", "gate", fields=_QWEN_FIELDS,
                   overrides=(("shared_expert_intermediate_size", "n"),
                              ("moe_routed_scaling_factor", 2.5))),
    "olmoe": Case("olmoe", "olmoe", "OlmoeSparseMoeBlock", "gate",
                  fields=("hidden_size", "num_experts", "intermediate_size",
                          "num_experts_per_tok")),
    "flex_olmo": Case("flex_olmo", "flex_olmo", "FlexOlmoSparseMoeBlock", "gate",
                      fields=("hidden_size", "num_experts", "intermediate_size",
                              "num_experts_per_tok")),
    "jamba": Case("jamba", "jamba", "JambaSparseMoeBlock", "router",
                  fields=("hidden_size", "num_experts", "intermediate_size",
                          "num_experts_per_tok")),
    "deepseek_v2": Case("deepseek_v2", "deepseek_v2", "DeepseekV2Moe", "gate", fields=_V3_FIELDS,
                        overrides=_V2),
    "deepseek_v3": Case("deepseek_v3", "deepseek_v3", "DeepseekV3MoE", "gate",
                        fields=_V3_FIELDS, overrides=_V3),
    "deepseek_v32": Case("deepseek_v32", "deepseek_v32", "DeepseekV32MoE", "gate",
                         fields=_V3_FIELDS, overrides=_V3),
    "sarvam_mla": Case("sarvam_mla", "deepseek_v3", "DeepseekV3MoE", "gate", fields=_V3_FIELDS,
                       overrides=_V3),
    "kimi_linear": Case("kimi_linear", "kimi_linear", "KimiLinearMoE", "gate",
                        fields=_KIMI_FIELDS, overrides=_KIMI),
    "glm4_moe": Case("glm4_moe", "glm4_moe", "Glm4MoeMoE", "gate", fields=_V3_FIELDS,
                     overrides=_GLM),
    "glm4_moe_lite": Case("glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLiteMoE", "gate",
                          fields=_V3_FIELDS, overrides=_GLM),
    # GLM-4.5's router, clamped SwiGLU experts: a limit that the random pre-activations cross on
    # the CPU, its own (10) on the GPU (see gpt-oss); its attention wants as many kv heads as heads
    "glm5_next_text": Case("glm5_next_text", "glm5_next", "Glm5NextTextMoE", "gate",
                           fields=_V3_FIELDS,
                           overrides=_GLM + (("num_key_value_heads", 4), ("swiglu_limit", 1.25)),
                           gpu_overrides=_GLM + (("num_key_value_heads", 4),)),
    "glm_moe_dsa": Case("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaMoE", "gate", fields=_V3_FIELDS,
                        overrides=_GLM),
    "glm4v_moe_text": Case("glm4v_moe_text", "glm4v_moe", "Glm4vMoeTextMoE", "gate",
                           fields=_V3_FIELDS, overrides=_GLM),
    # DeepSeek-V2's block (no norm_topk_prob)
    "deepseek_ocr2_text": Case("deepseek_ocr2_text", "deepseek_ocr2", "DeepseekOcr2TextMoe", "gate",
                               fields=_V3_FIELDS, overrides=_V2),
    # DeepSeek-OCR-2's block (its one decoder layer an MoE one: the class default makes it dense)
    "unlimited_ocr_text": Case("unlimited_ocr_text", "unlimited_ocr", "UnlimitedOcrTextMoe", "gate",
                               fields=_V3_FIELDS,
                               overrides=_V2 + (("mlp_layer_types", ["sparse"]),)),
    "sarvam_moe": Case("sarvam_moe", "glm4_moe", "Glm4MoeMoE", "gate", fields=_V3_FIELDS,
                       overrides=_GLM),
    # GLM-4.5's router (one group, renormalised) with its own field names
    "afmoe": Case("afmoe", "afmoe", "AfmoeSparseMoeBlock", "router", fields=_QWEN_FIELDS,
                  overrides=(("num_shared_experts", 1), ("route_scale", 2.5))),
    # DeepSeek-V3's router, no shared expert
    "mimo_v2_flash": Case("mimo_v2_flash", "mimo_v2_flash", "MiMoV2FlashMoE", "gate",
                          fields=_V3_FIELDS,
                          overrides=(("n_group", 4), ("topk_group", 2), ("norm_topk_prob", True),
                                     ("routed_scaling_factor", 2.5))),
    # mimo_v2_flash's program: DeepSeek-V3's router, no shared expert (the factor on the output)
    "beam": Case("beam", "beam", "BeamMoE", "gate", fields=_QWEN_FIELDS,
                 overrides=(("n_group", 4), ("topk_group", 2), ("norm_topk_prob", True),
                            ("routed_scaling_factor", 2.5))),
    # DeepSeek-V3's router; ReLU-squared experts and shared expert without a gate
    # (on a GPU its ungated experts 2n wide: the kernels take widths in multiples of 256)
    "nemotron_h": Case("nemotron_h", "nemotron_h", "NemotronHMoE", "gate", fields=_V3_FIELDS,
                       overrides=_V3 + (("moe_shared_expert_intermediate_size", "2n"),
                                        ("layers_block_type", ["moe"])),
                       gpu_overrides=_V3 + (("moe_intermediate_size", "2n"),
                                            ("moe_shared_expert_intermediate_size", "2n"),
                                            ("layers_block_type", ["moe"]))),
    # top-K of the logits plus the selection bias, sigmoid weights renormalised
    "kolibri1": Case("kolibri1", "kolibri1", "Kolibri1SparseMoeBlock", "gate",
                     fields=_QWEN_FIELDS,
                     overrides=(("shared_expert_intermediate_size", "2n"),
                                ("norm_topk_prob", True))),
    "step3p5": Case("step3p5", "step3p7", "Step3p7SparseMoeBlock", "gate", fields=_V3_FIELDS,
                    overrides=(("share_expert_dim", "n"), ("moe_router_scaling_factor", 2.5))),
    # Kimi-Linear's block and field names
    "bailing_hybrid": Case("bailing_hybrid", "bailing_hybrid", "BailingHybridMoE", "gate",
                           fields=_KIMI_FIELDS, overrides=_KIMI),
    # DeepSeek-V3's overrides on a softmax router (top2_sum groups, renormalised + 1e-20)
    "mistral4": Case("mistral4", "mistral4", "Mistral4MoE", "gate", fields=_V3_FIELDS,
                     overrides=_V3),
    # Mistral 4's (its config has no norm_topk_prob: always renormalised)
    "mistral_large4_text": Case("mistral_large4_text", "mistral_large4", "MistralLarge4TextMoE",
                                "gate", fields=_V3_FIELDS,
                                overrides=tuple(o for o in _V3 if o[0] != "norm_topk_prob")),
    # DeepSeek-V3's
    "axk2": Case("axk2", "axk2", "AXK2MoE", "gate", fields=_V3_FIELDS, overrides=_V3),
    "solar_open": Case("solar_open", "solar_open", "SolarOpenMoE", "gate", fields=_V3_FIELDS,
                       overrides=_GLM),
    "dots1": Case("dots1", "dots1", "Dots1MoE", "gate", fields=_V3_FIELDS,
                  overrides=(("n_shared_experts", 2), ("n_group", 1), ("topk_group", 1),
                             ("norm_topk_prob", False), ("routed_scaling_factor", 2.5))),
    # dots.llm1's (two shared experts, not renormalised) under EXAONE-MoE's field names
    "exaone_moe": Case("exaone_moe", "exaone_moe", "ExaoneMoeSparseMoEBlock", "gate",
                       fields=_QWEN_FIELDS,
                       overrides=(("num_shared_experts", 2), ("n_group", 1), ("topk_group", 1),
                                  ("norm_topk_prob", False), ("routed_scaling_factor", 2.5))),
    "minimax_m2": Case("minimax_m2", "minimax_m2", "MiniMaxM2SparseMoeBlock", "gate"),
    # a clamp limit that the random pre-activations cross on the CPU, the default on the GPU
    "minimax_m3_vl_text": Case("minimax_m3_vl_text", "minimax_m3_vl", "MiniMaxM3VLSparseMoeBlock",
                               "gate", overrides=(("shared_intermediate_size", "2n"),
                                                  ("routed_scaling_factor", 1.5),
                                                  ("swiglu_limit", 1.25)),
                               gpu_overrides=(("shared_intermediate_size", "2n"),
                                              ("routed_scaling_factor", 1.5))),
    # Granite-with-shared's program (Router("softmax"), a shared MLP of width 2n)
    "aria_text": Case("aria_text", "aria", "AriaTextMoELayer", "router",
                      fields=("hidden_size", "moe_num_experts", "intermediate_size", "moe_topk"),
                      overrides=(("moe_num_shared_experts", 2),)),
    # dots.llm1's program: its shared width 2n, one expert of shared_experts_intermediate_size
    "dots3_note_text": Case("dots3_note_text", "dots3_note", "Dots3NoteTextMoE", "gate",
                            fields=_V3_FIELDS,
                            overrides=(("n_shared_experts", 1),
                                       ("shared_experts_intermediate_size", "2n"), ("n_group", 1),
                                       ("topk_group", 1), ("norm_topk_prob", False),
                                       ("routed_scaling_factor", 2.5),
                                       ("num_key_value_heads", 4))),
    "granitemoe_swa": Case("granitemoe_swa", "granitemoe_swa", "GraniteMoeSWAMoE",
                           "block_sparse_moe.router",
                           overrides=(("shared_intermediate_size", "2n"),)),
    # (its config's Mamba heads must divide 2d)
    "granitemoehybrid": Case("granitemoehybrid", "granitemoehybrid", "GraniteMoeHybridMoE",
                             "block_sparse_moe.router",
                             overrides=(("shared_intermediate_size", "2n"), ("mamba_n_heads", 8))),
    # gpt-oss's program in the concat layout (its other-layout test), its limit likewise
    "openai_privacy_filter": Case("openai_privacy_filter", "openai_privacy_filter",
                                  "OpenAIPrivacyFilterMLP", "router",
                                  overrides=(("swiglu_limit", 1.25),), gpu_overrides=()),
    "ernie4_5_moe": Case("ernie4_5_moe", "ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", "gate",
                         fields=("hidden_size", "moe_num_experts", "moe_intermediate_size",
                                 "moe_k"),
                         overrides=(("moe_num_shared_experts", 2), ("use_bias", False))),
    "lfm2_moe": Case("lfm2_moe", "lfm2_moe", "Lfm2MoeSparseMoeBlock", "gate",
                     fields=_QWEN_FIELDS,
                     overrides=(("use_expert_bias", True), ("norm_topk_prob", True),
                                ("routed_scaling_factor", 1.5))),
    "hunyuan_v1_moe": Case("hunyuan_v1_moe", "hunyuan_v1_moe", "HunYuanMoEV1Moe", "gate",
                           fields=("hidden_size", "num_experts", "intermediate_size", "moe_topk")),
    # AFMoE's program (its router, one shared expert) under Hy3's field names; its one decoder
    # layer an MoE one (the class makes the first dense)
    "hy_v3": Case("hy_v3", "hy_v3", "HYV3MoE", "gate", fields=_QWEN_FIELDS,
                  overrides=(("num_shared_experts", 1), ("router_scaling_factor", 2.5),
                             ("mlp_layer_types", ["sparse"]))),
    "gpt_oss": Case("gpt_oss", "gpt_oss", "GptOssMLP", "router",
                    # a limit that the random pre-activations cross, so the clamps matter; on the
                    # GPU gpt-oss's own (7): bfloat16 rounding moves values across a clamp, whose
                    # gradient jumps there (6e-2 relative at 1.25 on XLA's bfloat16)
                    overrides=(("swiglu_limit", 1.25),), gpu_overrides=()),
    "llama4_text": Case("llama4_text", "llama4", "Llama4TextMoe", "router", logits_index=1,
                        overrides=(("intermediate_size_mlp", "4n"),), top_k=1),
    # a top-K layer and a hash-routed one (the block's input_ids: make_block); a clamp limit that
    # the random pre-activations cross on the CPU, DeepSeek-V4's own (10) on the GPU (see gpt-oss)
    "deepseek_v4": Case("deepseek_v4", "deepseek_v4", "DeepseekV4SparseMoeBlock", "gate",
                        fields=_V4_FIELDS, overrides=_V4 + (("mlp_layer_types", ["moe"]),),
                        gpu_overrides=_V4_GPU + (("mlp_layer_types", ["moe"]),)),
    "deepseek_v4_hash": Case("deepseek_v4", "deepseek_v4", "DeepseekV4SparseMoeBlock", "gate",
                             fields=_V4_FIELDS,
                             overrides=_V4 + (("mlp_layer_types", ["hash_moe"]),),
                             gpu_overrides=_V4_GPU + (("mlp_layer_types", ["hash_moe"]),)),
    # the decoder layer's router and experts (no block class of their own): make_block
    "gemma4_text": Case("gemma4_text", "gemma4", "Gemma4TextExperts", "router.proj",
                        logits_index=None,
                        fields=("hidden_size", "num_experts", "moe_intermediate_size",
                                "top_k_experts"),
                        overrides=(("enable_moe_block", True),)),
    # Gemma 4's, in every decoder layer
    "diffusion_gemma_text": Case("diffusion_gemma_text", "diffusion_gemma",
                                 "DiffusionGemmaTextExperts", "router.proj", logits_index=None,
                                 fields=("hidden_size", "num_experts", "moe_intermediate_size",
                                         "top_k_experts")),
    "granitemoe": Case("granitemoe", "granitemoe", "GraniteMoeMoE", "router"),
    "granitemoeshared": Case("granitemoeshared", "granitemoeshared", "GraniteMoeSharedMoE",
                             "block_sparse_moe.router",
                             overrides=(("shared_intermediate_size", "2n"),)),
    "dbrx": Case("dbrx", "dbrx", "DbrxFFN", "router", logits_index=None,
                 fields=("d_model", "moe_num_experts", "ffn_hidden_size", "moe_top_k")),
    "dbrx_p2": Case("dbrx", "dbrx", "DbrxFFN", "router", logits_index=None,
                    fields=("d_model", "moe_num_experts", "ffn_hidden_size", "moe_top_k"),
                    overrides=(("moe_normalize_expert_weights", 2.0),)),
}

# (d, E, n, B, S) per size (K is the case's): "cpu" for the float64 comparison, "gpu" for the
# bfloat16 one on the Hopper kernels (d and n multiples of the kernels' column blocks, 256 and 128).
SIZES = {"cpu": (32, 8, 16, 2, 12), "gpu": (256, 8, 128, 2, 128)}


def _resolve(value, n):
  if isinstance(value, str) and value.endswith("n"):
    return int(value[:-1] or 1) * n
  return value


def make_config(case: Case, size: str = "cpu"):
  """The case's transformers config at `size`."""
  from transformers.models.auto.configuration_auto import CONFIG_MAPPING
  d, e, n, _, _ = SIZES[size]
  values = dict(zip(case.fields, (d, e, n, case.top_k)))
  overrides = case.overrides
  if size == "gpu" and case.gpu_overrides is not None:
    overrides = case.gpu_overrides
  values.update((name, _resolve(v, n)) for name, v in overrides)
  cls = CONFIG_MAPPING[case.model_type]
  if case.model_type == "dbrx":
    ffn = {name: values.pop(name) for name in list(values) if name != "d_model"}
    config = cls(d_model=values["d_model"], n_heads=4, n_layers=1, ffn_config=ffn)
  else:
    values.update((name, v) for name, v in _ATTN if name not in values)
    config = cls(**values)
  config._experts_implementation = "eager"
  for sub in ("ffn_config",):
    if hasattr(config, sub):
      getattr(config, sub)._experts_implementation = "eager"
  return config


def make_block(case: Case, config):
  import torch
  module = importlib.import_module(f"transformers.models.{case.module}.modeling_{case.module}")
  block_cls = getattr(module, case.block)
  if case.model_type in ("granitemoeshared", "granitemoe_swa", "granitemoehybrid"):
    # The shared MLP lives in the decoder layer, beside `block_sparse_moe`: this block holds both
    # under the layer's attribute names, so its keys are the layer's (without the layer prefix).
    class GraniteMoeSharedBlock(torch.nn.Module):
      def __init__(self):
        super().__init__()
        self.block_sparse_moe = block_cls(config)
        self.shared_mlp = getattr(module, case.block[:-len("MoE")] + "MLP")(config)

      def forward(self, x):
        return self.block_sparse_moe(x) + self.shared_mlp(x)

    return GraniteMoeSharedBlock()
  if case.model_type in ("gemma4_text", "diffusion_gemma_text"):
    # The decoder layer's MoE part under its attribute names (keys as the layer's): the router
    # and the experts, both on the block's input (the layer feeds the experts another
    # normalisation of it; the MoE layer's router_input).
    class Gemma4Moe(torch.nn.Module):
      def __init__(self):
        super().__init__()
        self.router = getattr(module, case.block.replace("Experts", "Router"))(config)
        self.experts = block_cls(config)

      def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        _, weights, ids = self.router(flat)
        return self.experts(flat, ids, weights).reshape(x.shape)

    return Gemma4Moe()
  if case.model_type == "deepseek_v4":
    block = block_cls(config, layer_idx=0)
    if not block.is_hash:
      return block

    # A hash-routed layer selects by its input's token ids: fixed ones, from `input_ids`.
    class HashRouted(torch.nn.Module):
      def __init__(self):
        super().__init__()
        self.gate, self.experts, self.shared_experts = (block.gate, block.experts,
                                                        block.shared_experts)
        self.input_ids = None

      def forward(self, x):
        return block(x, input_ids=self.input_ids)

    return HashRouted()
  if case.model_type == "dbrx":
    return block_cls(config=config)
  if case.model_type == "step3p5":
    return block_cls(config, layer_idx=0)
  if case.model_type == "hunyuan_v1_moe":
    return block_cls(config, layer_idx=0)
  return block_cls(config)


def _representable(values, size):
  """float64 values that float32 holds exactly ("cpu"), or bfloat16 ("gpu": the bfloat16 layer
  then sees the reference's own input and weights)."""
  import torch
  t = torch.from_numpy(np.asarray(values, np.float64))
  return t.to(torch.float32 if size == "cpu" else torch.bfloat16).to(torch.float64)


def _randomize(block, rng, d, e_count, router, size):
  """Random representable (`_representable`) values for every parameter and buffer (in place)."""
  import torch
  with torch.no_grad():
    for name, t in list(block.named_parameters()) + list(block.named_buffers()):
      leaf = name.rsplit(".", 1)[-1]
      if leaf == "tid2eid":  # DeepSeek-V4's hash table: K distinct experts per token id
        t.copy_(torch.from_numpy(np.stack([rng.permutation(e_count)[:t.shape[1]]
                                           for _ in range(t.shape[0])])))
        continue
      if "correction_bias" in name or leaf == "expert_bias":
        values = 0.05 * rng.standard_normal(t.shape)  # selection bias: moves some choices
      elif name in ("router.scale", "router.per_expert_scale"):  # Gemma 4: multipliers
        values = 1.0 + 0.3 * rng.standard_normal(t.shape)
      elif t.ndim == 1 or "bias" in leaf:
        values = 0.3 * rng.standard_normal(t.shape)
      elif name.startswith(router + ".") and t.ndim == 2:
        values = 1.5 / np.sqrt(d) * rng.standard_normal(t.shape)  # logits of std ~1.5
      else:
        values = rng.standard_normal(t.shape) / np.sqrt(d)
      t.copy_(_representable(values, size))


# Where a decoder layer's block sits in the whole model, where not under "mlp" (the block's keys as
# `make_block`'s state dict gives them: Granite's and Gemma 4's are the decoder layer's).
_LAYER_PREFIX = {"granitemoeshared": "model.layers.0.", "granitemoe_swa": "model.layers.0.",
                 "granitemoehybrid": "model.layers.0.", "gemma4_text": "model.layers.0.",
                 "diffusion_gemma_text": "model.layers.0.",
                 "granitemoe": "model.layers.0.block_sparse_moe.",
                 "lfm2_moe": "model.layers.0.feed_forward.",
                 "llama4_text": "model.layers.0.feed_forward.",
                 "jamba": "model.layers.0.feed_forward.", "dbrx": "transformer.blocks.0.ffn.",
                 "nemotron_h": "model.layers.0.mixer."}


def hub_checkpoint(case: Case, config, block) -> dict[str, np.ndarray]:
  """Decoder layer 0's block as a Hub checkpoint holds it, whole-model keys: transformers' own
  conversion for saving (`revert_weight_conversion`, what save_pretrained applies) of the
  block's state dict, with the conversions of its model type (else of its model's module)."""
  import torch
  from transformers.conversion_mapping import get_checkpoint_conversion_mapping
  from transformers.core_model_loading import PrefixChange, revert_weight_conversion
  prefix = _LAYER_PREFIX.get(case.model_type, "model.layers.0.mlp.")
  state = {prefix + k: v for k, v in block.state_dict().items()}
  conversions = (get_checkpoint_conversion_mapping(case.model_type)
                 or get_checkpoint_conversion_mapping(case.module) or [])
  model = torch.nn.Module()  # stands for the model: its conversions, config and parameters
  model.config = config
  model.get_parameter = state.__getitem__
  model._weight_conversions = [c for c in conversions if not isinstance(c, PrefixChange)] or None
  return {k: v.detach().numpy().copy() for k, v in revert_weight_conversion(model, state).items()}


def run_case(name: str, seed: int = 0, size: str = "cpu") -> dict[str, np.ndarray]:
  """The reference arrays of one case (see the module docstring)."""
  import torch
  import transformers
  from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
  transformers.logging.set_verbosity_error()
  case = CASES[name]
  config = make_config(case, size)
  torch.manual_seed(seed)
  block = make_block(case, config).double().eval()
  d, e, _, b, s = SIZES[size]
  k = case.top_k
  rng = np.random.default_rng([seed, sum(map(ord, name))])
  _randomize(block, rng, d, e, case.router, size)
  if hasattr(block, "input_ids"):  # hash-routed: the token ids it selects by
    block.input_ids = torch.from_numpy(rng.integers(0, config.vocab_size, (b, s)))
  x = _representable(rng.standard_normal((b, s, d)), size)
  x.requires_grad_(True)
  cot = torch.from_numpy(rng.standard_normal((b, s, d)))
  router = block.get_submodule(case.router)
  seen = {}

  def hook(_module, _inputs, outputs):
    seen["logits"] = outputs if case.logits_index is None else outputs[case.logits_index]

  handle = router.register_forward_hook(hook)
  state = {key: v.detach().numpy().copy() for key, v in block.state_dict().items()}
  y = block(x)
  handle.remove()
  if isinstance(y, tuple):
    y = y[0]
  y = y.reshape(x.shape)
  torch.sum(y * cot).backward()
  out = {} if not hasattr(block, "input_ids") else {"expert_ids": block.gate.tid2eid[
      block.input_ids.reshape(-1)].numpy().astype(np.int32)}  # the layer's expert_ids
  out |= {"config_json": np.array(config.to_json_string(use_diff=False)),
         "model_type": np.array(config.model_type),
         "input": x.detach().numpy(), "cotangent": cot.numpy(), "output": y.detach().numpy(),
         "grad_input": x.grad.numpy()}
  out.update({f"param/{key}": v for key, v in state.items()})
  out.update({f"hub/{key}": v for key, v in hub_checkpoint(case, config, block).items()})
  for key, p in block.named_parameters():
    if p.grad is not None:
      out[f"grad/{key}"] = p.grad.numpy()
  logits = seen["logits"].detach().reshape(-1, e)
  out["router_logits"] = logits.numpy().astype(np.float64)
  mask = torch.ones((b, s), dtype=torch.long)
  mask[0, s - 3:] = 0
  mask[1, :2] = 0
  layers = (logits.double(), 0.5 * logits.double())
  out["lb_loss"] = np.array(float(load_balancing_loss_func(layers, e, k)))
  out["lb_loss_masked"] = np.array(float(load_balancing_loss_func(layers, e, k, mask)))
  out["lb_mask"] = mask.numpy()
  out["top_k"] = np.array(k)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="directory for <case>.npz")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
  parser.add_argument("--keys", action="store_true", help="print each case's state dict")
  parser.add_argument("cases", nargs="*", default=list(CASES))
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  for name in args.cases:
    arrays = run_case(name, args.seed, args.size)
    save = np.savez
    if args.size == "gpu":  # compared in bfloat16: float32 holds enough, ~6 MB a file to copy
      arrays = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in arrays.items()}
      save = np.savez_compressed
    save(os.path.join(args.out, f"{name}.npz"), **arrays)
    if args.keys:
      for part in ("param/", "hub/"):
        print(name, part[:-1], {k[len(part):]: v.shape for k, v in arrays.items()
                                if k.startswith(part)})
  return 0


if __name__ == "__main__":
  sys.exit(main())
