"""Smoke test of `benchmarks/train_step_gpu.py`: its CPU code path runs and ends with a parseable RESULT line.

The GPU measurement itself needs an H100/H200; here the tiny preset (with grouped-query attention,
as the benchmark runs it) takes 3 eager bf16-mixed steps under FSDP2 on a one-rank gloo mesh in a
subprocess (as the script is meant to be run), and the refusals are checked in-process.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_step_gpu.py"


@pytest.fixture(scope="module")
def bench():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTORCH_ALLOC_CONF", "")  # keep the script from setting it in the test process
        spec = importlib.util.spec_from_file_location("train_step_gpu", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run_reports_mfu() -> None:
    args = ["--device", "cpu", "--preset", "tiny", "--no-compile", "--vocab", "512", "--seq-len", "64",
            "--batch", "2", "--warmup", "1", "--steps", "3", "--peak-tflops", "0.5"]
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("RESULT train_mfu ")
    mfu = float(lines[-1].split()[-1])
    assert 0 < mfu < 1
    assert "median" in done.stdout and "over 3 steps after 1 warm-up" in done.stdout
    assert "KV heads=1" in done.stdout and "bf16-mixed (FSDP2 on a one-rank mesh)" in done.stdout
    # MFU is the achieved TFLOP/s over the given peak (both printed rounded)
    achieved_tflops = float(next(line for line in lines if line.startswith("achieved")).split()[1])
    assert mfu == pytest.approx(achieved_tflops / 0.5, rel=1e-2, abs=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_it_refuses_with_the_cpu_hint(bench, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args([])
    assert exit_.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cpu", "--preset", "1b"], "--device cpu runs only --preset tiny"),
        (["--device", "cpu", "--preset", "tiny", "--activation-checkpointing", "selective"], "add --no-compile"),
        (["--device", "cpu", "--preset", "tiny", "--batch", "0"], "--batch must be positive"),
    ],
)
def test_bad_arguments_are_refused(bench, capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_peak_table_prefers_the_specific_name(bench) -> None:
    assert bench.peak_tflops_for("NVIDIA H100 80GB HBM3") == 989.0
    assert bench.peak_tflops_for("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_tflops_for("NVIDIA H200") == 989.0
    assert bench.peak_tflops_for("NVIDIA A100-SXM4-80GB") == 312.0
    assert bench.peak_tflops_for("NVIDIA L4") is None
