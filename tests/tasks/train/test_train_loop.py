"""The training loop end to end on tiny real shards: learning, determinism, resume, outputs."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.tasks.errors import InputError
from kiln.tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig
from kiln.tasks.train.data_loader import Mixture, validation_batches
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.model import count_parameters, flops_per_token, load_model
from kiln.tasks.train.trainer import evaluate

V = 64
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=5)
RUN = TrainRunConfig(
    steps=30, batch_size=4, seq_len=16, eval_batches=2,
    checkpoint_every=10, keep_checkpoints=2, log_every=10, num_threads=1,
)


def write_mixture(root: Path) -> Mixture:
    """Two domains of learnable periodic patterns (period 7 and 11), eos-terminated documents."""
    domains = {}
    for name, period, offset in (("web", 7, 1), ("code", 11, 20)):
        doc = np.concatenate([offset + np.arange(period * 30) % period, [0]])
        tokens = np.tile(doc, 4).astype("<u2")
        rel = Path("shards") / name
        (root / rel).mkdir(parents=True)
        tokens.tofile(root / rel / "train.bin")
        tokens[: len(tokens) // 4].tofile(root / rel / "val.bin")
        domains[name] = {"weight": 0.5, "train": [str(rel / "train.bin")], "val": [str(rel / "val.bin")]}
    manifest = {"format": 1, "dtype": "uint16", "vocab_size": V, "eos_id": 0, "seq_len": 16, "domains": domains}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return Mixture.from_manifest(root / "manifest.json", root)


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Mixture:
    return write_mixture(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def full_run(mixture, tmp_path_factory):
    """One uninterrupted 30-step run, shared by the tests that compare against it."""
    out = tmp_path_factory.mktemp("full")
    logged: list[tuple[int, dict[str, float]]] = []
    result = train_model(MODEL, OPTIM, RUN, mixture, out, on_metrics=lambda s, m: logged.append((s, m)))
    return out, result, logged


def test_learns_the_pattern_and_writes_outputs(full_run, mixture) -> None:
    out, result, logged = full_run
    losses = [loss for _, loss in result.loss_curve]
    assert [s for s, _ in result.loss_curve] == list(range(1, 31))
    assert losses[0] > 3.5  # about ln(64) = 4.16 at init
    assert result.final_train_loss < 1.0
    assert result.val_loss < 1.0 and set(result.val_loss_by_domain) == {"web", "code"}
    assert result.val_loss == pytest.approx(sum(result.val_loss_by_domain.values()) / 2)
    assert result.tokens_seen == 30 * 4 * 16
    assert result.num_params == count_parameters(MODEL, V)
    assert result.resumed_from_step is None
    assert result.lr_curve[0] == (1, pytest.approx(2e-3)) and result.lr_curve[4] == (5, pytest.approx(1e-2))
    assert result.lr_curve[-1] == (30, pytest.approx(1e-3))
    # checkpoints kept: the last two
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000020", "step_0000030"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert "model_dir" not in metrics and metrics["loss_curve"][0] == [1, losses[0]]
    assert [s for s, _ in logged] == [10, 20, 30, 30]
    # no peak_tflops configured: no MFU
    assert set(logged[0][1]) == {"loss", "lr", "grad_norm", "tokens_per_s", "peak_memory_mb"}
    assert logged[0][1]["peak_memory_mb"] > 50  # max RSS of this process: torch alone is more
    assert logged[0][1]["loss"] == losses[9]
    per_domain = {f"val_loss/{d}": v for d, v in result.val_loss_by_domain.items()}
    assert logged[-1][1] == {"val_loss": result.val_loss, **per_domain}
    # the saved model reproduces the reported validation loss
    model, cfg = load_model(result.model_dir)
    assert cfg == MODEL and model.vocab_size == V
    batches = validation_batches(mixture, RUN.seq_len, RUN.eval_batches, RUN.batch_size)
    # exactly: the loop's own evaluation of these weights, on this machine (fresh runs are bit-identical)
    assert evaluate(model, batches, torch.device("cpu")) == result.val_loss_by_domain
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert result.num_rollbacks == 0 and result.health_events == []


def test_deterministic(full_run, mixture, tmp_path) -> None:
    _, first, _ = full_run
    rerun = train_model(MODEL, OPTIM, RUN, mixture, tmp_path)
    # exact float equality by design: a fresh run of one config on one machine repeats every step bit for bit
    assert rerun.loss_curve == first.loss_curve
    assert rerun.val_loss_by_domain == first.val_loss_by_domain


class Crash(Exception):
    """Stands in for the process dying mid-run."""


def test_resume_is_bit_identical(full_run, mixture, tmp_path) -> None:
    _, full, _ = full_run

    def crash_at_25(step: int, metrics: dict[str, float]) -> None:
        if step == 25:
            raise Crash

    # log_every is a runtime setting: it may differ between attempts without changing the run
    with pytest.raises(Crash):
        train_model(MODEL, OPTIM, RUN.model_copy(update={"log_every": 5}), mixture, tmp_path, on_metrics=crash_at_25)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000010", "step_0000020"]
    resumed = train_model(MODEL, OPTIM, RUN, mixture, tmp_path)
    assert resumed.resumed_from_step == 20
    assert resumed.loss_curve == full.loss_curve
    assert resumed.lr_curve == full.lr_curve
    assert resumed.val_loss_by_domain == full.val_loss_by_domain


def test_a_resumed_run_logs_each_step_once(mixture, tmp_path) -> None:
    def crash_at_25(step: int, metrics: dict[str, float]) -> None:
        if step == 25:
            raise Crash

    every_5 = RUN.model_copy(update={"log_every": 5})
    with pytest.raises(Crash):
        train_model(MODEL, OPTIM, every_5, mixture, tmp_path, on_metrics=crash_at_25)
    assert train_model(MODEL, OPTIM, every_5, mixture, tmp_path).resumed_from_step == 20
    logged = [json.loads(line)["step"] for line in (tmp_path / "train_metrics.jsonl").read_text().splitlines()]
    assert logged == [5, 10, 15, 20, 25, 30]  # the first attempt's step 25, past its checkpoint, is not kept twice


def test_corrupt_latest_checkpoint_falls_back(full_run, mixture, tmp_path) -> None:
    out, full, _ = full_run
    shutil.copytree(out / "checkpoints", tmp_path / "checkpoints")
    state = tmp_path / "checkpoints" / "step_0000030" / "__0_0.distcp"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.warns(UserWarning, match="step_0000030 is incomplete or corrupt"):
        resumed = train_model(MODEL, OPTIM, RUN, mixture, tmp_path)
    assert resumed.resumed_from_step == 20
    assert resumed.loss_curve == full.loss_curve


def test_resume_refuses_other_config(full_run, mixture, tmp_path) -> None:
    out, _, _ = full_run
    shutil.copytree(out / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(ValueError, match="different config"):
        train_model(MODEL, OPTIM.model_copy(update={"lr": 1e-3}), RUN, mixture, tmp_path)


def test_grad_accum_sees_the_same_rows(mixture, tmp_path) -> None:
    one = RUN.model_copy(update={"steps": 3, "batch_size": 4})
    two = RUN.model_copy(update={"steps": 3, "batch_size": 4, "grad_accum": 2})
    a = train_model(MODEL, OPTIM, one, mixture, tmp_path / "a")
    b = train_model(MODEL, OPTIM, two, mixture, tmp_path / "b")
    assert a.tokens_seen == b.tokens_seen
    # same data, only the summation order differs
    assert [s for s, _ in b.loss_curve] == [1, 2, 3]
    assert [l for _, l in b.loss_curve] == pytest.approx([l for _, l in a.loss_curve], rel=1e-4)


def test_init_model_dir_continues_from_weights(full_run, mixture, tmp_path) -> None:
    _, full, _ = full_run
    anneal = OptimConfig(lr=1e-3, warmup_steps=0, schedule="linear", min_lr_ratio=0.0)
    run = RUN.model_copy(update={"steps": 5})
    result = train_model(MODEL, anneal, run, mixture, tmp_path, init_model_dir=full.model_dir)
    # starts from the trained model's loss level, not from ln(V)
    assert result.loss_curve[0][1] < 1.0
    assert result.lr_curve[-1] == (5, 0.0)
    with pytest.raises(ValueError, match="use the same model section"):
        train_model(MODEL.model_copy(update={"d_model": 64}), anneal, run, mixture, tmp_path / "x",
                    init_model_dir=full.model_dir)


def test_seq_len_longer_than_model_is_rejected(mixture, tmp_path) -> None:
    with pytest.raises(ValueError, match="seq_len=64 exceeds model.max_seq_len=32"):
        train_model(MODEL, OPTIM, RUN.model_copy(update={"seq_len": 64}), mixture, tmp_path)


def test_restores_global_torch_settings(mixture, tmp_path) -> None:
    threads = torch.get_num_threads()
    train_model(MODEL, OPTIM, RUN.model_copy(update={"steps": 1}), mixture, tmp_path)
    assert torch.get_num_threads() == threads
    assert not torch.are_deterministic_algorithms_enabled()


def test_no_validation_data_fails_before_training(mixture, tmp_path) -> None:
    empty = tmp_path / "empty-val.bin"
    empty.write_bytes(b"")
    short = Mixture(
        domains={n: replace(d, val=(empty,)) for n, d in mixture.domains.items()},
        dtype=mixture.dtype, vocab_size=mixture.vocab_size, eos_id=mixture.eos_id,
    )
    with pytest.warns(UserWarning, match="validation has 0 tokens"):
        with pytest.raises(InputError, match="larger val split"):
            train_model(MODEL, OPTIM, RUN, short, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()
    # No val shards at all (as an anneal's quality selection has): skipped without a warning, still refused
    none = Mixture(domains={n: replace(d, val=()) for n, d in mixture.domains.items()},
                   dtype=mixture.dtype, vocab_size=mixture.vocab_size, eos_id=mixture.eos_id)
    with pytest.raises(InputError, match="larger val split"):
        train_model(MODEL, OPTIM, RUN, none, tmp_path / "run2")


def test_mfu_from_peak_tflops(mixture, tmp_path) -> None:
    logged: list[tuple[int, dict[str, float]]] = []
    run = RUN.model_copy(update={"steps": 2, "log_every": 1, "peak_tflops": 0.5})
    train_model(MODEL, OPTIM, run, mixture, tmp_path, on_metrics=lambda s, m: logged.append((s, m)))
    m = logged[0][1]
    assert m["mfu"] == pytest.approx(flops_per_token(MODEL, V, 16) * m["tokens_per_s"] / 0.5e12)
    assert 0 < m["mfu"] < 1


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_losses(full_run, mixture, tmp_path, mode) -> None:
    _, full, _ = full_run  # checkpointing "none"
    run = RUN.model_copy(update={"steps": 5, "activation_checkpointing": mode})
    result = train_model(MODEL, OPTIM, run, mixture, tmp_path)
    assert [s for s, _ in result.loss_curve] == [1, 2, 3, 4, 5]
    assert [l for _, l in result.loss_curve] == pytest.approx([l for _, l in full.loss_curve[:5]], abs=1e-6)
    # parameter names are unchanged, so checkpoints and saved models are interchangeable
    assert set(torch.load(result.model_dir / "model.pt", weights_only=True)) == set(
        torch.load(full.model_dir / "model.pt", weights_only=True))


def test_z_loss_shapes_gradients_not_the_reported_loss(full_run, mixture, tmp_path) -> None:
    _, full, _ = full_run
    run = RUN.model_copy(update={"steps": 10})
    result = train_model(MODEL, OPTIM.model_copy(update={"z_loss": 0.1}), run, mixture, tmp_path)
    # step 1's loss is measured before any update: the same cross-entropy; later weights differ
    assert result.loss_curve[0] == full.loss_curve[0] and result.loss_curve[1] != full.loss_curve[1]

    def mean_log_z_squared(model_dir: Path) -> float:
        model, _ = load_model(model_dir)
        x, _ = validation_batches(mixture, RUN.seq_len, 1, RUN.batch_size)["web"][0]
        with torch.inference_mode():
            return torch.logsumexp(model(x), dim=-1).square().mean().item()

    # the same 10 steps without it (the full run's weights at step 10 are not saved as a model)
    plain = train_model(MODEL, OPTIM, run, mixture, tmp_path / "plain")
    assert mean_log_z_squared(result.model_dir) < 0.95 * mean_log_z_squared(plain.model_dir)  # 14.3 vs 15.8
    assert OPTIM.model_copy(update={"z_loss": 0.1}).identity() != OPTIM.identity()


def test_loop_options_are_runtime_settings() -> None:
    options = {"activation_checkpointing": "full", "compile": True, "peak_tflops": 989.0, "keep_every": 1000}
    assert RUN.model_copy(update=options).identity() == RUN.identity()


def test_keep_every_keeps_milestone_checkpoints(mixture, tmp_path) -> None:
    run = RUN.model_copy(update={"steps": 30, "checkpoint_every": 5, "keep_checkpoints": 1, "keep_every": 10})
    train_model(MODEL, OPTIM, run, mixture, tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_0000010", "step_0000020", "step_0000030"]


@pytest.mark.slow
def test_compile_is_wired(full_run, mixture, tmp_path) -> None:
    _, full, _ = full_run
    run = RUN.model_copy(update={"steps": 2, "compile": True})
    try:
        result = train_model(MODEL, OPTIM, run, mixture, tmp_path)
    except Exception as e:  # noqa: BLE001 - inductor needs a working C++ toolchain
        if "compiler" in str(e).lower() or "InductorError" in type(e).__name__:
            pytest.skip(f"torch.compile cannot build kernels here: {e}")
        raise
    assert [l for _, l in result.loss_curve] == pytest.approx([l for _, l in full.loss_curve[:2]], rel=1e-4)
