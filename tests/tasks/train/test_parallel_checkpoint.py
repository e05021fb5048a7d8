"""DCP checkpoints move between parallel layouts (TP, FSDP x TP, pipeline stages, pp x FSDP): real torchrun, gloo, CPU.

Each checkpoint is written after two AdamW steps in one layout and loaded into a model built from
another seed in another layout; the loaded weights, AdamW moments and steps, and per-parameter
hyper-parameters (the learning rate changes per step) must equal the saved ones exactly, keyed by
parameter name: resharding only copies values.

- tensor parallel: tp=2 -> one plain process, tp=2 -> dp=2 FSDP, dp=2 x tp=2 -> tp=2 and -> one
  process. TP splits the separate q/k/v and gate/up projections with a plain Shard(0); fused
  projections split in strided blocks (`_StridedShard`) made torch 2.13's DCP refuse to save
  ("overlapping chunks").
- pipeline parallel: pp=2 -> one process, -> dp=2 FSDP and -> pp=2; one process -> pp=2 and ->
  pp=2 x dp=2 FSDP; dp=2 x tp=2 -> pp=2 x dp=2. Stages keep the model's block names (stage 1 of 3
  blocks holds `blocks.2`), so their keys do not collide.
AdamW's param groups differ between these layouts (`make_optimizer` splits them by tensor kind) and
between pipeline stages, so this needs the optimizer state checkpointed per parameter name
(`flatten_optimizer_state_dict`), not by group index.

Every layout also trains like one process: same seed and global batches, and the saved weights
agree to float summation order (measured worst 5.5e-5 after two steps at lr 1e-2 and 2e-2: tp=2
4.4e-5, dp=2 x tp=2 2.4e-5, pp=2 5.5e-5, pp=2 x dp=2 5.5e-5).

One 4-process and one 2-process launch; the plain process's saves and loads run here. The module
takes ~27 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.tasks.train.config import ModelConfig, ParallelDims
from kiln.tasks.train.dcp import load_latest_dcp, save_dcp
from kiln.tasks.train.distributed import make_optimizer
from kiln.tasks.train.model import Transformer, build_model
from kiln.tasks.train.parallel import pipeline_parts
from tests.tasks.train.parallel_ckpt_worker import LOAD_SEED, OPTIM, SEED, STEPS, full_state, train

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = Path(sys.executable).parent / "torchrun"
WORKER = Path(__file__).with_name("parallel_ckpt_worker.py")
V = 64
# untied: pipeline stages cannot share a weight; 3 blocks split 2 + 1 over two stages; QK-norm
# gains are replicated over TP
MODEL = ModelConfig(d_model=32, n_layers=3, n_heads=2, max_seq_len=16, tie_embeddings=False, qk_norm=True)
TP2, PP2, FSDP2, FSDP2_TP2 = ParallelDims(tp=2), ParallelDims(pp=2), ParallelDims(dp=2), ParallelDims(dp=2, tp=2)
PP2_FSDP2 = ParallelDims(pp=2, dp=2)
WEIGHT_ATOL = 0.01 * 2 * OPTIM.lr  # 1% of the last step's learning rate


def torchrun(nproc: int, jobs: list[dict], root: Path) -> None:
    spec = root / f"spec_{nproc}.json"
    spec.write_text(json.dumps({"model": MODEL.model_dump(), "vocab_size": V, "jobs": jobs}))
    # 2 cores shared by up to 4 ranks: one thread each, and no OpenMP spin-waiting
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(WORKER), str(spec), str(root)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def save(name: str, dims: ParallelDims) -> dict:
    return {"kind": "save", "name": name, "parallel": dims.model_dump()}


def load(src: str, dims: ParallelDims, name: str) -> dict:
    return {"kind": "load", "src": src, "name": name, "parallel": dims.model_dump()}


def plain_model(seed: int) -> tuple[Transformer, torch.optim.Optimizer]:
    model = build_model(MODEL, V, seed)
    return model, make_optimizer(model, OPTIM, torch.device("cpu"))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("parallel_ckpt")
    model, optimizer = plain_model(SEED)
    train(model, optimizer, V)
    save_dcp(root / "plain", STEPS, model, optimizer, {}, keep=1)
    torch.save(full_state(model, optimizer), root / "plain.pt")
    torchrun(4, [
        save("fsdp2_tp2", FSDP2_TP2), save("pp2_fsdp2", PP2_FSDP2),
        load("plain", PP2_FSDP2, "plain_as_pp2_fsdp2"), load("fsdp2_tp2", PP2_FSDP2, "fsdp2_tp2_as_pp2_fsdp2"),
    ], root)
    torchrun(2, [
        save("tp2", TP2), save("pp2", PP2),
        load("tp2", FSDP2, "tp2_as_fsdp2"), load("fsdp2_tp2", TP2, "fsdp2_tp2_as_tp2"),
        load("pp2", FSDP2, "pp2_as_fsdp2"), load("plain", PP2, "plain_as_pp2"), load("pp2", PP2, "pp2_as_pp2"),
    ], root)
    return root


def assert_same_state(loaded: dict, saved: dict) -> None:
    assert sorted(loaded) == sorted(saved)
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def loaded_in_plain_process(root: Path, src: str) -> dict:
    model, optimizer = plain_model(LOAD_SEED)
    assert load_latest_dcp(root / src, model, optimizer)["step"] == STEPS
    return full_state(model, optimizer)


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("loaded", "saved"),
    [
        ("tp2_as_fsdp2", "tp2"), ("fsdp2_tp2_as_tp2", "fsdp2_tp2"),
        ("pp2_as_fsdp2", "pp2"), ("plain_as_pp2", "plain"), ("pp2_as_pp2", "pp2"),
        ("plain_as_pp2_fsdp2", "plain"), ("fsdp2_tp2_as_pp2_fsdp2", "fsdp2_tp2"),
    ],
)
def test_checkpoint_loads_into_another_parallel_layout(root, loaded, saved) -> None:
    assert_same_state(torch.load(root / f"{loaded}.pt"), torch.load(root / f"{saved}.pt"))


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("saved", ["tp2", "pp2", "fsdp2_tp2", "pp2_fsdp2"])
def test_parallel_checkpoint_loads_into_one_plain_process(root, saved) -> None:
    state = torch.load(root / f"{saved}.pt")
    fresh = full_state(*plain_model(LOAD_SEED))
    assert not torch.equal(fresh["param blocks.2.attn.wq.weight"], state["param blocks.2.attn.wq.weight"])
    assert_same_state(loaded_in_plain_process(root, saved), state)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_layouts_shard_as_intended(root) -> None:
    # every rank wrote its own shards; the pipeline stages hold disjoint parameters under the
    # model's names, which together make up the whole model
    for name, files in (("tp2", 2), ("pp2", 2), ("fsdp2_tp2", 4), ("pp2_fsdp2", 4)):
        assert len(list((root / name / f"step_{STEPS:07d}").glob("*.distcp"))) == files, name
    plain = torch.load(root / "plain.pt")
    assert sorted(k for k in torch.load(root / "pp2.pt") if k.startswith("param ")) == sorted(
        k for k in plain if k.startswith("param ")
    )
    # two steps at lr 1e-2 then 2e-2: the saved learning rate is the last step's
    assert {plain[k] for k in plain if k.startswith("lr ")} == {2 * OPTIM.lr}


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", ["tp2", "fsdp2_tp2", "pp2", "pp2_fsdp2"])
def test_every_layout_trains_like_one_process(root, layout) -> None:
    """AdamW's normalised update turns summation-order differences in tiny gradients into weight
    differences of a few 1e-5; a lost micro-batch or an unsynchronised dp replica is off by ~lr."""
    plain, state = torch.load(root / "plain.pt"), torch.load(root / f"{layout}.pt")
    for key in (k for k in plain if k.startswith("param ")):
        torch.testing.assert_close(state[key], plain[key], rtol=0, atol=WEIGHT_ATOL, msg=key)


def test_pipeline_stages_keep_the_model_parameter_names() -> None:
    model, _ = plain_model(SEED)
    names = [[name for name, _ in pipeline_parts(model, rank, ParallelDims(pp=2))[0].named_parameters()]
             for rank in (0, 1)]
    assert names[0][0] == "tok_emb.weight" and names[1][-1] == "lm_head.weight"
    assert {n.split(".")[1] for n in names[0] + names[1] if n.startswith("blocks.")} == {"0", "1", "2"}
    assert names[1][0] == "blocks.2.attn_norm.weight"  # the last block, under its own index
    assert sorted(names[0] + names[1]) == sorted(name for name, _ in model.named_parameters())


def test_pipeline_parallel_composes_with_fsdp_only() -> None:
    assert ParallelDims(pp=2, dp=2).world_size == 4
    with pytest.raises(ValueError, match="pipeline parallel does not compose with tensor parallel"):
        ParallelDims(pp=2, tp=2)
    with pytest.raises(ValueError, match="pipeline stages are data-parallel with FSDP only"):
        ParallelDims(pp=2, dp=2, dp_mode="ddp")
    assert ParallelDims(pp=2, dp_mode="ddp").world_size == 2  # dp=1: nothing to replicate
