"""The evaluate stage end to end: Kiln's real model, saved and loaded, scored by lm-eval offline."""

from __future__ import annotations

import io
import json
import logging
import math
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from tokenizers import Tokenizer

from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.evals.adapter import KilnLM
from kiln.tasks.evals.evaluate import EvaluateConfig, evaluate_model
from kiln.tasks.library_output import library_output_to
from kiln.tasks.train.config import ModelConfig
from kiln.tasks.train.model import build_model, save_model
from tests.fixtures.continuous_eval import EOS, TEXTS, write_eval_file, write_tokenizer

MODEL = ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=16)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("evaluate")
    (root / "evals").mkdir()
    eval_file = write_eval_file(root / "evals" / "heldout.jsonl")
    tokenizer = write_tokenizer(root / "tokenizer.json")
    vocab = tokenizer.get_vocab_size()

    torch.manual_seed(0)
    untrained = build_model(MODEL, vocab)
    save_model(untrained, MODEL, vocab, root / "untrained")

    # A few dozen steps on the eval text itself: the trained model must score it better.
    eos = tokenizer.token_to_id(EOS)
    stream = torch.tensor([t for text in TEXTS for t in [eos, *tokenizer.encode(text).ids]])
    model = build_model(MODEL, vocab)
    model.load_state_dict(untrained.state_dict())
    windows = stream.unfold(0, MODEL.max_seq_len + 1, 4)
    params = list(model.parameters())
    velocity = [torch.zeros_like(p) for p in params]
    # SGD with momentum written out: torch.optim's first use imports torch._dynamo (seconds).
    for _ in range(40):
        logits = model(windows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), windows[:, 1:].reshape(-1))
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, v, g in zip(params, velocity, grads, strict=True):
                v.mul_(0.9).add_(g)
                p.sub_(0.3 * v)
    save_model(model, MODEL, vocab, root / "trained")
    return {"root": root, "eval_file": eval_file, "tokenizer": root / "tokenizer.json"}


def run(setup: dict[str, Path], model: str, out: str, **cfg: object) -> dict:
    out_dir = setup["root"] / out
    out_dir.mkdir()
    config = EvaluateConfig(eval_files=[str(setup["eval_file"])], **cfg)
    return evaluate_model(config, setup["root"] / model, setup["tokenizer"], out_dir)


def test_evaluate_model_reports_perplexities_from_the_adapter(setup: dict[str, Path]) -> None:
    stats = run(setup, "untrained", "out_untrained")

    assert set(stats) == {
        "kiln_heldout/word_perplexity",
        "kiln_heldout/byte_perplexity",
        "kiln_heldout/bits_per_byte",
        "kiln_heldout/num_docs",
        "num_eval_docs",
    }
    assert stats["num_eval_docs"] == stats["kiln_heldout/num_docs"] == len(TEXTS)
    # lm-eval's aggregates are exactly the adapter's rolling log-likelihoods, normalised.
    lm = KilnLM.from_dirs(setup["root"] / "untrained", setup["tokenizer"])
    assert any(len(lm.encode(t)) > MODEL.max_seq_len for t in TEXTS)  # several windows per doc
    total = sum(lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), 0) for t in TEXTS]))
    words = sum(len(re.split(r"\s+", t)) for t in TEXTS)
    n_bytes = sum(len(t.encode("utf-8")) for t in TEXTS)
    assert stats["kiln_heldout/word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-6)
    assert stats["kiln_heldout/byte_perplexity"] == pytest.approx(math.exp(-total / n_bytes), rel=1e-6)
    assert stats["kiln_heldout/bits_per_byte"] == pytest.approx(-total / n_bytes / math.log(2), rel=1e-6)

    out_dir = setup["root"] / "out_untrained"
    results = json.loads((out_dir / "results.json").read_text())
    assert results["results"]["kiln_heldout"]["word_perplexity,none"] == stats["kiln_heldout/word_perplexity"]
    assert sorted(p.name for p in (out_dir / "tasks").iterdir()) == ["kiln_heldout.docs.jsonl", "kiln_heldout.yaml"]


def test_what_the_libraries_print_goes_to_the_log_file_not_the_terminal(setup: dict[str, Path], capfd) -> None:
    import datasets

    terminal = io.StringIO()  # datasets' own handler, on the stderr it saw at import (INFO: as verbose as it gets)
    datasets.utils.logging.get_logger().addHandler(own := logging.StreamHandler(terminal))
    try:
        run(setup, "trained", "quiet")
    finally:
        datasets.utils.logging.get_logger().removeHandler(own)
    out, err = capfd.readouterr()
    assert out == "" and err == "" and terminal.getvalue() == ""  # it was "Generating test split", progress bars
    log = (setup["root"] / "quiet" / "libraries.log").read_text()
    assert "Generating test split" in log and "100%" in log and "datasets" in log

    stderr, logger = sys.stderr, logging.getLogger("lm_eval")
    # as it was before the block (an earlier test in this process may have configured lm_eval's logging)
    before = (list(logger.handlers), logger.propagate, logger.level)
    with pytest.raises(RuntimeError), library_output_to(setup["root"] / "failing.log"):
        logger.info("building")
        raise RuntimeError("a library call failed")  # reported once, by whoever handles it, not in the log
    assert sys.stderr is stderr and (list(logger.handlers), logger.propagate, logger.level) == before
    assert "lm_eval: building" in (setup["root"] / "failing.log").read_text()


def test_choice_and_line_tasks_score_as_the_adapter_does(setup: dict[str, Path], tmp_path: Path) -> None:
    # TEXTS are one-sentence passages: room for 4 words of passage and 3 of continuation.
    code = tmp_path / "code.jsonl"
    code.write_text("".join(json.dumps({"id": f"c{i}", "text": text, "domain": "code"}) + "\n" for i, text in enumerate([
        "def area(width, height):\n    product = width * height\n    return product\n",
        "import os\n\ndef home():\n    path = os.path.expanduser('~')\n    return path\n",
    ])))
    out = tmp_path / "out"
    out.mkdir()
    config = EvaluateConfig(eval_files=[str(setup["eval_file"]), str(code)],
                            choice={"context_words": 4, "continuation_words": 3})
    stats = evaluate_model(config, setup["root"] / "trained", setup["tokenizer"], out)
    results = json.loads((out / "results.json").read_text())
    assert results["kiln_skipped_tasks"] == {"kiln_code_choice": "fewer than 4 documents of at least 7 words "
                                             "(evaluate.choice: num_choices, context_words + continuation_words)"}
    lm = KilnLM.from_dirs(setup["root"] / "trained", setup["tokenizer"])

    def items(task: str) -> list[dict]:
        return [json.loads(line) for line in (out / "tasks" / f"{task}.docs.jsonl").read_text().splitlines()]

    choice = items("kiln_heldout_choice")
    assert stats["kiln_heldout_choice/num_docs"] == len(choice) == 2 * len(TEXTS)
    correct = correct_norm = 0
    for item in choice:
        scores = [lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, (item["context"], c), 0)
                                                   for c in item["choices"]])]
        correct += max(range(len(scores)), key=scores.__getitem__) == item["label"]
        normed = [lp / len(c) for lp, c in zip(scores, item["choices"], strict=True)]
        correct_norm += max(range(len(normed)), key=normed.__getitem__) == item["label"]
    assert stats["kiln_heldout_choice/acc"] == pytest.approx(correct / len(choice))
    assert stats["kiln_heldout_choice/acc_norm"] == pytest.approx(correct_norm / len(choice))
    assert stats["kiln_heldout_choice/acc"] > 0.5  # 40 steps on these very texts: mostly right, chance is 0.25

    lines = items("kiln_code_lines")
    assert [(i["id"], i["target"]) for i in lines] == [("c0:2", " = width * height"), ("c0:3", " product"),
                                                         ("c1:3", " home():"), ("c1:5", " path")]
    generated = lm.generate_until([Instance("generate_until", {}, (i["context"], {"until": ["\n"], "max_gen_toks": 24}), 0)
                                   for i in lines])
    matches = [g.strip() == i["target"].strip() for g, i in zip(generated, lines, strict=True)]
    assert stats["kiln_code_lines/exact_match"] == pytest.approx(sum(matches) / len(lines))
    assert results["versions"]["kiln_code_lines"].startswith("1+")


def test_trained_model_has_lower_perplexity(setup: dict[str, Path]) -> None:
    untrained = run(setup, "untrained", "cmp_untrained")
    trained = run(setup, "trained", "cmp_trained")
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert math.isfinite(trained[f"kiln_heldout/{metric}"])
        assert trained[f"kiln_heldout/{metric}"] < untrained[f"kiln_heldout/{metric}"]
    # 40 steps on the text itself cut byte perplexity by far more than noise.
    assert trained["kiln_heldout/byte_perplexity"] < 0.5 * untrained["kiln_heldout/byte_perplexity"]


def test_limit_and_relative_paths(setup: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(setup["root"])
    out_dir = setup["root"] / "out_limit"
    out_dir.mkdir()
    config = EvaluateConfig(eval_files=["evals/heldout.jsonl"], limit=1)
    stats = evaluate_model(config, setup["root"] / "trained", setup["tokenizer"], out_dir)
    assert stats["num_eval_docs"] == 1


def test_missing_eval_file_names_the_config_key(setup: dict[str, Path], tmp_path: Path) -> None:
    config = EvaluateConfig(eval_files=[str(tmp_path / "nope.jsonl")])
    with pytest.raises(InputError, match=r"evaluate\.eval_files: .*nope\.jsonl"):
        evaluate_model(config, setup["root"] / "trained", setup["tokenizer"], tmp_path)


def test_duplicate_task_names_rejected(setup: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "heldout.jsonl"
    other.write_text('{"text": "x"}\n')
    config = EvaluateConfig(eval_files=[str(setup["eval_file"]), str(other)])
    with pytest.raises(ConfigError, match="duplicate task names"):
        evaluate_model(config, setup["root"] / "trained", setup["tokenizer"], tmp_path)


def test_unknown_wanted_task_is_a_config_error(setup: dict[str, Path], tmp_path: Path) -> None:
    config = EvaluateConfig(eval_files=[str(setup["eval_file"])])
    with pytest.raises(ConfigError, match=r"eval tasks \['no_such_task'\] are not in the configured suite"):
        evaluate_model(config, setup["root"] / "trained", setup["tokenizer"], tmp_path, tasks=["no_such_task"])


@pytest.mark.slow
def test_unknown_extra_task_names_the_config_key(setup: dict[str, Path], tmp_path: Path) -> None:
    # Slow: naming any built-in task makes lm-eval index all of them (~7-20 s).
    config = EvaluateConfig(eval_files=[str(setup["eval_file"])], extra_tasks=["hellaswag", "no_such_task"])
    with pytest.raises(ConfigError, match=r"evaluate\.extra_tasks: \['no_such_task'\]"):
        evaluate_model(config, setup["root"] / "trained", setup["tokenizer"], tmp_path)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="limit"):
        EvaluateConfig(limit=0)
    with pytest.raises(ValueError, match="extra_task"):
        EvaluateConfig(extra_task=["hellaswag"])


def test_batch_size_is_a_runtime_field() -> None:
    assert "batch_size" not in EvaluateConfig().identity()
    assert EvaluateConfig(batch_size=2).identity() == EvaluateConfig().identity()


def test_cli_model_args(setup: dict[str, Path]) -> None:
    args = f"model_dir={setup['root'] / 'trained'},tokenizer={setup['tokenizer']}"
    lm = KilnLM.create_from_arg_string(args, {"batch_size": 3, "device": None})
    assert (lm.max_length, lm.batch_size) == (MODEL.max_seq_len, 3)
    assert lm.eos_id == Tokenizer.from_file(str(setup["tokenizer"])).token_to_id(EOS)
    assert KilnLM.create_from_arg_string(args + ",batch_size=5").batch_size == 5
    with pytest.raises(ValueError, match=r"missing \['tokenizer'\]"):
        KilnLM.create_from_arg_string(f"model_dir={setup['root'] / 'trained'}")
