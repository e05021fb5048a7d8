"""The Hugging Face export: transformers loads the folder offline and computes Kiln's logits and
greedy tokens, and lm-eval's own CLI scores it (`--model hf`) as Kiln's adapter scores Kiln's model."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: nothing may come from the hub
os.environ["HF_DATASETS_OFFLINE"] = "1"

import transformers  # noqa: E402

from kiln.tasks.constants import EOS_TOKEN
from kiln.tasks.data.tokenize import TokenizeConfig, train_tokenizer  # noqa: E402
from kiln.tasks.errors import InputError  # noqa: E402
from kiln.tasks.evals.export_hf import export_hf, hf_state_dict, load_kiln_model  # noqa: E402
from kiln.tasks.evals.hf_architectures import ExportRefused  # noqa: E402
from kiln.tasks.evals.heldout_task import task_name_for, write_heldout_task  # noqa: E402
from kiln.tasks.train.config import ModelConfig, RopeScaling  # noqa: E402
from kiln.tasks.train.model import Transformer, save_model  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "data" / "sample" / "prose" / "coreutils-man"
# configs/tiny.yaml's train model; the second flavour covers untied embeddings and QK-norm
TINY = ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
UNTIED_QK_NORM = TINY.model_copy(update={"tie_embeddings": False, "qk_norm": True, "rope_theta": 500.0})
# grouped-query attention as Llama 3 has it: 8 query heads sharing 2 K/V heads, untied, RoPE theta 500,000
GQA = TINY.model_copy(update={"n_heads": 8, "n_kv_heads": 2, "tie_embeddings": False, "rope_theta": 500_000.0})
MAX_LOGIT_DIFF = 1e-4


def sample_texts() -> list[str]:
    return [path.read_text(encoding="utf-8") for path in sorted(SAMPLE.glob("*.txt"))]


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_tokenizer(sample_texts(), TokenizeConfig(vocab_size=512)).save(str(path))
    return path


def sharp_model(cfg: ModelConfig, vocab_size: int, seed: int = 0) -> Transformer:
    """A random model whose attention is far from uniform and whose norm gains are not all one, so
    a wrong RoPE layout, head split or norm mapping shows in the logits (Kiln's 0.02 init would
    make every attention score ~0 and hide them)."""
    torch.manual_seed(seed)
    model = Transformer(cfg, vocab_size)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.3)
            else:
                param.uniform_(0.5, 1.5)
    return model.eval()


def real_windows(tokenizer, length: int) -> torch.Tensor:
    """Two windows of real man-page text, as the exported tokenizer encodes them."""
    ids = tokenizer("\n".join(sample_texts()[:3]))["input_ids"]
    return torch.tensor([ids[:length], ids[1000 : 1000 + length]])


def kiln_greedy(model: Transformer, prompt: list[int], steps: int) -> tuple[list[int], float]:
    """Kiln's decoding rule (as the lm-eval adapter's generate_until): argmax after the whole context. Also
    the smallest gap between the best and second-best logit: a token choice that float noise cannot flip."""
    tokens, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([tokens]))[0, -1]
            best, second = logits.topk(2).values.tolist()
            tokens.append(int(logits.argmax()))
            gaps.append(best - second)
    return tokens[len(prompt):], min(gaps)


def export(model: Transformer, tokenizer_path: Path, out: Path) -> Path:
    export_hf(model, tokenizer_path, out, card=lambda summary: f"# test export\n{summary}\n")
    return out


@pytest.mark.parametrize("cfg", [TINY, UNTIED_QK_NORM, GQA], ids=["llama-tied", "qwen3-untied-qk-norm", "llama-gqa"])
def test_transformers_computes_kilns_logits_and_greedy_tokens(cfg, tokenizer_path, tmp_path):
    model = sharp_model(cfg, 512)
    out = export(model, tokenizer_path, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.num_key_value_heads == cfg.kv_heads and hf.config.num_attention_heads == cfg.n_heads
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM")
    assert hf.dtype == torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.is_fast and tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == EOS_TOKEN
    text = sample_texts()[0][:300]
    assert tokenizer(text)["input_ids"] == Tokenizer.from_file(str(tokenizer_path)).encode(text).ids
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # no special tokens added, bytes round-trip

    ids = real_windows(tokenizer, cfg.max_seq_len)
    with torch.no_grad():
        kiln_logits, hf_logits = model(ids), hf(ids).logits
    diff = (kiln_logits - hf_logits).abs().max().item()
    print(f"{type(hf).__name__}: max |logit diff| {diff:.2e} (logits up to {kiln_logits.abs().max():.1f})")
    assert diff < MAX_LOGIT_DIFF

    # generate() decodes with a KV cache, one position at a time: the rotary offsets must match too
    prompt = ids[0, :20]
    generated = hf.generate(prompt[None], max_new_tokens=10, do_sample=False, min_new_tokens=10)
    tokens, gap = kiln_greedy(model, prompt.tolist(), 10)
    # the same tokens exactly: every choice's margin is far above the logits' agreement (other kernels on
    # another CPU move logits by ~1e-6, not by the gap)
    assert gap > 100 * MAX_LOGIT_DIFF and generated[0, 20:].tolist() == tokens


# every architecture the export writes, from the model options that need it (tests/tasks/train
# test the options themselves): model -> architecture; 8 heads so GQA and ALiBi's slopes are real
OPTION_EXPORTS = {
    "rope-linear": (TINY.model_copy(update={"rope_scaling": RopeScaling(kind="linear", factor=4.0,
                                                                         original_max_seq_len=16)}), "LlamaForCausalLM"),
    "rope-ntk": (TINY.model_copy(update={"rope_scaling": RopeScaling(kind="ntk", factor=4.0, original_max_seq_len=16)}),
                 "LlamaForCausalLM"),
    "rope-yarn": (TINY.model_copy(update={"rope_scaling": RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=16),
                                          "n_heads": 2}), "LlamaForCausalLM"),
    "local-global-qk-norm": (GQA.model_copy(update={"qk_norm": True, "sliding_window": 8, "global_every": 2}),
                             "Qwen3ForCausalLM"),
    "nope": (GQA.model_copy(update={"position": "nope"}), "SmolLM3ForCausalLM"),
    "sliding-window": (GQA.model_copy(update={"sliding_window": 8}), "SmolLM3ForCausalLM"),
    "layernorm-qk-norm": (GQA.model_copy(update={"norm": "layernorm", "qk_norm": True}), "StableLmForCausalLM"),
    "gelu": (GQA.model_copy(update={"mlp": "gelu"}), "ArceeForCausalLM"),
    "reordered-qk-projection": (GQA.model_copy(update={"norm_placement": "reordered", "qk_norm": True,
                                                       "qk_norm_scope": "projection"}), "Olmo2ForCausalLM"),
    "reordered-windows": (GQA.model_copy(update={"norm_placement": "reordered", "qk_norm": True,
                                                 "qk_norm_scope": "projection", "sliding_window": 8,
                                                 "global_every": 2}), "Olmo3ForCausalLM"),
    "learned-pre": (TINY.model_copy(update={"position": "learned", "norm": "layernorm", "mlp": "gelu"}),
                    "GPT2LMHeadModel"),
    "learned-post": (TINY.model_copy(update={"position": "learned", "norm": "layernorm", "mlp": "gelu",
                                             "norm_placement": "post"}), "OPTForCausalLM"),
    "alibi": (TINY.model_copy(update={"position": "alibi", "norm": "layernorm", "mlp": "gelu", "ffn_multiplier": 4.0,
                                      "n_heads": 8}), "MptForCausalLM"),
    "mtp-heads-dropped": (GQA.model_copy(update={"mtp_heads": 2}), "LlamaForCausalLM"),
}


@pytest.mark.parametrize("case", OPTION_EXPORTS, ids=OPTION_EXPORTS)
def test_every_option_exports_to_an_architecture_computing_its_logits(case, tokenizer_path, tmp_path):
    cfg, expected = OPTION_EXPORTS[case]
    model = sharp_model(ModelConfig.model_validate(cfg.model_dump()), 512)
    out = export(model, tokenizer_path, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == expected
    ids = real_windows(transformers.AutoTokenizer.from_pretrained(out), cfg.max_seq_len)
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    print(f"{case} -> {expected}: max |logit diff| {diff:.2e}")
    assert diff < MAX_LOGIT_DIFF
    # multi-token prediction heads are training-only: the export is the next-token model
    assert not any(name.startswith("mtp_") for name in hf_state_dict(model))


@pytest.mark.parametrize("update,option", [
    ({"position": "alibi"}, "model.position='alibi'"),
    ({"position": "learned"}, "model.position='learned'"),
    ({"norm_placement": "post"}, "model.norm_placement='post'"),
    ({"norm_placement": "reordered"}, "model.norm_placement='reordered'"),
    ({"norm": "layernorm", "mlp": "gelu"}, "model.norm='layernorm'"),
    ({"qk_norm": True, "qk_norm_scope": "projection"}, "model.qk_norm_scope='projection'"),
    ({"position": "nope", "qk_norm": True}, "model.position='nope'"),
    ({"position": "alibi", "norm": "layernorm", "mlp": "gelu", "ffn_multiplier": 4.0, "sliding_window": 8},
     "model.sliding_window=8"),
    ({"position": "learned", "norm": "layernorm", "mlp": "gelu", "n_kv_heads": 2}, "model.n_kv_heads=2"),
])
def test_options_no_architecture_computes_are_refused_naming_them(update, option, tokenizer_path, tmp_path):
    model = sharp_model(ModelConfig.model_validate(TINY.model_dump() | update), 512)
    with pytest.raises(ExportRefused, match=re.escape(f"no Hugging Face architecture computes {option}")):
        export(model, tokenizer_path, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()  # refused before anything was written


def test_the_meta_rope_permutation_would_break_the_logits(tokenizer_path, tmp_path):
    """Kiln rotates (first half, second half) pairs like HF's rotate_half, so the export permutes
    nothing; the permutation checkpoints with interleaved pairs need would change the logits."""
    model = sharp_model(TINY, 512)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(1))
    state = hf_state_dict(model)
    heads, dim = TINY.n_heads, TINY.d_model

    def meta_to_hf(w: torch.Tensor) -> torch.Tensor:
        return w.view(heads, dim // heads // 2, 2, dim).transpose(1, 2).reshape(dim, dim)

    for name in list(state):
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            state[name] = meta_to_hf(state[name])
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=dim, intermediate_size=TINY.ffn_hidden, num_hidden_layers=TINY.n_layers,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=64, rms_norm_eps=TINY.norm_eps,
        tie_word_embeddings=True)
    permuted = transformers.LlamaForCausalLM(config).eval()
    permuted.load_state_dict(state, strict=False)
    permuted.tie_weights()
    with torch.no_grad():
        assert (model(ids) - permuted(ids).logits).abs().max().item() > 1e-2


def test_export_refuses_a_tokenizer_of_another_size_and_a_non_empty_folder(tokenizer_path, tmp_path):
    with pytest.raises(InputError, match="512 tokens but the model's embedding has 600 rows"):
        export(sharp_model(TINY, 600), tokenizer_path, tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "old.txt").write_text("x")
    with pytest.raises(InputError, match="is not empty"):
        export(sharp_model(TINY, 512), tokenizer_path, tmp_path / "b")


def test_load_kiln_model_reads_a_model_folder_and_a_stage_output(tmp_path):
    model = sharp_model(TINY, 300)
    save_model(model, TINY, 300, tmp_path / "stage" / "model")
    for path in (tmp_path / "stage", tmp_path / "stage" / "model"):
        loaded, what = load_kiln_model(path)
        assert torch.equal(loaded.tok_emb.weight, model.tok_emb.weight) and "model folder" in what
    with pytest.raises(InputError, match="holds no Kiln model"):
        load_kiln_model(tmp_path)


def test_load_kiln_model_reads_a_training_checkpoint(tmp_path):
    from kiln.tasks.train.dcp import save_dcp

    model = sharp_model(TINY, 300)
    optimizer = torch.optim.AdamW(model.parameters())
    identity = {"model": TINY.identity(), "vocab_size": 300}  # what the training loop records
    path = save_dcp(tmp_path / "checkpoints", 20, model, optimizer, {"identity": identity}, keep=1)
    loaded, what = load_kiln_model(path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert "step 20" in what


@pytest.mark.slow  # lm-eval's CLI in a subprocess: ~11 s
def test_lm_eval_cli_scores_the_export_as_kilns_adapter_scores_kilns_model(tokenizer_path, tmp_path):
    """`lm_eval --model hf --model_args pretrained=DIR` on Kiln's local held-out task, offline."""
    from kiln.tasks.evals.adapter import KilnLM
    from kiln.tasks.evals.evaluate import EvaluateConfig, evaluate_lm

    model = sharp_model(TINY, 512, seed=3)
    out = export(model, tokenizer_path, tmp_path / "hf")
    eval_file = REPO / "data" / "evals" / "heldout.jsonl"
    task = task_name_for(eval_file)
    write_heldout_task(eval_file, tmp_path / "tasks", task)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf_home"), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={out},dtype=float32",
               "--tasks", task, "--include_path", str(tmp_path / "tasks"), "--limit", "3", "--batch_size", "2",
               "--device", "cpu", "--output_path", str(tmp_path / "results")]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    scores = json.loads(results_file.read_text())["results"][task]
    print(f"lm_eval --model hf: {scores}")
    assert all(math.isfinite(scores[f"{m},none"]) for m in ("word_perplexity", "byte_perplexity", "bits_per_byte"))

    # the same documents through Kiln's own adapter and model: the same numbers
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    lm = KilnLM(model, tokenizer, TINY.max_seq_len, tokenizer.token_to_id(EOS_TOKEN))
    kiln = evaluate_lm(EvaluateConfig(eval_files=[str(eval_file)], limit=3), lm, tmp_path / "kiln")
    print(f"Kiln's adapter: bits_per_byte {kiln[f'{task}/bits_per_byte']}")
    assert scores["bits_per_byte,none"] == pytest.approx(kiln[f"{task}/bits_per_byte"], rel=1e-5)
