"""Hand-off: a Kiln model and its tokenizer as a Hugging Face folder that `transformers`
(`AutoModelForCausalLM`, `AutoTokenizer`) and `lm_eval --model hf` load offline.

By default Kiln's blocks are Llama's (pre-RMSNorm, rotary embeddings, bias-free grouped-query
attention and SwiGLU, optionally tied embeddings), so the folder is a `LlamaForCausalLM`
(`num_key_value_heads` is `model.n_kv_heads`, and `k_proj`/`v_proj` are Kiln's K/V projections as
they are): `config.json`, `model.safetensors`, the BPE `tokenizer.json` Kiln trained with a
`tokenizer_config.json`, `generation_config.json` and a model card `README.md`. A model trained
with other options is written as the architecture that computes them exactly (Qwen 3 for
QK-norm, OLMo 2 for the reordered norm, MPT for ALiBi, ...: `tasks.evals.hf_architectures`), or
refused with the option that has none.

No q/k permutation is needed: Kiln's RoPE rotates (first half, second half) pairs of each head,
as HF's `rotate_half` does, with the same frequencies theta^(-2i/d). Only checkpoints that rotate
interleaved pairs (0,1), (2,3), ... (Meta's reference code) need the usual row permutation;
`tests/tasks/evals/test_export_hf.py` shows that applying it here would break the logits.

Kiln has no separate beginning-of-text token: every document ends with `<|endoftext|>`, so that
token also precedes the next one (and lm-eval's rolling perplexity starts from it). It is the
folder's bos, eos and pad token, as in GPT-2.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from kiln.tasks.constants import EOS_TOKEN
from kiln.tasks.errors import InputError
from kiln.tasks.evals.hf_architectures import hf_architecture, hf_weights
from kiln.tasks.evals.model_card import evaluations_of, read_compliance, render_model_card
from kiln.tasks.lineage import lineage_manifests
from kiln.tasks.store import Store
from kiln.tasks.train.checkpoint import MARKER
from kiln.tasks.train.config import ModelConfig
from kiln.tasks.train.dcp import checkpoint_model, load_model_weights, read_train_state
from kiln.tasks.train.model import CONFIG_FILE, MODEL_FILE, Transformer, load_model

WEIGHTS_FILE = "model.safetensors"
CARD_FILE = "README.md"
HF_FILES = ("config.json", WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json", "generation_config.json", CARD_FILE)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

def architecture(cfg: ModelConfig) -> str:
    """The Hugging Face class the export writes (`ExportRefused` when there is none)."""
    return hf_architecture(cfg).name


def hf_state_dict(model: Transformer, dtype: str = "float32") -> dict[str, torch.Tensor]:
    """The model's weights under its architecture's names (a tied `lm_head` is left out: HF re-ties it)."""
    weights = hf_weights(hf_architecture(model.cfg), model.cfg, model.state_dict())
    # safetensors wants contiguous, unshared storage for each tensor
    return {name: tensor.detach().to("cpu", _DTYPES[dtype]).contiguous().clone() for name, tensor in weights.items()}


def hf_config(cfg: ModelConfig, vocab_size: int, eos_id: int, dtype: str = "float32") -> dict:
    """`config.json`: what every architecture reads, then the architecture's own keys."""
    arch = hf_architecture(cfg)
    return {
        "architectures": [arch.name],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": cfg.d_model,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
        **arch.config(cfg),
    }


def tokenizer_config(max_seq_len: int) -> dict:
    """`tokenizer_config.json`: the fast tokenizer over `tokenizer.json`, adding no special tokens
    (Kiln's BPE has no post-processor) and decoding bytes back exactly."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "unk_token": None,
        "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # would turn " ." into "." on decode
        "model_max_length": max_seq_len,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def eos_id_of(tokenizer_path: Path) -> tuple[Tokenizer, int]:
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    if eos_id is None:
        raise InputError(f"{tokenizer_path} has no {EOS_TOKEN} token: export the tokenizer the tokenize stage trained")
    return tokenizer, eos_id


def export_hf(model: Transformer, tokenizer_path: Path, out_dir: Path, *, card: Callable[[dict[str, Any]], str],
              dtype: str = "float32") -> dict[str, Any]:
    """Write the HF folder for `model` and the `tokenizer.json` it was trained with into out_dir
    (created; must be empty or absent). `card(summary)` renders the README from what was written;
    returns that summary."""
    from safetensors.torch import save_file  # imported when used: the config tree imports this module

    cfg, vocab_size = model.cfg, model.vocab_size
    hf_architecture(cfg)  # refused before anything is written
    tokenizer, eos_id = eos_id_of(tokenizer_path)
    if tokenizer.get_vocab_size() != vocab_size:
        raise InputError(f"{tokenizer_path} has {tokenizer.get_vocab_size()} tokens but the model's embedding has "
                         f"{vocab_size} rows: export with the tokenizer the model was trained on")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise InputError(f"{out_dir} is not empty: choose a new folder for the export (nothing was written)")
    out_dir.mkdir(parents=True, exist_ok=True)

    save_file(hf_state_dict(model, dtype), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config(cfg, vocab_size, eos_id, dtype))
    shutil.copyfile(tokenizer_path, out_dir / "tokenizer.json")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(cfg.max_seq_len))
    # Kiln's own decoding (the lm-eval adapter) is greedy and stops at end of text
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False})
    summary = {"architecture": architecture(cfg), "dtype": dtype, "vocab_size": vocab_size,
               "num_params": sum(p.numel() for name, p in model.named_parameters() if not name.startswith("mtp_"))}
    (out_dir / CARD_FILE).write_text(card(summary), encoding="utf-8")
    return {**summary, "num_bytes": sum((out_dir / name).stat().st_size for name in HF_FILES)}


def load_kiln_model(path: Path) -> tuple[Transformer, str]:
    """The model in `path` and what it is: a saved model folder (`model.pt` + `model_config.json`),
    a stage output holding one in `model/`, or a DCP training checkpoint (`checkpoints/step_N`)."""

    if (path / CONFIG_FILE).is_file() and (path / MODEL_FILE).is_file():
        return load_model(path)[0], f"model folder {path}"
    if (path / "model" / CONFIG_FILE).is_file():
        return load_model(path / "model")[0], f"model folder {path / 'model'}"
    if (path / MARKER).is_file():
        # imported here: torch.distributed.checkpoint takes a second to import

        train_state = read_train_state(path)
        model = Transformer(ModelConfig.model_validate(checkpoint_model(train_state)),
                            int(train_state["identity"]["vocab_size"]))
        state = load_model_weights(path, model)
        return model.eval(), f"training checkpoint {path} (step {state.get('step', '?')})"
    raise InputError(f"{path} holds no Kiln model: pass a model folder (model.pt and {CONFIG_FILE}), a train or "
                     "anneal stage output, a checkpoints/step_N folder, or a stage key")


def export_source(store: Store, source: str, out_dir: Path, *, keys: dict[str, str], tokenizer: Path | None = None,
                  dtype: str = "float32") -> dict[str, Any]:
    """`kiln export`: export `source` (a folder `load_kiln_model` reads, a stage name, whose output for
    this config's `keys` is taken, or a stage key, `KEY` or `STAGE/KEY`, in the store) to out_dir.

    A committed stage output brings its lineage, its scores and, through its tokenize input, its
    tokenizer; otherwise `tokenizer` (default: this config's tokenize output) is used."""
    path, stage, key = _resolve(store, source, keys)
    model, what = load_kiln_model(path)
    manifests = lineage_manifests(store, stage, key) if stage and key else {}
    # a checkpoint inside a stage output is not the model the stage's evaluation scored
    is_final = stage is not None and path.resolve() in (store.path(stage, key).resolve(),
                                                        (store.path(stage, key) / "model").resolve())
    if tokenizer is None:
        tokenize_key = manifests["tokenize"]["key"] if "tokenize" in manifests else keys.get("tokenize")
        if tokenize_key is None or not store.is_complete("tokenize", tokenize_key):
            raise InputError(f"no tokenizer known for {path}: pass --tokenizer (the tokenize stage's tokenizer.json)")
        tokenizer = store.path("tokenize", tokenize_key) / "tokenizer.json"
    exported_from = f"Kiln stage `{stage}` output `{key}`, {what}" if stage else what

    def card(summary: dict[str, Any]) -> str:
        return render_model_card(name=f"kiln-{key}" if key else out_dir.name, exported_from=exported_from,
                                 export=summary, model_config=model.cfg.model_dump(mode="json"), manifests=manifests,
                                 evaluations=evaluations_of(store, stage, key) if is_final else {},
                                 compliance=read_compliance(store, manifests))

    written = export_hf(model, tokenizer, out_dir, card=card, dtype=dtype)
    return {**written, "exported_from": exported_from, "tokenizer": str(tokenizer)}


def _resolve(store: Store, source: str, keys: dict[str, str]) -> tuple[Path, str | None, str | None]:
    """(folder, stage, key): the stage and key are those of the committed store output it is in, if any."""
    path = Path(source)
    if path.exists():
        path = path.resolve()
        try:
            parts = path.relative_to(store.root.resolve()).parts
        except ValueError:
            parts = ()
        if len(parts) >= 2 and store.is_complete(parts[0], parts[1]):
            return path, parts[0], parts[1]
        return path, None, None
    if source in keys:
        stage, key = source, keys[source]
    else:
        found = [store.root / source] if "/" in source else sorted(store.root.glob(f"*/{source}"))
        found = [p for p in found if p.is_dir()]
        if len(found) != 1:
            raise InputError(f"{source!r} is no folder, stage name or stage key in {store.root} "
                             f"({len(found)} outputs match): `kiln status` lists this config's keys")
        stage, key = found[0].parent.name, found[0].name
    if not store.is_complete(stage, key):
        raise InputError(f"stage {stage} output {key} is not complete in {store.root}: run the stage first (kiln stage {stage})")
    return store.path(stage, key), stage, key


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
