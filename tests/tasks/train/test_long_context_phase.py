"""A long-context extension phase: the length-aware selection (exact counts), the rotary settings applied
when the phase starts and on resume, the model built for the longest phase, and the done-when check of
issue 33: after the extension on a tiny model, the loss past the old max_seq_len falls against the
pre-extension model (loss by position bucket and passkeys, `tasks.evals.long_context`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from kiln.tasks.constants import DOC_INDEX_SUFFIX
from kiln.tasks.errors import ConfigError
from kiln.tasks.evals.categories import _FILLER
from kiln.tasks.evals.long_context import bucket_spans, extension_reports, tokenizer_view
from kiln.tasks.stages.train import TrainConfig, with_longest_phase
from kiln.tasks.train.checkpoint import BEFORE_PHASE_DIR, checkpoint_dir
from kiln.tasks.train.config import (
    DataPhase,
    LongDocuments,
    ModelConfig,
    OptimConfig,
    RopeScaling,
    TrainRunConfig,
)
from kiln.tasks.train.data_loader import Mixture, write_manifest
from kiln.tasks.train.data_schedule import SCHEDULE_DIR, scheduled_mixture
from kiln.tasks.train.dcp import checkpoint_model, read_train_state
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.model import read_model_config, rope_tables
from kiln.tasks.train.trainer import TrainCallback

V = 64


def write_documents(root: Path, docs: dict[str, list[np.ndarray]]) -> Mixture:
    """One domain `web`: each split's documents (eos 0 appended) with their document index."""
    (root / "web").mkdir(parents=True)
    for split, split_docs in docs.items():
        with_eos = [np.append(d, 0) for d in split_docs]
        np.concatenate(with_eos).astype("<u2").tofile(root / "web" / f"{split}.bin")
        index = np.zeros(len(with_eos), dtype=[("end", "<i8"), ("quality", "<f8")])
        index["end"], index["quality"] = np.cumsum([len(d) for d in with_eos]), np.nan
        np.save(root / "web" / f"{split}{DOC_INDEX_SUFFIX}", index)
    manifest = {"format": 1, "dtype": "uint16", "vocab_size": V, "eos_id": 0,
                "domains": {"web": {"weight": 1.0, "train": ["web/train.bin"], "val": ["web/val.bin"]}}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return Mixture.from_manifest(root / "manifest.json", root)


def test_long_documents_are_upweighted_with_exact_counts(tmp_path) -> None:
    # documents of 5, 50, 10 and 60 tokens (+ eos): with min_tokens 40 the 51- and 61-token ones are long
    docs = [np.full(n, t) for n, t in ((5, 1), (50, 2), (10, 3), (60, 4))]
    base = write_documents(tmp_path / "data", {"train": docs, "val": docs})
    run = TrainRunConfig(steps=10, batch_size=2, seq_len=8)
    phases = [DataPhase(name="short", until_step=4),
              DataPhase(name="long", seq_len=32, long_documents=LongDocuments(min_tokens=40, upweight=3))]
    mixture = scheduled_mixture(base, phases, run, tmp_path / "run")
    short, long = mixture.phases
    assert short.long_documents is None and short.domains["web"].train == base.domains["web"].train
    assert long.long_documents == {"min_tokens": 40, "upweight": 3, "by_domain": {
        "web": {"long_documents": 2, "long_tokens": 51 + 61, "other_tokens": 6 + 11}}}
    (stream,) = long.domains["web"].train
    assert stream == tmp_path / "run" / SCHEDULE_DIR / "long" / "web.bin"
    tokens = np.fromfile(stream, dtype="<u2")
    # every document once in corpus order, then the long ones twice more, a pass apart
    expected = np.concatenate([np.append(d, 0) for d in docs + [docs[1], docs[3]] * 2])
    assert np.array_equal(tokens, expected)
    assert len(tokens) == 6 + 11 + 3 * (51 + 61)
    assert {t: int((tokens == t).sum()) for t in (1, 2, 3, 4)} == {1: 5, 2: 150, 3: 10, 4: 180}
    # deterministic: the same config writes the same bytes; the manifest keeps the selection
    assert scheduled_mixture(base, phases, run, tmp_path / "again").phases[1].long_documents == long.long_documents
    assert np.array_equal(np.fromfile(tmp_path / "again" / SCHEDULE_DIR / "long" / "web.bin", dtype="<u2"), tokens)
    manifest = write_manifest(mixture, tmp_path / "m.json", tmp_path)
    assert Mixture.from_manifest(manifest, tmp_path) == mixture


def test_extension_settings_are_checked_and_keys_do_not_move() -> None:
    plain = DataPhase(name="a")
    assert set(plain.identity()) == {"name", "until_step", "until_tokens", "mixture", "order", "seq_len"}
    with pytest.raises(ValueError, match="order quality walks each document once"):
        DataPhase(name="b", order="quality", long_documents=LongDocuments(min_tokens=8))
    with pytest.raises(ValueError, match=r"train.phases\[1\] \('long'\) sets rope_theta / rope_scaling, but "
                                         r"model.position='alibi'"):
        TrainConfig(model=ModelConfig(position="alibi"),
                    phases=[DataPhase(name="a", until_step=2), DataPhase(name="long", rope_theta=5e5)])
    run = TrainRunConfig(seq_len=128)
    phases = [DataPhase(name="a", until_step=2), DataPhase(name="long", seq_len=512, rope_theta=5e5)]
    model = ModelConfig(max_seq_len=128)
    assert with_longest_phase(model, run, phases).max_seq_len == 512  # the phase raises it, x4
    assert with_longest_phase(model, run, phases[:1]) is model
    with pytest.raises(ConfigError, match="model.position='learned' has no embedding past it"):
        with_longest_phase(ModelConfig(max_seq_len=128, position="learned"), run,
                           [DataPhase(name="a", until_step=2), DataPhase(name="long", seq_len=512)])


class RopeSeen(TrainCallback):
    """The model's cos table as each step trains."""

    def __init__(self) -> None:
        self.cos: dict[int, torch.Tensor] = {}

    def pre_step(self, trainer, batch) -> None:
        self.cos[batch.step] = trainer.model.rope_cos.clone()


MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
SCALING = RopeScaling(kind="yarn", factor=4, original_max_seq_len=8)
EXTENSION = [DataPhase(name="short", until_step=4, seq_len=8),
             DataPhase(name="long", seq_len=32, rope_theta=50000.0, rope_scaling=SCALING),
             ]
RUN = TrainRunConfig(steps=8, batch_size=2, seq_len=8, eval_batches=1, checkpoint_every=2, keep_checkpoints=10,
                     log_every=4, num_threads=1)


def test_rope_changes_when_the_phase_starts_and_on_resume(tmp_path) -> None:
    docs = [np.arange(1, 1 + n) % (V - 1) + 1 for n in (40, 70, 30, 90)]
    base = write_documents(tmp_path / "data", {"train": docs * 3, "val": docs})
    mixture = scheduled_mixture(base, EXTENSION, RUN, tmp_path / "sched")
    assert mixture.phases[1].rope == {"rope_theta": 50000.0, "rope_scaling": SCALING.model_dump(mode="json")}
    extended = MODEL.model_copy(update={"rope_theta": 50000.0, "rope_scaling": SCALING})
    base_cos, long_cos = rope_tables(MODEL)[0], rope_tables(extended)[0]
    assert not torch.equal(base_cos, long_cos)

    seen = RopeSeen()
    full = train_model(MODEL, OptimConfig(warmup_steps=1), RUN, mixture, tmp_path / "full", callbacks=[seen])
    assert all(torch.equal(seen.cos[s], base_cos) for s in range(1, 5))
    assert all(torch.equal(seen.cos[s], long_cos) for s in range(5, 9))
    # the saved models say which positions they were trained with
    assert read_model_config(tmp_path / "full" / "model")[0] == extended
    assert read_model_config(tmp_path / "full" / BEFORE_PHASE_DIR / "long")[0] == MODEL
    # and so do the checkpoints (what continuous eval, export and an anneal from a step build)
    steps = {s: ModelConfig.model_validate(checkpoint_model(read_train_state(checkpoint_dir(
        tmp_path / "full" / "checkpoints", s)))) for s in (4, 6)}
    assert steps == {4: MODEL, 6: extended}

    # stopped at the boundary (its checkpoint holds the short phase's last step), resumed: the resumed
    # attempt's first step already has the extended tables, and the run is bit-identical
    train_model(MODEL, OptimConfig(warmup_steps=1), RUN, mixture, tmp_path / "resumed", stop_after=4)
    again = RopeSeen()
    resumed = train_model(MODEL, OptimConfig(warmup_steps=1), RUN, mixture, tmp_path / "resumed", callbacks=[again])
    assert resumed.resumed_from_step == 4 and sorted(again.cos) == [5, 6, 7, 8]
    assert all(torch.equal(again.cos[s], long_cos) for s in range(5, 9))
    assert resumed.loss_curve == full.loss_curve
    assert resumed.val_loss_by_domain == full.val_loss_by_domain
    # resumed inside the phase (from step 6): the model is built with the model's own tables, then given the phase's
    train_model(MODEL, OptimConfig(warmup_steps=1), RUN, mixture, tmp_path / "inside", stop_after=6)
    inside = train_model(MODEL, OptimConfig(warmup_steps=1), RUN, mixture, tmp_path / "inside")
    assert inside.resumed_from_step == 6 and inside.loss_curve == full.loss_curve


def topic_documents(rng: np.random.Generator, count: int) -> list[np.ndarray]:
    """Documents of 20 or 300 tokens, each drawn from its own two tokens: the next token is guessed from
    the document so far, so the loss at a position depends on how well the model reads earlier positions."""
    return [rng.choice(rng.choice(np.arange(1, V), 2, replace=False), int(n)) for n in rng.choice([20, 300], count)]


def tiny_tokenizer(path: Path) -> Path:
    """A 64-token BPE (the tiny model's vocabulary) trained on the passkey task's filler and digits."""
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator([_FILLER * 3, "The pass key is 0123456789 . " * 3],
                                  trainers.BpeTrainer(vocab_size=V, special_tokens=["<eos>", "[UNK]"]))
    tokenizer.save(str(path))
    return path


def test_the_extension_lowers_the_loss_past_the_old_length(tmp_path) -> None:
    rng = np.random.default_rng(0)
    base = write_documents(tmp_path / "data", {"train": topic_documents(rng, 400), "val": topic_documents(rng, 40)})
    run = TrainRunConfig(steps=160, batch_size=8, seq_len=32, eval_batches=2, checkpoint_every=1000, log_every=1000,
                         num_threads=1)
    phases = [DataPhase(name="short", until_step=80),  # max_seq_len 32 ...
              DataPhase(name="long", seq_len=128, rope_theta=40000.0,  # ... x4, with a new rotary base
                        long_documents=LongDocuments(min_tokens=128, upweight=4))]
    model = with_longest_phase(ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32), run, phases)
    mixture = scheduled_mixture(base, phases, run, tmp_path / "run")
    result = train_model(model, OptimConfig(lr=1e-2, warmup_steps=5), run, mixture, tmp_path / "run")

    # as the evaluate stage reads it: the tokenize stage's shards and tokenizer, the train stats' phases
    shards = {"dtype": "uint16", "vocab_size": V, "eos_id": 0, "domains": {"web": {
        split: {"shards": [{"path": f"web/{split}.bin"}]} for split in ("train", "val")}}}
    view = tokenizer_view(tiny_tokenizer(tmp_path / "tokenizer.json"), 128)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reports = extension_reports(tmp_path / "run", result.phases, tmp_path / "run" / BEFORE_PHASE_DIR, view,
                                    shards, tmp_path / "data", per_domain=16)
    finally:
        torch.set_num_threads(threads)
    (report,) = reports.values()
    assert list(reports) == ["long"] and (report["old_seq_len"], report["seq_len"], report["windows"]) == (32, 128, 16)
    assert bucket_spans(32, 128, 3) == [(0, 32), (32, 64), (64, 96), (96, 128)]
    before, after = report["before"]["loss_by_position"], report["after"]["loss_by_position"]
    assert list(before) == ["tokens 0-32", "tokens 32-64", "tokens 64-96", "tokens 96-128"]
    assert (report["before"]["rope_theta"], report["after"]["rope_theta"]) == (10000.0, 40000.0)
    for bucket in ("tokens 32-64", "tokens 64-96", "tokens 96-128"):
        assert after[bucket] < before[bucket] - 0.05, (bucket, before, after)
    assert report["past_old_len_falls"] is True
    for side in ("before", "after"):  # passkeys at the old length, halfway and the new one, 8 prompts each
        accuracy = report[side]["passkey_accuracy"]
        assert list(accuracy) == ["32 tokens", "80 tokens", "128 tokens"]
        assert all(a * 8 == int(a * 8) and 0 <= a <= 1 for a in accuracy.values())


def test_an_adjustment_extends_the_context_of_a_kept_checkpoint(tmp_path) -> None:
    """A context extension as a segment: the prefix trained at 8 tokens with max_seq_len 8; the branch goes on
    from its step 4 with a longer phase, a model built for 32 tokens and new rotary positions."""
    docs = [np.arange(1, 1 + n) % (V - 1) + 1 for n in (40, 70, 30, 90)]
    base = write_documents(tmp_path / "data", {"train": docs * 3, "val": docs})
    prefix_run = RUN.model_copy(update={"steps": 4})
    short = MODEL.model_copy(update={"max_seq_len": 8})
    train_model(short, OptimConfig(warmup_steps=1), prefix_run, base, tmp_path / "prefix")
    mixture = scheduled_mixture(base, EXTENSION, RUN, tmp_path / "sched")
    seen = RopeSeen()
    branch = train_model(MODEL, OptimConfig(warmup_steps=1), RUN, mixture, tmp_path / "branch", callbacks=[seen],
                         branch_from=tmp_path / "prefix" / "checkpoints" / "step_0000004")
    extended = MODEL.model_copy(update={"rope_theta": 50000.0, "rope_scaling": SCALING})
    assert branch.resumed_from_step == 4 and branch.steps_trained == 4 and sorted(seen.cos) == [5, 6, 7, 8]
    assert all(torch.equal(seen.cos[s], rope_tables(extended)[0]) for s in range(5, 9))
    # the branch saved what it started from as the pre-extension model: the prefix's step-4 weights
    before = torch.load(tmp_path / "branch" / BEFORE_PHASE_DIR / "long" / "model.pt", weights_only=True)
    prefix = torch.load(tmp_path / "prefix" / "model" / "model.pt", weights_only=True)
    assert before.keys() == prefix.keys() and all(torch.equal(before[k], prefix[k]) for k in before)
    assert read_model_config(tmp_path / "branch" / BEFORE_PHASE_DIR / "long")[0] == MODEL
    # learned positions are weights of max_seq_len rows: that model cannot be stretched by a branch
    learned = short.model_copy(update={"position": "learned"})
    train_model(learned, OptimConfig(warmup_steps=1), prefix_run, base, tmp_path / "learned")
    with pytest.raises(ValueError, match="holds another model"):
        train_model(MODEL.model_copy(update={"position": "learned"}), OptimConfig(warmup_steps=1), RUN, base,
                    tmp_path / "learned-branch", branch_from=tmp_path / "learned" / "checkpoints" / "step_0000004")
