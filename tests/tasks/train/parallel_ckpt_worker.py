"""torchrun entry for the parallel-checkpoint tests: `parallel_ckpt_worker.py SPEC ROOT`, one process per rank.

SPEC (JSON) holds the model config, the vocabulary size and a list of jobs, run in order in one
process group, each in its own parallel layout (`parallel`: `ParallelDims` fields):
- "save": build the model from seed SEED, split it, `train` it STEPS steps and `save_dcp` it to
  ROOT/<name>;
- "load": build the model from another seed, split it, and `load_latest_dcp` ROOT/<src> into it.
Either way rank 0 then writes `full_state` (gathered weights, optimizer state and hyper-parameters
by parameter name, all pipeline stages merged) to ROOT/<name>.pt for the test to compare.
It drives the building blocks the training loop uses: init_distributed, build_mesh, build_parallel,
make_optimizer, save_dcp and load_latest_dcp, with torch's GPipe schedule.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor

from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims
from kiln.tasks.train.dcp import load_latest_dcp, save_dcp
from kiln.tasks.train.distributed import init_distributed, make_optimizer
from kiln.tasks.train.model import seeded_weights
from kiln.tasks.train.parallel import build_mesh, build_parallel

SEED, LOAD_SEED = 0, 99
STEPS, BATCH, SEQ = 2, 4, 8
MICRO_BATCHES = 2  # of a pipeline's rows per step
OPTIM = OptimConfig(lr=1e-2)
HYPER = ("lr", "weight_decay", "betas", "eps")


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """This rank's parameters, AdamW state and hyper-parameters, unsharded, keyed "<what> <parameter
    name>" ("param blocks.2.attn.wq.weight", "exp_avg ...", "lr ..."); collective over TP and FSDP
    groups. Pipeline stages hold disjoint names: the caller merges their dicts."""
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
    state: dict[str, object] = {}
    for name, p in model.named_parameters():
        state[f"param {name}"] = _full(p)
        for key, value in optimizer.state[p].items():
            state[f"{key} {name}"] = _full(value)
        state |= {f"{key} {name}": group_of[p][key] for key in HYPER}
    return state


def batches(vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, targets) of each step's global batch."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab_size, (STEPS, 2, BATCH, SEQ), generator=g)
    return [(step[0], step[1]) for step in ids]


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(model_cfg: ModelConfig, vocab_size: int, dims: ParallelDims, seed: int) -> tuple[nn.Module, DeviceMesh]:
    """The model from `seed`, as this rank holds it in the `dims` layout, and the mesh."""
    mesh = build_mesh(dims, "cpu")
    model, _ = build_parallel(model_cfg, vocab_size, dims, mesh, torch.device("cpu"), seeded_weights(model_cfg, seed))
    return model, mesh


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, vocab_size: int,
    dims: ParallelDims = ParallelDims(), mesh: DeviceMesh | None = None,
) -> None:
    """STEPS AdamW steps on `batches`, each dp rank on its own rows, a pipeline under GPipe; the
    learning rate changes per step, as the schedule's does. Every layout minimises the same global
    mean cross-entropy, so it trains like one process up to float summation order."""
    schedule = None
    if dims.pp > 1:
        pp_mesh = mesh["pp"]
        stage = PipelineStage(model, pp_mesh.get_local_rank(), dims.pp, torch.device("cpu"), group=pp_mesh.get_group())
        schedule = ScheduleGPipe(stage, n_microbatches=MICRO_BATCHES, loss_fn=_loss)
    dp_rank = mesh["dp"].get_local_rank() if mesh is not None else 0
    rows = slice(dp_rank * BATCH // dims.dp, (dp_rank + 1) * BATCH // dims.dp)
    for i, (x, y) in enumerate(batches(vocab_size)):
        for group in optimizer.param_groups:
            group["lr"] = OPTIM.lr * (i + 1)
        if schedule is None:
            _loss(model(x[rows]), y[rows]).backward()
        elif mesh["pp"].get_local_rank() == 0:
            schedule.step(x[rows])
        else:  # two stages: the second is the last
            schedule.step(target=y[rows])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def run_job(job: dict, model_cfg: ModelConfig, vocab_size: int, root: Path) -> None:
    dims = ParallelDims.model_validate(job["parallel"])
    assert dims.pp <= 2, "train() drives two pipeline stages at most"
    model, mesh = build(model_cfg, vocab_size, dims, SEED if job["kind"] == "save" else LOAD_SEED)
    optimizer = make_optimizer(model, OPTIM, torch.device("cpu"))
    if job["kind"] == "save":
        train(model, optimizer, vocab_size, dims, mesh)
        save_dcp(root / job["name"], STEPS, model, optimizer, {"layout": job["parallel"]}, keep=1)
    else:
        restored = load_latest_dcp(root / job["src"], model, optimizer)
        assert restored is not None and restored["step"] == STEPS, restored
    parts: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, full_state(model, optimizer))
    if dist.get_rank() == 0:
        torch.save({k: v for part in parts for k, v in part.items()}, root / f"{job['name']}.pt")


def main(spec_path: Path, root: Path) -> None:
    spec = json.loads(spec_path.read_text())
    model_cfg = ModelConfig.model_validate(spec["model"])
    init_distributed("cpu")
    torch.set_num_threads(1)
    try:
        for job in spec["jobs"]:
            run_job(job, model_cfg, spec["vocab_size"], root)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
