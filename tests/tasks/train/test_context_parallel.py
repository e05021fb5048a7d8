"""Context parallel matches the single-process model: real torchrun, gloo, CPU, 2 and 4 processes.

The distributed tests run `cp_worker.py` (one launch per process count, since each costs seconds
of imports) and compare with the same model run on the whole sequences in this process:
- logits and every parameter gradient of one forward/backward, cp = 2 and cp = 4;
- the loss and gradient-norm curves and final weights of 5 clipped AdamW steps, cp = 2 (FSDP over
  cp), cp = 2 (DDP, activation checkpointing), dp = 2 x cp = 2 (FSDP over the flattened mesh) and
  cp = 2 x tp = 2 (FSDP over cp, heads split over tp).

Measured worst differences (one thread per process), relative: logits 1.4e-7 of their largest
magnitude, gradients 6.3e-7 of each tensor's largest entry, losses 1.2e-7, gradient norms 1.7e-6.
Attention over gathered keys only changes summation order, so the tolerance is RTOL = 1e-5.
Final weights differ by at most 1.8e-5 absolute (0.18% of the learning rate, AdamW's largest
step per element): its normalised update turns last-bit differences in tiny gradients into
visible ones, and plain dp = 2 FSDP, without CP, differs from one process by as much (1.7e-5);
the tolerance is 1% of the learning rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims
from kiln.tasks.train.distributed import clip_grad_norm, make_optimizer
from kiln.tasks.train.model import AttentionPattern, Transformer, build_model, causal_attention
from kiln.tasks.train.parallel import check_context_split, context_chunk

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = Path(sys.executable).parent / "torchrun"
WORKER = Path(__file__).with_name("cp_worker.py")
V, B, T, STEPS = 64, 4, 16, 5
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32, qk_norm=True)
# a clip low enough that every step is clipped, so the sharded norm is exercised
OPTIM = OptimConfig(lr=1e-2, grad_clip=0.5)
RTOL = 1e-5
WEIGHT_ATOL = 0.01 * OPTIM.lr


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| as a fraction of b's largest magnitude."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """Initial weights and STEPS global batches of random tokens, saved for the workers."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (STEPS, B, T + 1), generator=gen)
    init = build_model(MODEL, V, seed=0).state_dict()
    path = tmp_path_factory.mktemp("cp_data") / "data.pt"
    torch.save({"init": init, "x": tokens[..., :-1], "y": tokens[..., 1:], "vocab_size": V}, path)
    return path


def fresh_model(data: Path) -> tuple[Transformer, dict]:
    saved = torch.load(data, weights_only=True)
    model = Transformer(MODEL, V)
    model.load_state_dict(saved["init"])
    return model, saved


def loss_of(model: Transformer, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(x)
    return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


@pytest.fixture(scope="module")
def reference(data) -> dict:
    """The single-process whole-sequence run of every case, in this process (deterministic kernels,
    as the workers use; the global setting is restored for the tests that follow)."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return _reference_runs(data)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)


def _reference_runs(data: Path) -> dict:
    model, saved = fresh_model(data)
    logits, loss = loss_of(model, saved["x"][0], saved["y"][0])
    loss.backward()
    grads = {"logits": logits.detach(), "loss": loss.item(),
             "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}
    model, _ = fresh_model(data)
    optimizer = make_optimizer(model, OPTIM, torch.device("cpu"))
    losses, norms = [], []
    for step in range(STEPS):
        _, loss = loss_of(model, saved["x"][step], saved["y"][step])
        loss.backward()
        norms.append(clip_grad_norm(list(model.parameters()), OPTIM.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    train = {"loss": losses, "grad_norm": norms, "init": saved["init"],
             "weights": {name: p.detach().clone() for name, p in model.named_parameters()}}
    return {"grads": grads, "train": train}


def torchrun(nproc: int, cases: dict[str, tuple[str, ParallelDims]], data: Path, out: Path) -> dict[str, dict]:
    spec = {
        "model": MODEL.model_dump(), "optim": OPTIM.model_dump(), "data": str(data),
        "cases": [{"name": name, "kind": kind, "parallel": dims.model_dump(),
                   "activation_checkpointing": "full" if name.endswith("_ac") else "none"} for name, (kind, dims) in cases.items()],
    }
    (out / "spec.json").write_text(json.dumps(spec))
    # 2 cores shared by up to 4 ranks: one thread each, and no OpenMP spin-waiting
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(WORKER), str(out / "spec.json"), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return {name: torch.load(out / f"{name}.pt", weights_only=True) for name in cases}


@pytest.fixture(scope="module")
def two_proc(data, tmp_path_factory) -> dict[str, dict]:
    # a case named *_ac recomputes block activations (run.activation_checkpointing)
    return torchrun(2, {
        "grads_cp2": ("grads", ParallelDims(cp=2, dp_mode="ddp")),
        "train_cp2_fsdp": ("train", ParallelDims(cp=2)),
        "train_cp2_ddp_ac": ("train", ParallelDims(cp=2, dp_mode="ddp")),
    }, data, tmp_path_factory.mktemp("cp_two"))


@pytest.fixture(scope="module")
def four_proc(data, tmp_path_factory) -> dict[str, dict]:
    return torchrun(4, {
        "grads_cp4": ("grads", ParallelDims(cp=4, dp_mode="ddp")),
        "train_dp2_cp2_fsdp": ("train", ParallelDims(dp=2, cp=2)),
        "train_cp2_tp2": ("train", ParallelDims(cp=2, tp=2)),
    }, data, tmp_path_factory.mktemp("cp_four"))


def assert_grads_match(result: dict, ref: dict) -> None:
    assert max_rel_diff(result["logits"], ref["logits"]) < RTOL
    assert result["loss"] == pytest.approx(ref["loss"], rel=RTOL)
    assert result["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        assert max_rel_diff(result["grads"][name], grad) < RTOL, name


def assert_training_matches(result: dict, ref: dict) -> None:
    assert result["loss"] == pytest.approx(ref["loss"], rel=RTOL)
    assert result["grad_norm"] == pytest.approx(ref["grad_norm"], rel=RTOL)
    assert all(norm > OPTIM.grad_clip for norm in ref["grad_norm"])  # every step was clipped
    # it trained: AdamW moved the weights by far more than the tolerance (random tokens leave the
    # loss itself flat, within the batches' noise)
    assert max((weight - ref["init"][name]).abs().max() for name, weight in ref["weights"].items()) > 10 * WEIGHT_ATOL
    for name, weight in ref["weights"].items():
        assert (result["weights"][name] - weight).abs().max() < WEIGHT_ATOL, name


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_cp2_logits_and_gradients_match_single_process(two_proc, reference) -> None:
    assert_grads_match(two_proc["grads_cp2"], reference["grads"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_cp4_logits_and_gradients_match_single_process(four_proc, reference) -> None:
    assert_grads_match(four_proc["grads_cp4"], reference["grads"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["train_cp2_fsdp", "train_cp2_ddp_ac"])
def test_cp2_training_matches_single_process(two_proc, reference, case) -> None:
    assert_training_matches(two_proc[case], reference["train"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_dp2_cp2_fsdp_training_matches_single_process(four_proc, reference) -> None:
    assert_training_matches(four_proc["train_dp2_cp2_fsdp"], reference["train"])


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_cp2_tp2_training_matches_single_process(four_proc, reference) -> None:
    assert_training_matches(four_proc["train_cp2_tp2"], reference["train"])


def test_context_chunk_splits_every_row_into_contiguous_chunks() -> None:
    x = torch.arange(2 * 8).view(2, 8)
    y = x + 100
    chunks = [context_chunk(x, y, rank, 4) for rank in range(4)]
    assert [start for _, _, start in chunks] == [0, 2, 4, 6]
    assert chunks[1][0].tolist() == [[2, 3], [10, 11]]
    assert chunks[1][1].tolist() == [[102, 103], [110, 111]]
    assert torch.equal(torch.cat([cx for cx, _, _ in chunks], dim=1), x)
    with pytest.raises(ValueError, match="sequence length 8 is not divisible by parallel.cp=3"):
        context_chunk(x, y, 0, 3)
    with pytest.raises(ValueError, match="train.seq_len=10 is not divisible by parallel.cp=4"):
        check_context_split(ParallelDims(cp=4), 10)


def test_offset_causal_attention_is_causal_attention_on_a_suffix() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=gen) for _ in range(3))
    full = causal_attention(q, k, v)
    # The same attention numerically, not bit for bit: an explicit mask and is_causal, over 3 queries or 8,
    # take different SDPA kernels, whose last bits differ by CPU (AVX-512's differ from AVX2's).
    # the last 3 queries (positions 5..7) over all 8 keys; start=0 with equal lengths is plain causal
    torch.testing.assert_close(causal_attention(q[:, :, 5:], k, v, q_start=5), full[:, :, 5:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(causal_attention(q, k, v, q_start=0), full, rtol=1e-5, atol=1e-6)
    # a sliding window of 3 under an offset: the same rows as the whole sequence's windowed attention
    window = AttentionPattern(window=3)
    torch.testing.assert_close(causal_attention(q[:, :, 5:], k, v, window, q_start=5),
                               causal_attention(q, k, v, window)[:, :, 5:], rtol=1e-5, atol=1e-6)


def test_start_pos_continues_a_sequence_given_its_prefix_keys() -> None:
    """Positions [s, T) run alone with start_pos=s, their attention fed the keys/values the full
    forward computed for [0, s), give the full forward's logits at [s, T)."""
    torch.manual_seed(0)
    model = build_model(MODEL, V)
    x = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    s = 6
    prefix: list[tuple[torch.Tensor, torch.Tensor]] = []

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: AttentionPattern) -> torch.Tensor:
        prefix.append((k[:, :, :s], v[:, :, :s]))
        return causal_attention(q, k, v, pattern)

    for block in model.blocks:
        block.attn.attention = recording
    with torch.no_grad():
        full = model(x)
    for block, (k_prefix, v_prefix) in zip(model.blocks, prefix):
        block.attn.attention = lambda q, k, v, pattern, kp=k_prefix, vp=v_prefix: causal_attention(
            q, torch.cat((kp, k), dim=2), torch.cat((vp, v), dim=2), pattern, q_start=s
        )
    with torch.no_grad():
        suffix = model(x[:, s:], start_pos=s)
        shifted = model(x[:, s:], start_pos=0)
    assert max_rel_diff(suffix, full[:, s:]) < 1e-6
    assert max_rel_diff(shifted, full[:, s:]) > 1e-2  # the rotary positions do matter
    with pytest.raises(ValueError, match=r"positions \[20, 36\) exceed model.max_seq_len=32"):
        model(x, start_pos=20)


def test_parallel_dims_count_cp_and_refuse_pipeline_parallel() -> None:
    assert ParallelDims(dp=3, cp=2, tp=2).world_size == 12
    with pytest.raises(ValueError, match="context parallel does not compose with pipeline parallel"):
        ParallelDims(pp=2, cp=2)
