"""torchrun entry for test_parallel: `layout_worker.py INIT_SPEC INIT_OUT [dist_worker args]`, one process per rank.

First, for each layout of INIT_SPEC (JSON: a list of {"name", "model", "parallel"}), build the model
as training does (`build_parallel`: meta device, parallelised, materialised, each rank filling only
its shards from seed SEED), gather the full weights (all shards, all pipeline stages) and, on
rank 0, save {name: state dict} to INIT_OUT. Then hand the remaining arguments to
`tasks.train.dist_worker` in the same process group: the training runs, one after another.
One torchrun launch does both, since each launch costs seconds of imports per process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln.tasks.train import dist_worker
from kiln.tasks.train.config import ModelConfig, ParallelDims
from kiln.tasks.train.distributed import init_distributed
from kiln.tasks.train.model import seeded_weights
from kiln.tasks.train.parallel import build_mesh, build_parallel

SEED = 0
VOCAB = 64


def gathered_weights(model_cfg: ModelConfig, dims: ParallelDims) -> dict[str, torch.Tensor]:
    """The initial weights of every rank's part in the `dims` layout, gathered whole on every rank."""
    mesh = build_mesh(dims, "cpu")
    held, _ = build_parallel(model_cfg, VOCAB, dims, mesh, torch.device("cpu"), seeded_weights(model_cfg, SEED))
    local = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for name, p in held.named_parameters()}
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(parts, local)
    return {name: value for part in parts for name, value in part.items()}


def main(spec_path: Path, out: Path, rest: list[str]) -> None:
    init_distributed("cpu")
    torch.set_num_threads(1)
    weights = {case["name"]: gathered_weights(ModelConfig.model_validate(case["model"]),
                                              ParallelDims.model_validate(case["parallel"]))
               for case in json.loads(spec_path.read_text())}
    if dist.get_rank() == 0:
        torch.save(weights, out)
    dist_worker.main(rest)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
