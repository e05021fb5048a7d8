"""Which Hugging Face architecture computes a Kiln model exactly, its `config.json` and its weights.

Kiln's model options (`ModelConfig`) each exist in some published architecture, but no one
architecture has them all; `hf_architecture` picks the one whose computation is Kiln's, option for
option, and otherwise refuses, naming the option and why (`ExportRefused`):

| Kiln options | architecture |
|---|---|
| RoPE (any scaling), RMSNorm before each sublayer, SwiGLU, full attention | `LlamaForCausalLM` |
| the same with QK-norm per head, any windows | `Qwen3ForCausalLM` |
| the same without QK-norm, with sliding windows or without positions (NoPE) | `SmolLM3ForCausalLM` |
| RoPE, LayerNorm before each sublayer, SwiGLU (QK LayerNorm per head) | `StableLmForCausalLM` |
| RoPE, RMSNorm, GELU MLP | `ArceeForCausalLM` |
| RoPE, OLMo 2's reordered RMSNorm with QK-norm over the projection | `Olmo2ForCausalLM` (windows: `Olmo3ForCausalLM`) |
| learned positions, LayerNorm before each sublayer, GELU | `GPT2LMHeadModel` |
| learned positions, LayerNorm after each residual add (or before), GELU | `OPTForCausalLM` |
| ALiBi, LayerNorm before each sublayer, GELU of width 4 d | `MptForCausalLM` |

Kiln's norms and projections have no biases; where the architecture has them (LayerNorm's
bias, GPT-2's and OPT's linear biases) the export writes zeros, which computes the same. RoPE's
(first half, second half) pairs are HF's `rotate_half`; NTK-aware scaling is a plain base of
theta * factor^(d / (d - 2)), linear and YaRN are transformers' own `rope_type`s. Multi-token
prediction heads are training-only: the export holds the next-token model, whose logits are
the same with or without them. Every row is checked by tests/tasks/evals/test_export_hf.py
(logits within 1e-4 of Kiln's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kiln.tasks.errors import InputError
from kiln.tasks.train.config import ModelConfig


class ExportRefused(InputError):
    """No Hugging Face architecture computes this model: the message names the option and why."""


FUSED = "#"  # a part of a fused projection: NAME#q, NAME#k, NAME#v (see `_fuse`)

# (Kiln name inside `blocks.N.`, its tensor, the model's config) -> {HF name inside the layer: tensor}
BlockWeights = Callable[[str, torch.Tensor, ModelConfig], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Architecture:
    name: str  # the `architectures` entry, the class transformers builds
    model_type: str
    layer_prefix: str  # HF's name of block N, with {i}
    top_names: dict[str, str]  # Kiln's names outside the blocks -> HF's
    block_weights: BlockWeights
    config: Callable[[ModelConfig], dict[str, Any]]  # the architecture's own config.json keys


# ---- Llama and its relatives (same module names) --------------------------------------------

_LLAMA_ATTENTION = {"attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
                    "attn.wv.weight": "self_attn.v_proj.weight", "attn.proj.weight": "self_attn.o_proj.weight",
                    "mlp.gate.weight": "mlp.gate_proj.weight", "mlp.up.weight": "mlp.up_proj.weight",
                    "mlp.down.weight": "mlp.down_proj.weight",
                    "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}
_PRE_NORMS = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight"}
_REORDERED_NORMS = {"attn_norm.weight": "post_attention_layernorm.weight",
                    "mlp_norm.weight": "post_feedforward_layernorm.weight"}
_LLAMA_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}


def _renamed(names: dict[str, str]) -> BlockWeights:
    return lambda name, tensor, cfg: {names[name]: tensor}


def _stablelm_block(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    if name in ("attn.q_norm.weight", "attn.k_norm.weight"):
        # StableLM keeps a LayerNorm per head; Kiln's per-head norm is one gain shared by the heads
        which, heads = ("q", cfg.n_heads) if name.startswith("attn.q") else ("k", cfg.kv_heads)
        return {f"self_attn.{which}_layernorm.norms.{h}.weight": tensor for h in range(heads)}
    out = {(_LLAMA_ATTENTION | _PRE_NORMS)[name]: tensor}
    if name in _PRE_NORMS:
        out[_PRE_NORMS[name].replace(".weight", ".bias")] = torch.zeros_like(tensor)
    return out


def _rope(cfg: ModelConfig) -> dict[str, Any]:
    """RoPE's keys, both ways transformers has read them (v4: `rope_theta`/`rope_scaling`, v5:
    `rope_parameters`). NTK-aware scaling is the default rope with the scaled base."""
    theta, scaling = cfg.rope_theta, cfg.rope_scaling
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None and scaling.kind == "ntk":
        params["rope_theta"] = theta * scaling.factor ** (cfg.head_dim / (cfg.head_dim - 2))
    elif scaling is not None:
        params |= {"rope_type": scaling.kind, "factor": scaling.factor,
                   "original_max_position_embeddings": scaling.original_max_seq_len}
        if scaling.kind == "yarn":
            params |= {"beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow}
    legacy = None if params["rope_type"] == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return {"rope_theta": params["rope_theta"], "rope_parameters": params, "rope_scaling": legacy}


def _llama_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"intermediate_size": cfg.ffn_hidden, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, **_rope(cfg)}


def _layer_types(cfg: ModelConfig) -> dict[str, Any]:
    types = ["full_attention" if cfg.is_global(i) else "sliding_attention" for i in range(cfg.n_layers)]
    return {"layer_types": types, "sliding_window": cfg.sliding_window, "use_sliding_window": cfg.sliding_window is not None,
            "max_window_layers": cfg.n_layers}


LLAMA = Architecture("LlamaForCausalLM", "llama", "model.layers.{i}.", _LLAMA_TOP,
                     _renamed(_LLAMA_ATTENTION | _PRE_NORMS), _llama_config)
QWEN3 = Architecture("Qwen3ForCausalLM", "qwen3", "model.layers.{i}.", _LLAMA_TOP,
                     _renamed(_LLAMA_ATTENTION | _PRE_NORMS), lambda cfg: _llama_config(cfg) | _layer_types(cfg))
SMOLLM3 = Architecture(
    "SmolLM3ForCausalLM", "smollm3", "model.layers.{i}.", _LLAMA_TOP, _renamed(_LLAMA_ATTENTION | _PRE_NORMS),
    lambda cfg: _llama_config(cfg) | _layer_types(cfg) | {
        "no_rope_layers": [int(cfg.position == "rope")] * cfg.n_layers})
STABLELM = Architecture(
    "StableLmForCausalLM", "stablelm", "model.layers.{i}.",
    _LLAMA_TOP | {"norm.bias": "model.norm.bias"}, _stablelm_block,
    lambda cfg: _llama_config(cfg) | {"layer_norm_eps": cfg.norm_eps, "use_qkv_bias": False,
                                      "qk_layernorm": cfg.qk_norm, "use_parallel_residual": False,
                                      "rope_parameters": _rope(cfg)["rope_parameters"] | {"partial_rotary_factor": 1.0}})
ARCEE = Architecture("ArceeForCausalLM", "arcee", "model.layers.{i}.", _LLAMA_TOP,
                     _renamed(_LLAMA_ATTENTION | _PRE_NORMS), lambda cfg: _llama_config(cfg) | {"hidden_act": "gelu"})
OLMO2 = Architecture("Olmo2ForCausalLM", "olmo2", "model.layers.{i}.", _LLAMA_TOP,
                     _renamed(_LLAMA_ATTENTION | _REORDERED_NORMS), _llama_config)
OLMO3 = Architecture("Olmo3ForCausalLM", "olmo3", "model.layers.{i}.", _LLAMA_TOP,
                     _renamed(_LLAMA_ATTENTION | _REORDERED_NORMS),
                     lambda cfg: _llama_config(cfg) | {k: v for k, v in _layer_types(cfg).items()
                                                        if k in ("layer_types", "sliding_window")})


# ---- learned positions and ALiBi: GPT-2, OPT and MPT ------------------------------------------


def _zeros_bias(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(tensor.shape[0], dtype=tensor.dtype)}


def _gpt2_block(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    # GPT-2's Conv1D keeps weights as [in, out]; its fused c_attn is [d, 3d] ([q; k; v] transposed),
    # assembled from Kiln's three projections by `_fuse`
    norms = {"attn_norm.weight": "ln_1", "mlp_norm.weight": "ln_2"}
    if name in norms:
        return {f"{norms[name]}.weight": tensor, f"{norms[name]}.bias": torch.zeros_like(tensor)}
    linear = {"attn.proj.weight": "attn.c_proj", "mlp.up.weight": "mlp.c_fc", "mlp.down.weight": "mlp.c_proj",
              "attn.wq.weight": f"attn.c_attn{FUSED}q", "attn.wk.weight": f"attn.c_attn{FUSED}k",
              "attn.wv.weight": f"attn.c_attn{FUSED}v"}
    base, _, part = linear[name].partition(FUSED)
    suffix = f"{FUSED}{part}" if part else ""
    return {f"{base}.weight{suffix}": tensor.T, **_zeros_bias(f"{base}.bias{suffix}", tensor)}


def _opt_block(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    names = {"attn.wq.weight": "self_attn.q_proj", "attn.wk.weight": "self_attn.k_proj",
             "attn.wv.weight": "self_attn.v_proj", "attn.proj.weight": "self_attn.out_proj",
             "attn_norm.weight": "self_attn_layer_norm", "mlp_norm.weight": "final_layer_norm",
             "mlp.up.weight": "fc1", "mlp.down.weight": "fc2"}
    hf = names[name]
    return {f"{hf}.weight": tensor, **_zeros_bias(f"{hf}.bias", tensor)}


def _mpt_block(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    names = {"attn_norm.weight": "norm_1.weight", "mlp_norm.weight": "norm_2.weight",
             "attn.wq.weight": f"attn.Wqkv.weight{FUSED}q", "attn.wk.weight": f"attn.Wqkv.weight{FUSED}k",
             "attn.wv.weight": f"attn.Wqkv.weight{FUSED}v",
             "attn.proj.weight": "attn.out_proj.weight", "mlp.up.weight": "ffn.up_proj.weight",
             "mlp.down.weight": "ffn.down_proj.weight"}
    return {names[name]: tensor}


GPT2 = Architecture(
    "GPT2LMHeadModel", "gpt2", "transformer.h.{i}.",
    {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
     "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias", "lm_head.weight": "lm_head.weight"},
    _gpt2_block,
    lambda cfg: {"n_embd": cfg.d_model, "n_layer": cfg.n_layers, "n_head": cfg.n_heads, "n_inner": cfg.ffn_hidden,
                 "n_positions": cfg.max_seq_len, "activation_function": "gelu", "layer_norm_epsilon": cfg.norm_eps,
                 "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True})
OPT = Architecture(
    "OPTForCausalLM", "opt", "model.decoder.layers.{i}.",
    {"tok_emb.weight": "model.decoder.embed_tokens.weight", "pos_emb.weight": "model.decoder.embed_positions.weight",
     "norm.weight": "model.decoder.final_layer_norm.weight", "norm.bias": "model.decoder.final_layer_norm.bias",
     "lm_head.weight": "lm_head.weight"},
    _opt_block,
    lambda cfg: {"hidden_size": cfg.d_model, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
                 "ffn_dim": cfg.ffn_hidden, "max_position_embeddings": cfg.max_seq_len,
                 "do_layer_norm_before": cfg.norm_placement == "pre", "word_embed_proj_dim": cfg.d_model,
                 "activation_function": "gelu", "enable_bias": True, "layer_norm_elementwise_affine": True,
                 "dropout": 0.0, "attention_dropout": 0.0, "layerdrop": 0.0})
MPT = Architecture(
    "MptForCausalLM", "mpt", "transformer.blocks.{i}.",
    {"tok_emb.weight": "transformer.wte.weight", "norm.weight": "transformer.norm_f.weight",
     "lm_head.weight": "lm_head.weight"},
    _mpt_block,
    lambda cfg: {"d_model": cfg.d_model, "n_heads": cfg.n_heads, "n_layers": cfg.n_layers, "expansion_ratio": 4,
                 "max_seq_len": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps, "no_bias": True,
                 "learned_pos_emb": False, "norm_type": "low_precision_layernorm",
                 "attn_config": {"alibi": True, "alibi_bias_max": 8, "attn_pdrop": 0, "clip_qkv": None,
                                 "softmax_scale": None, "qk_ln": False, "attn_type": "multihead_attention"}})
OPT_POSITION_OFFSET = 2  # OPT's position table has two rows before position 0 (fairseq's padding offset)


# ---- choosing one -------------------------------------------------------------------------------


def hf_architecture(cfg: ModelConfig) -> Architecture:
    """The architecture that computes `cfg`'s model exactly (see the module's table), or
    `ExportRefused` naming the option that has none and why."""
    windows = cfg.sliding_window is not None
    if cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.norm_placement == "pre":
        if cfg.qk_norm and cfg.qk_norm_scope == "projection":
            raise ExportRefused(_refusal(cfg, "model.qk_norm_scope='projection' before each sublayer",
                                         "OLMo 2 normalises the whole projection but places its norms after the "
                                         "sublayers (norm_placement: reordered); Qwen 3 normalises per head"))
        if cfg.qk_norm:
            return QWEN3
        return SMOLLM3 if windows else LLAMA
    if cfg.position == "nope":
        if cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.norm_placement == "pre" and not cfg.qk_norm:
            return SMOLLM3
        raise ExportRefused(_refusal(cfg, "model.position='nope'", "SmolLM3 (Llama blocks, rotary positions off per "
                                     "layer) is the one architecture without positions; it has pre-RMSNorm, SwiGLU "
                                     "and no QK-norm"))
    if cfg.norm_placement == "reordered":
        if cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.qk_norm \
                and cfg.qk_norm_scope == "projection":
            return OLMO3 if windows else OLMO2
        raise ExportRefused(_refusal(cfg, "model.norm_placement='reordered'", "OLMo 2 (and OLMo 3, with windows) is "
                                     "the architecture with norms after each sublayer; it has RoPE, RMSNorm, SwiGLU "
                                     "and QK-norm over the projection (qk_norm: true, qk_norm_scope: projection)"))
    _refuse_windows_and_gqa(cfg)
    if cfg.position == "rope" and cfg.norm == "layernorm" and cfg.mlp == "swiglu" and cfg.norm_placement == "pre" \
            and cfg.qk_norm_scope == "head":
        return STABLELM
    if cfg.position == "rope" and cfg.norm == "rmsnorm" and cfg.mlp == "gelu" and cfg.norm_placement == "pre" \
            and not cfg.qk_norm:
        return ARCEE
    if cfg.position == "learned" and cfg.norm == "layernorm" and cfg.mlp == "gelu" and not cfg.qk_norm:
        if cfg.norm_placement == "pre" and cfg.tie_embeddings:
            return GPT2
        return OPT
    if cfg.position == "alibi" and cfg.norm == "layernorm" and cfg.mlp == "gelu" and cfg.norm_placement == "pre" \
            and not cfg.qk_norm and cfg.tie_embeddings and cfg.ffn_hidden == 4 * cfg.d_model:
        return MPT
    raise ExportRefused(_refusal(cfg, _unmatched_option(cfg), _UNMATCHED_WHY[_unmatched_option(cfg)]))


def _refuse_windows_and_gqa(cfg: ModelConfig) -> None:
    """The architectures left (StableLM, Arcee, GPT-2, OPT, MPT) have full attention, and GPT-2,
    OPT and MPT one K/V head per query head."""
    if cfg.sliding_window is not None:
        raise ExportRefused(_refusal(cfg, f"model.sliding_window={cfg.sliding_window}",
                                     "architectures with windows (Qwen 3, SmolLM3, OLMo 3) have RoPE, RMSNorm and "
                                     "SwiGLU; none matching this model's other options has one"))
    if cfg.position != "rope" and cfg.kv_heads != cfg.n_heads:
        raise ExportRefused(_refusal(cfg, f"model.n_kv_heads={cfg.n_kv_heads}", f"the architecture for "
                                     f"model.position={cfg.position!r} ({'MPT' if cfg.position == 'alibi' else 'GPT-2 or OPT'}) "
                                     "has one K/V head per query head"))


_UNMATCHED_WHY = {
    "model.position='alibi'": "MPT is the ALiBi architecture without extra modules (BLOOM normalises the embeddings); "
                              "it has LayerNorm before each sublayer, a GELU MLP of width 4 d (mlp: gelu, "
                              "ffn_multiplier: 4), tied embeddings and no QK-norm",
    "model.position='learned'": "GPT-2 and OPT are the architectures with learned positions; they have LayerNorm, a "
                                "GELU MLP and no QK-norm",
    "model.norm_placement='post'": "OPT (do_layer_norm_before: false) is the post-norm decoder; it has learned "
                                   "positions, LayerNorm and a GELU MLP",
    "model.norm='layernorm'": "with RoPE, StableLM has LayerNorm before each sublayer and a SwiGLU MLP (QK-norm per "
                              "head); with GELU it needs learned positions (GPT-2, OPT) or ALiBi (MPT)",
    "model.mlp='gelu'": "with RoPE, Arcee has a GELU MLP with RMSNorm before each sublayer and no QK-norm",
    "model.qk_norm=True": "QK-norm exists in Qwen 3 (RMSNorm per head), OLMo 2 (over the projection, reordered "
                          "norms) and StableLM (LayerNorm per head)",
}


def _unmatched_option(cfg: ModelConfig) -> str:
    """The option that ruled out the architecture for this model's position encoding."""
    if cfg.position == "alibi":
        return "model.position='alibi'"
    if cfg.position == "learned":
        return "model.position='learned'"
    if cfg.norm_placement == "post":
        return "model.norm_placement='post'"
    if cfg.norm == "layernorm":
        return "model.norm='layernorm'"
    if cfg.mlp == "gelu":
        return "model.mlp='gelu'"
    return "model.qk_norm=True"


def _refusal(cfg: ModelConfig, option: str, why: str) -> str:
    shown = cfg.model_dump(exclude_defaults=True, exclude={"d_model", "n_layers", "n_heads", "max_seq_len"})
    return (f"kiln export: no Hugging Face architecture computes {option} with this model's other options "
            f"({shown}): {why}. Export to another format, or train with options the table in "
            "tasks/evals/hf_architectures.py lists")


def hf_weights(arch: Architecture, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` (a Kiln state dict) under `arch`'s names, as the HF model loads it: multi-token
    prediction heads left out, a tied head left out (HF ties it again), zero biases added, fused
    projections assembled, OPT's two offset rows put before the position table."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(("mtp_blocks.", "mtp_norms.")) or (name == "lm_head.weight" and cfg.tie_embeddings):
            continue
        if name.startswith("blocks."):
            _, index, rest = name.split(".", 2)
            prefix = arch.layer_prefix.format(i=index)
            out |= {prefix + hf: t for hf, t in arch.block_weights(rest, tensor, cfg).items()}
        else:
            out[arch.top_names[name]] = tensor
            bias = name.replace(".weight", ".bias")
            if name == "norm.weight" and bias in arch.top_names:
                out[arch.top_names[bias]] = torch.zeros_like(tensor)
    if arch is OPT:
        positions = out["model.decoder.embed_positions.weight"]
        out["model.decoder.embed_positions.weight"] = torch.cat((positions.new_zeros(OPT_POSITION_OFFSET,
                                                                                     cfg.d_model), positions))
    return _fuse(out)


def _fuse(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused projections assembled from their parts (`NAME#q`, `NAME#k`, `NAME#v`): GPT-2's c_attn
    (a Conv1D, [in, out]: the parts are its columns) and MPT's Wqkv (a Linear: its rows)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in weights.items():
        if FUSED in name:
            base, part = name.split(FUSED)
            parts[base][part] = tensor
        else:
            out[name] = tensor
    for base, qkv in parts.items():
        out[base] = torch.cat([qkv["q"], qkv["k"], qkv["v"]], dim=1 if base.endswith("c_attn.weight") else 0)
    return out
