"""Sharded DCP checkpoints: a 2-process FSDP2 run stopped mid-way resumes on 1 plain process, also with new shards.

One 2-process torchrun (gloo, CPU) trains the same 10-step run twice: once uninterrupted, once
stopped after step 7 (checkpoints every 3 steps, so the newest is step 6 and step 7 is lost).
Then a single process without torchrun resumes the stopped run twice, from copies of its
checkpoints: with the same mixture, and with a manifest that adds a new domain and shard.

The resumed curve matches the uninterrupted one step for step. Steps 1-6 come from the
checkpoint and are bit-identical; steps 7-10 run on 1 process instead of 2 FSDP ranks, which
only changes float summation order (measured worst relative difference 9.7e-8 on losses, 8.3e-8 on
gradient norms); the tolerances are rtol=1e-5 and 1e-4, as in test_parallel. The two launches
take 13-25 s on 2 cores, hence `slow`. Each step's global-batch checksum is recorded, so a skipped or
repeated step would show as a mismatch.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig
from kiln.tasks.train.data_loader import Mixture, batch_for_step, batch_sources
from kiln.tasks.train.dcp import load_latest_dcp, save_dcp
from kiln.tasks.train.distributed import batch_checksum, make_optimizer
from kiln.tasks.train.model import build_model, count_parameters, load_model
from kiln.tasks.train.parallel import ParallelDims

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = Path(sys.executable).parent / "torchrun"
V = 64
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=3)
RUN = TrainRunConfig(
    steps=10, batch_size=4, grad_accum=2, seq_len=16, eval_batches=1, log_every=1, num_threads=1,
    checkpoint_every=3, keep_checkpoints=2,
)
ROWS = RUN.batch_size
STOP = 7
LOSS_RTOL = 1e-5
FSDP = ParallelDims(dp=2)
PLAIN = ParallelDims()
# torchrun's variables must not leak in: without them dist_worker runs as a group of one
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")},
    "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO),
}


def write_data(root: Path) -> None:
    """`web.json`: one domain of period-9 documents; `web_code.json`: the same plus a new
    `code` domain (period-7 documents over other token ids, in a new shard), half the weight each."""
    web = np.tile(np.concatenate([1 + np.arange(9 * 20) % 9, [0]]), 4).astype("<u2")
    code = np.tile(np.concatenate([20 + np.arange(7 * 20) % 7, [0]]), 4).astype("<u2")
    for name, tokens in (("web", web), ("code", code)):
        tokens.tofile(root / f"{name}.bin")
        tokens[:200].tofile(root / f"{name}_val.bin")

    def domain(name: str, weight: float) -> dict:
        return {"weight": weight, "train": [f"{name}.bin"], "val": [f"{name}_val.bin"]}

    base = {"format": 1, "dtype": "uint16", "vocab_size": V, "eos_id": 0}
    (root / "web.json").write_text(json.dumps({**base, "domains": {"web": domain("web", 1.0)}}))
    both = {"web": domain("web", 0.5), "code": domain("code", 0.5)}
    (root / "web_code.json").write_text(json.dumps({**base, "domains": both}))


def config(data: Path, manifest: str, dims: ParallelDims, out_dir: Path, stop_after: int | None = None) -> dict:
    return {
        "model": MODEL.model_dump(), "optim": OPTIM.model_dump(), "train": RUN.model_dump(),
        "parallel": dims.model_dump(), "manifest": str(data / manifest), "data_root": str(data),
        "out_dir": str(out_dir), "stop_after": stop_after,
    }


def run_worker(launcher: list[str], configs: dict[str, dict], work: Path) -> dict[str, dict]:
    """Run dist_worker over the named configs in one process group; their results by name."""
    args = []
    for name, cfg in configs.items():
        (work / f"{name}.config.json").write_text(json.dumps(cfg))
        args += ["--config", str(work / f"{name}.config.json"), "--out", str(work / f"{name}.json")]
    cmd = [*launcher, "-m", "kiln.tasks.train.dist_worker", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: json.loads((work / f"{name}.json").read_text()) for name in configs}


def step_loss(model: torch.nn.Module, mixture: Mixture, step_index: int) -> float:
    """The loss the training step `step_index` (0-based) reports for `model`: mean over micro-batches."""
    x, y = batch_for_step(mixture, RUN.seed, step_index, 0, 1, ROWS, RUN.seq_len)
    with torch.no_grad():
        losses = [
            F.cross_entropy(model(x[m : m + RUN.batch_size]).flatten(0, 1), y[m : m + RUN.batch_size].flatten())
            for m in range(0, ROWS, RUN.batch_size)
        ]
    return torch.stack(losses).mean().item()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("dcp_resume")
    data = work / "data"
    data.mkdir()
    write_data(data)
    web = Mixture.from_manifest(data / "web.json", data)
    web_code = Mixture.from_manifest(data / "web_code.json", data)
    results = run_worker(
        [str(TORCHRUN), "--standalone", "--nproc_per_node=2"],
        {
            "full": config(data, "web.json", FSDP, work / "full"),
            "stopped": config(data, "web.json", FSDP, work / "stopped", stop_after=STOP),
        },
        work,
    )
    on_disk = sorted(p.name for p in (work / "stopped" / "checkpoints").iterdir())
    shard_files = sorted(p.name for p in (work / "stopped" / "checkpoints" / "step_0000006").iterdir())
    shutil.copytree(work / "stopped", work / "resumed")
    shutil.copytree(work / "stopped", work / "new_shard")

    # the step-6 state, loaded in this process without any process group: what step 7 should see
    torch.manual_seed(1)
    model = build_model(MODEL, V)
    optimizer = make_optimizer(model, OPTIM, torch.device("cpu"))
    restored = load_latest_dcp(work / "stopped" / "checkpoints", model, optimizer)
    expected_step7 = {"web": step_loss(model, web, STOP - 1), "web_code": step_loss(model, web_code, STOP - 1)}

    results |= run_worker(
        [sys.executable],
        {
            "resumed": config(data, "web.json", PLAIN, work / "resumed"),
            "new_shard": config(data, "web_code.json", PLAIN, work / "new_shard"),
        },
        work,
    )
    return {
        **results, "work": work, "web": web, "web_code": web_code, "on_disk": on_disk,
        "shard_files": shard_files, "restored_step": restored["step"], "expected_step7": expected_step7,
    }


def values(curve: list) -> list:
    return [v for _, v in curve]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_fsdp_run_resumes_on_one_process_without_skipping_or_repeating_steps(runs) -> None:
    full, stopped, resumed = runs["full"], runs["stopped"], runs["resumed"]
    # the 2-rank run stopped after step 7 with checkpoints 3 and 6, each sharded by both ranks
    assert [s for s, _ in stopped["loss_curve"]] == list(range(1, STOP + 1))
    assert stopped["model_dir"] is None and stopped["resumed_from_step"] is None
    assert runs["on_disk"] == ["step_0000003", "step_0000006"]
    assert runs["shard_files"] == [".metadata", "COMPLETE", "__0_0.distcp", "__1_0.distcp", "train_state.json"]
    assert runs["restored_step"] == 6

    assert resumed["world_size"] == 1 and resumed["rank0_local_numel"] == count_parameters(MODEL, V)
    assert resumed["resumed_from_step"] == 6
    assert [s for s, _ in resumed["loss_curve"]] == list(range(1, RUN.steps + 1))
    # same global batch at every step: none skipped, none repeated
    assert resumed["batch_checksum_curve"] == full["batch_checksum_curve"]
    assert len(set(values(full["batch_checksum_curve"]))) == RUN.steps
    assert values(resumed["loss_curve"])[:6] == values(full["loss_curve"])[:6]  # from the checkpoint
    np.testing.assert_allclose(values(resumed["loss_curve"]), values(full["loss_curve"]), rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(values(resumed["grad_norm_curve"]), values(full["grad_norm_curve"]), rtol=1e-4)
    assert values(resumed["lr_curve"]) == values(full["lr_curve"])
    assert resumed["loss_curve"][6][1] == pytest.approx(runs["expected_step7"]["web"], rel=LOSS_RTOL)

    # the final model: gathered from 2 FSDP shards, and written by 1 process, agree
    full_model, cfg = load_model(Path(full["model_dir"]))
    resumed_model, _ = load_model(Path(resumed["model_dir"]))
    assert cfg == MODEL
    for (name, a), (_, b) in zip(full_model.state_dict().items(), resumed_model.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=name)
    # the single process went on checkpointing: step 9 (one shard file) replaced step 3
    ckpts = runs["work"] / "resumed" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_0000006", "step_0000009"]
    assert sorted(p.name for p in (ckpts / "step_0000009").glob("*.distcp")) == ["__0_0.distcp"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_new_shard_at_a_checkpoint_boundary_feeds_the_steps_after_it(runs) -> None:
    full, new = runs["full"], runs["new_shard"]
    assert new["resumed_from_step"] == 6
    assert [s for s, _ in new["loss_curve"]] == list(range(1, RUN.steps + 1))
    # earlier steps unchanged
    assert new["loss_curve"][:6] == full["loss_curve"][:6]
    assert new["batch_checksum_curve"][:6] == full["batch_checksum_curve"][:6]
    web = {"web": {"weight": 1.0, "train": ["web.bin"]}}
    web_code = {"code": {"weight": 0.5, "train": ["code.bin"]}, "web": {"weight": 0.5, "train": ["web.bin"]}}
    assert new["mixture_history"] == [[0, web], [6, web_code]]

    # steps 7-10 drew exactly the new mixture's batches, 10 of their 16 rows from the new shard
    for step in range(7, RUN.steps + 1):
        x, y = batch_for_step(runs["web_code"], RUN.seed, step - 1, 0, 1, ROWS, RUN.seq_len)
        assert new["batch_checksum_curve"][step - 1] == [step, batch_checksum(x, y, 0)]
        assert new["batch_checksum_curve"][step - 1] != full["batch_checksum_curve"][step - 1]
    domains = [
        d for i in range(6, RUN.steps) for d, _ in batch_sources(runs["web_code"], RUN.seed, i, 0, 1, ROWS, RUN.seq_len)
    ]
    assert domains.count("code") == 10

    # the state was restored: step 7's loss is the step-6 model's loss on the new batch
    assert new["loss_curve"][6][1] == pytest.approx(runs["expected_step7"]["web_code"], rel=LOSS_RTOL)
    assert Path(new["model_dir"], "model.pt").is_file()


def test_dcp_skips_incomplete_and_corrupt_checkpoints_and_keeps_the_newest(tmp_path) -> None:
    """Single process, no process group: keep-last-k, a partial save, a marker-less and a corrupt directory."""
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model(MODEL, V)
    optimizer = make_optimizer(model, OPTIM, cpu)
    x = torch.randint(0, V, (2, RUN.seq_len))
    saved = {}
    for step in (1, 2, 3):
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        save_dcp(tmp_path, step, model, optimizer, {"note": f"after {step}"}, keep=2)
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0000002", "step_0000003"]

    (tmp_path / ".tmp_step_0000005").mkdir()  # a save that died before committing
    shutil.copytree(tmp_path / "step_0000003", tmp_path / "step_0000004")
    (tmp_path / "step_0000004" / "COMPLETE").unlink()
    shard = tmp_path / "step_0000003" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(raw))

    fresh = build_model(MODEL, V)
    fresh_optimizer = make_optimizer(fresh, OPTIM, cpu)
    with pytest.warns(UserWarning, match="incomplete or corrupt") as caught:
        state = load_latest_dcp(tmp_path, fresh, fresh_optimizer)
    assert [str(w.message).split()[1] for w in caught] == [
        str(tmp_path / "step_0000004"), str(tmp_path / "step_0000003")
    ]
    assert state == {"step": 2, "note": "after 2"}
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved[2][name]), name
    assert fresh_optimizer.state_dict()["state"][0]["step"].item() == 2.0

    save_dcp(tmp_path, 4, fresh, fresh_optimizer, {}, keep=2)  # replaces the marker-less step 4
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "step_0000003", "step_0000004"
    ]
    other = build_model(MODEL, V)
    assert load_latest_dcp(tmp_path, other, make_optimizer(other, OPTIM, cpu))["step"] == 4
