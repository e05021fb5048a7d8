"""A run killed with SIGKILL at a random step and resumed gives a bit-identical loss curve."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("train_worker.py")
REPO = Path(__file__).resolve().parents[3]
STEPS, EVERY = 40, 4


def write_corpus(root: Path) -> Path:
    rng = np.random.default_rng(0)
    domains = {}
    for name in ("a", "b"):
        for split, size in (("train", 20_000), ("val", 2_000)):
            path = root / name / f"{split}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            # a learnable but not trivial stream: a noisy cyclic pattern
            tokens = (np.arange(size) * 7 + rng.integers(0, 3, size)) % 97
            tokens.astype(np.uint16).tofile(path)
        domains[name] = {"weight": 0.5, "token_budget": 0, "num_tokens": 20_000, "epochs": 0.0,
                         "train": [f"{name}/train.bin"], "val": [f"{name}/val.bin"]}
    manifest = root / "mixture.json"
    manifest.write_text(json.dumps({"format": 1, "dtype": "uint16", "vocab_size": 97, "eos_id": 0, "seq_len": 32,
                                    "domains": domains}))
    return manifest


def spec_for(tmp: Path, manifest: Path, out_dir: Path) -> Path:
    spec = {"model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": 32},
            "optim": {"lr": 3e-3, "warmup_steps": 4},
            "run": {"steps": STEPS, "batch_size": 4, "seq_len": 32, "eval_batches": 1, "checkpoint_every": EVERY,
                    "keep_checkpoints": 2, "num_threads": 1},
            "manifest": str(manifest), "root": str(manifest.parent), "out_dir": str(out_dir)}
    path = tmp / f"spec-{out_dir.name}.json"
    path.write_text(json.dumps(spec))
    return path


def run(spec: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(WORKER), str(spec)], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def completed_steps(out_dir: Path) -> int:
    root = out_dir / "checkpoints"
    done = [int(p.name.split("_")[1]) for p in root.glob("step_*") if (p / "COMPLETE").exists()] if root.exists() else []
    return max(done, default=0)


def test_sigkill_at_random_step_then_resume_is_bit_identical(tmp_path):
    manifest = write_corpus(tmp_path / "data")
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    reference = run(spec_for(tmp_path, manifest, reference_dir))
    kill_after = random.Random(1234).randrange(EVERY, STEPS - EVERY, EVERY)  # a checkpoint step, then a bit more

    victim = run(spec_for(tmp_path, manifest, killed_dir))
    deadline = time.monotonic() + 120
    while completed_steps(killed_dir) < kill_after and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert victim.poll() is None, "the run finished before it could be killed; lower kill_after"
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL
    killed_at = completed_steps(killed_dir)
    assert EVERY <= killed_at < STEPS and not (killed_dir / "metrics.json").exists()

    resumed = run(spec_for(tmp_path, manifest, killed_dir))
    assert resumed.wait(timeout=180) == 0, resumed.stderr.read().decode()[-2000:]
    assert reference.wait(timeout=180) == 0, reference.stderr.read().decode()[-2000:]
    expected = json.loads((reference_dir / "metrics.json").read_text())
    got = json.loads((killed_dir / "metrics.json").read_text())
    assert got["resumed_from_step"] == killed_at
    assert got["loss_curve"] == expected["loss_curve"]  # exact float equality, every step
    assert got["val_loss_by_domain"] == expected["val_loss_by_domain"]
    assert len(got["loss_curve"]) == STEPS
