"""Smoke test of `benchmarks/train_step.py`: a tiny eager run in a subprocess (as the script is meant
to be run) ends with a parseable RESULT line, and the nanoGPT reference is the size it claims."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step.py"
TINY = ["--d-model", "64", "--layers", "2", "--heads", "4", "--seq-len", "32", "--vocab", "512", "--batch", "2",
        "--warmup", "1", "--steps", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("train_step_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *TINY, *args], capture_output=True, text=True, timeout=120)


def test_tiny_eager_run_reports_the_ratio() -> None:
    done = run("--ref-mlp-hidden", "272")  # at d 64, 4 d misses Kiln's count by 3%
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].startswith("parameters: kiln 139,584 (SwiGLU width 192), nanoGPT ")
    assert any(line.startswith("kiln eager / nanoGPT eager: ") for line in lines)
    # the time split: matmuls, attention and the rest, in percent, adding up to 100
    shares = next(line for line in lines if line.startswith("kiln eager ") and line.endswith("%")).split()[2:]
    assert len(shares) == 3 and abs(sum(float(share.rstrip("%")) for share in shares) - 100) < 0.2
    assert lines[-1].startswith("RESULT train_tokens_per_s_ratio ")
    assert float(lines[-1].split()[-1]) > 0


def test_parameter_counts_must_agree() -> None:
    done = run()
    assert done.returncode != 0
    assert "parameter counts differ by more than 1%: set --ref-mlp-hidden" in done.stderr


def test_reference_is_nanogpt_sized(bench) -> None:
    # nanoGPT's default GPT-2 small: 124M parameters with the 50304-token padded vocab
    model = bench.GPT(bench.GPTConfig())
    assert sum(p.numel() for p in model.parameters()) == 124_475_904
    optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cpu")
    decay, no_decay = optimizer.param_groups
    # matmul weights and the (tied) embeddings decay; biases and LayerNorm gains do not
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert optimizer.defaults["fused"] is True


def test_reference_step_trains(bench) -> None:
    torch.manual_seed(0)
    step, _ = bench.reference_step(bench.GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32),
                                   bench.OptimConfig(lr=1e-2), compile=False)
    x, y = torch.randint(0, 64, (2, 4, 16))
    losses = [float(step(x, y)) for _ in range(8)]  # memorising one batch: the loss falls
    assert losses[0] == pytest.approx(math.log(64), rel=0.1)
    assert losses[-1] < losses[0] - 0.5


def test_the_load_benchmark_says_what_each_option_does_its_default_and_how_long_it_takes():
    shown = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "load.py"),
                            "--help"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    options = text.split("options:", 1)[1]
    for option, default in (("--backends", "both"), ("--runs", "8"), ("--workers", "2"), ("--records", "200"),
                            ("--until", "collect"), ("--timeout-s", "1800")):
        assert f"(default: {default})" in options.split(f" {option} ", 1)[1].split(" --", 1)[0], option
    assert "Expected duration:" in text
