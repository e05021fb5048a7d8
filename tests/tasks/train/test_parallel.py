"""Every parallelism mode trains to the single-process loss curve: real torchrun, gloo, CPU.

One 2-process torchrun runs DDP, FSDP2 (+ activation checkpointing), tensor parallel, a 2-stage
GPipe pipeline and context parallel in turn (one launch, since each launch costs ~10 s of imports
on 2 cores); a 4-process one runs FSDP x TP, FSDP x CP and PP x FSDP on 2 x 2 meshes. All use
grad_accum=2, so FSDP's skipped gradient sync and pipeline micro-batching are exercised. Each
curve, and the gathered final model, is compared with `train_model` on the same data.

Measured worst relative loss difference over the 10 steps (one thread per process): DDP 1.1e-7,
FSDP 1.1e-7, TP 1.6e-7, PP 0 (bit-identical), CP 9.7e-8, FSDP x TP 1.0e-7, FSDP x CP 9.7e-8,
PP x FSDP 7.9e-8; the collectives only change summation order. The tolerance is rtol=1e-5 on
losses and 1e-4 on gradient norms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig
from tasks.train.data_loader import Mixture
from tasks.train.loop import train_model
from tasks.train.model import Transformer, count_parameters, load_model
from tasks.train.parallel import ParallelDims, check_divisible

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = Path(sys.executable).parent / "torchrun"
V = 64
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=3)
RUN = TrainRunConfig(steps=10, batch_size=4, grad_accum=2, seq_len=16, eval_batches=1, log_every=1, num_threads=1)
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4
WEIGHT_ATOL = 1e-4
# pipeline stages cannot share a weight; TP runs it too, covering a plain head and per-head QK-norm
VARIANT = MODEL.model_copy(update={"tie_embeddings": False, "qk_norm": True})
TWO_PROC_MODES = {  # a mode named *_ac also sets run.activation_checkpointing
    "ddp": (ParallelDims(dp=2, dp_mode="ddp"), MODEL),
    "fsdp_ac": (ParallelDims(dp=2), MODEL),
    "tp": (ParallelDims(tp=2), VARIANT),
    "pp": (ParallelDims(pp=2), VARIANT),
    "cp": (ParallelDims(cp=2), MODEL),
}
FOUR_PROC_MODES = {
    "fsdp_tp": (ParallelDims(dp=2, tp=2), MODEL),
    "fsdp_cp": (ParallelDims(dp=2, cp=2), MODEL),
    "pp_fsdp": (ParallelDims(pp=2, dp=2), VARIANT),
}


def write_mixture(root: Path) -> Mixture:
    """One domain of period-9 patterned documents, eos-terminated."""
    doc = np.concatenate([1 + np.arange(9 * 20) % 9, [0]])
    tokens = np.tile(doc, 4).astype("<u2")
    tokens.tofile(root / "train.bin")
    tokens[:200].tofile(root / "val.bin")
    manifest = {
        "format": 1, "dtype": "uint16", "vocab_size": V, "eos_id": 0,
        "domains": {"web": {"weight": 1.0, "train": ["train.bin"], "val": ["val.bin"]}},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return Mixture.from_manifest(root / "manifest.json", root)


def torchrun(
    nproc: int, runs: dict[str, tuple[ParallelDims, ModelConfig]], data: Path, out: Path, timeout: int
) -> dict[str, dict]:
    """Launch dist_worker under torchrun for each named mode in turn; their results by name."""
    args = []
    for name, (dims, model) in runs.items():
        config = {
            "model": model.model_dump(), "optim": OPTIM.model_dump(),
            "train": RUN.model_copy(update={"activation_checkpointing": name.endswith("_ac")}).model_dump(),
            "parallel": dims.model_dump(), "manifest": str(data / "manifest.json"), "data_root": str(data),
            "out_dir": str(out / name),
        }
        (out / f"{name}.config.json").write_text(json.dumps(config))
        args += ["--config", str(out / f"{name}.config.json"), "--out", str(out / f"{name}.json")]
    # 2 cores shared by up to 4 ranks: one thread each, and no OpenMP spin-waiting
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", "-m", "tasks.launch.dist_worker", *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in runs}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_mixture(root)
    return root


def single_process(model: ModelConfig, data: Path, out: Path) -> dict:
    """The single-process loop's per-step losses and gradient norms, and its final model."""
    grad_norms: list[float] = []
    result = train_model(
        model, OPTIM, RUN, Mixture.from_manifest(data / "manifest.json", data), out,
        on_metrics=lambda step, m: grad_norms.append(m["grad_norm"]) if "grad_norm" in m else None,
    )
    return {"loss": [loss for _, loss in result.loss_curve], "grad_norm": grad_norms, "model_dir": result.model_dir}


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> dict[str, list[float]]:
    return single_process(MODEL, data, tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module")
def reference_variant(data, tmp_path_factory) -> dict[str, list[float]]:
    return single_process(VARIANT, data, tmp_path_factory.mktemp("ref_variant"))


@pytest.fixture(scope="module")
def two_proc(data, tmp_path_factory) -> dict[str, dict]:
    return torchrun(2, TWO_PROC_MODES, data, tmp_path_factory.mktemp("two_proc"), timeout=120)


@pytest.fixture(scope="module")
def four_proc(data, tmp_path_factory) -> dict[str, dict]:
    return torchrun(4, FOUR_PROC_MODES, data, tmp_path_factory.mktemp("four_proc"), timeout=150)


def assert_matches(result: dict, reference: dict) -> None:
    assert [step for step, _ in result["loss_curve"]] == list(range(1, RUN.steps + 1))
    np.testing.assert_allclose([v for _, v in result["loss_curve"]], reference["loss"], rtol=LOSS_RTOL, atol=0)
    np.testing.assert_allclose(
        [v for _, v in result["grad_norm_curve"]], reference["grad_norm"], rtol=GRAD_NORM_RTOL, atol=0
    )
    # it learned: the pattern is easy, so 10 steps cut the loss well below ln(64) = 4.16
    assert result["loss_curve"][-1][1] < reference["loss"][0] - 1.0
    # the gathered final model is the single-process one: AdamW turns summation-order differences
    # of 1e-7 into weight differences of ~2e-5 over 10 steps (lr 1e-2)
    gathered, _ = load_model(Path(result["model_dir"]))
    expected, _ = load_model(reference["model_dir"])
    for (name, a), (_, b) in zip(gathered.state_dict().items(), expected.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=WEIGHT_ATOL, msg=name)


N_PARAMS = count_parameters(MODEL, V)
# matmul weights TP splits per block: wq, wk, wv, proj (4 d^2) and gate, up, down (3 d f)
TP_SPLIT = MODEL.n_layers * (4 * MODEL.d_model**2 + 3 * MODEL.d_model * MODEL.ffn_hidden)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ddp_matches_single_process(two_proc, reference) -> None:
    assert_matches(two_proc["ddp"], reference)
    assert two_proc["ddp"]["rank0_local_numel"] == N_PARAMS  # every rank holds the whole model


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_fsdp_with_activation_checkpointing_matches_single_process(two_proc, reference) -> None:
    assert_matches(two_proc["fsdp_ac"], reference)
    assert two_proc["fsdp_ac"]["rank0_local_numel"] == N_PARAMS // 2  # every dim 0 is even


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_tensor_parallel_matches_single_process(two_proc, reference_variant) -> None:
    assert_matches(two_proc["tp"], reference_variant)
    # each rank keeps its half of the heads and SwiGLU width; embeddings, head and norms are replicated
    assert two_proc["tp"]["rank0_local_numel"] == count_parameters(VARIANT, V) - TP_SPLIT // 2


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_fsdp_tp_2d_mesh_matches_single_process(four_proc, reference) -> None:
    result = four_proc["fsdp_tp"]
    assert_matches(result, reference)
    assert result["rank0_local_numel"] == (N_PARAMS - TP_SPLIT // 2) // 2


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_context_parallel_matches_single_process(two_proc, reference) -> None:
    assert_matches(two_proc["cp"], reference)
    assert two_proc["cp"]["rank0_local_numel"] == N_PARAMS // 2  # FSDP over the cp ranks


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_fsdp_x_context_parallel_matches_single_process(four_proc, reference) -> None:
    assert_matches(four_proc["fsdp_cp"], reference)
    assert four_proc["fsdp_cp"]["rank0_local_numel"] == N_PARAMS // 4  # sharded over dp x cp


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_pipeline_x_fsdp_matches_single_process(four_proc, reference_variant) -> None:
    assert_matches(four_proc["pp_fsdp"], reference_variant)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_pipeline_parallel_matches_single_process(two_proc, reference_variant) -> None:
    assert_matches(two_proc["pp"], reference_variant)
    # stage 0 holds the embedding and block 0 (with its two norms and two QK-norms)
    d, f, hd = VARIANT.d_model, VARIANT.ffn_hidden, VARIANT.head_dim
    assert two_proc["pp"]["rank0_local_numel"] == V * d + 4 * d * d + 3 * d * f + 2 * d + 2 * hd


def test_a_layout_that_cannot_hold_the_global_batch_is_refused_with_why() -> None:
    ParallelDims(dp=2).check_holds_batch(RUN)  # 4 sequences: 2 per rank, 2 micro-batches of 1
    with pytest.raises(ValueError, match=r"batch_size=4 \(the global batch, sequences per step\) does not split "
                                         r"over parallel.dp=3"):
        ParallelDims(dp=3).check_holds_batch(RUN)
    with pytest.raises(ValueError, match="each of parallel.dp=2 ranks gets 2 of the 4 sequences per step, which do "
                                         "not split into train.run.grad_accum=4"):
        ParallelDims(dp=2).check_holds_batch(RUN.model_copy(update={"grad_accum": 4}))


def test_parallel_dims_reject_what_cannot_split() -> None:
    with pytest.raises(ValueError, match="dp_mode='ddp' cannot be combined with parallel.tp=2"):
        ParallelDims(dp=2, tp=2, dp_mode="ddp")
    model = Transformer(ModelConfig(d_model=48, n_heads=3, max_seq_len=8), V)
    with pytest.raises(ValueError, match="model.n_heads=3 is not divisible by parallel.tp=2"):
        check_divisible(ParallelDims(tp=2), model)
    with pytest.raises(ValueError, match="parallel.pp > 1 needs model.tie_embeddings=false"):
        check_divisible(ParallelDims(pp=2), model)
    with pytest.raises(ValueError, match="pipeline parallel does not compose with tensor parallel"):
        ParallelDims(pp=2, tp=2)
