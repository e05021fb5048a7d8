"""The train stage under torchrun: compiled FSDP blocks, a killed rank relaunched, a rollback on FSDP ranks."""

import socket
from pathlib import Path

import numpy as np
import pytest

from kiln.tasks.launch.cluster import ClusterSpec
from kiln.tasks.train.callbacks import CallbackSpec
from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.launched_training import train_with_launcher
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.testing_faults import FaultInjection


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)  # torch.compile in two ranks and one process: 118 s measured on 2 busy cores
def test_compiled_fsdp_blocks_train_like_one_eager_process(tmp_path):
    """`run.compile` under torchrun compiles each FSDP block; the losses are the eager single process's."""
    from tests.tasks.train.test_train_loop import MODEL, OPTIM, RUN, write_mixture

    (tmp_path / "data").mkdir()
    mixture = write_mixture(tmp_path / "data")
    run = RUN.model_copy(update={"steps": 6})
    eager = train_model(MODEL, OPTIM, run, mixture, tmp_path / "eager")
    out = tmp_path / "compiled"
    out.mkdir()
    compiled = train_with_launcher(MODEL, OPTIM, run.model_copy(update={"compile": True}), ParallelDims(dp=2),
                                   ClusterSpec(), tmp_path / "data" / "manifest.json", tmp_path / "data", out)
    # measured 1.1e-7: compiled kernels and the FSDP reduction only change summation order
    np.testing.assert_allclose([v for _, v in compiled.loss_curve], [v for _, v in eager.loss_curve], rtol=1e-5)


def write_tiny_corpus(root: Path) -> Path:
    import json

    import numpy as np

    rng = np.random.default_rng(0)
    for split, size in (("train", 20_000), ("val", 2_000)):
        path = root / "web" / f"{split}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        ((np.arange(size) * 7 + rng.integers(0, 3, size)) % 97).astype(np.uint16).tofile(path)
    manifest = root / "mixture.json"
    manifest.write_text(json.dumps({"format": 1, "dtype": "uint16", "vocab_size": 97, "eos_id": 0, "seq_len": 32,
                                    "domains": {"web": {"weight": 1.0, "token_budget": 0, "num_tokens": 20_000,
                                                        "epochs": 0.0, "train": ["web/train.bin"],
                                                        "val": ["web/val.bin"]}}}))
    return manifest


@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_rank_is_relaunched_and_resumes_from_its_checkpoint(tmp_path):
    manifest = write_tiny_corpus(tmp_path / "data")
    out = tmp_path / "train"
    out.mkdir()
    run = TrainRunConfig(steps=12, batch_size=4, seq_len=32, eval_batches=1, checkpoint_every=4,
                         health={"enabled": False})
    result = train_with_launcher(ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32), OptimConfig(), run,
                                 ParallelDims(dp=2), ClusterSpec(max_restarts=1), manifest, manifest.parent, out,
                                 callbacks=[CallbackSpec.of(FaultInjection, kill_rank_at_step=[1, 6])])
    assert (out / ".fault_injected").read_text() == "rank 1 killed at step 6\n"
    [event] = result.health_events
    assert event["kind"] == "process_failure" and event["step"] == 4  # resumed from the step-4 checkpoint
    assert event["failed_ranks"] == [1] and event["hosts"] == [socket.gethostname()]
    assert 0 < event["time_to_resume_s"] < 120
    assert result.resumed_from_step == 4 and [s for s, _ in result.loss_curve] == list(range(1, 13))
    assert (out / "failed_hosts.json").is_file() and (out / "model" / "model.pt").is_file()


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_run_rolls_back_a_poisoned_step_like_the_single_process_loop(tmp_path):
    """The loss monitor runs inside the torchrun workers: a poisoned batch on 2 FSDP ranks is rolled
    back to the same checkpoint, skipped with the same window, and reported through the callbacks."""
    from tests.tasks.train.test_train_health import BAD_STEP, WATCHED
    from tests.tasks.train.test_train_loop import MODEL, OPTIM, write_mixture

    (tmp_path / "data").mkdir()
    mixture = write_mixture(tmp_path / "data")
    poison = {"poison_data_index": [BAD_STEP - 1]}
    single = train_model(MODEL, OPTIM, WATCHED, mixture, tmp_path / "single", callbacks=[FaultInjection(**poison)])
    out = tmp_path / "fsdp"
    out.mkdir()
    events, metrics = [], []
    result = train_with_launcher(MODEL, OPTIM, WATCHED, ParallelDims(dp=2), ClusterSpec(),
                                 tmp_path / "data" / "manifest.json", tmp_path / "data", out,
                                 on_metrics=lambda step, m: metrics.append(step), on_event=events.append,
                                 callbacks=[CallbackSpec.of(FaultInjection, **poison)])
    [expected] = single.health_events
    [event] = result.health_events
    assert events == [event] and event["action"] == "rollback" and event["step"] == BAD_STEP
    same = ("kind", "rolled_back_to", "deleted_checkpoints", "window", "skipped_data")
    assert {k: event[k] for k in same} == {k: expected[k] for k in same}
    assert result.num_rollbacks == 1 and result.world_size == 2
    assert result.batch_checksum_curve == single.batch_checksum_curve  # the same replacement batches
    np.testing.assert_allclose([v for _, v in result.loss_curve], [v for _, v in single.loss_curve], rtol=1e-5)
    assert result.val_loss == pytest.approx(single.val_loss, rel=1e-4)
    assert metrics == [10, 20, 30, 30]  # replayed train metrics, then the validation loss
