"""torchrun entry for the context-parallel tests: `cp_worker.py SPEC OUT_DIR`, one process per rank.

SPEC (JSON) names the model config, a data file written by the test (`torch.save` of the initial
state dict and the global batches) and a list of cases, run in order in one process group:
- "grads": one forward/backward on batch 0; rank 0 saves the whole-sequence logits (gathered over
  cp) and every parameter's gradient, averaged over the dp x cp ranks by DDP/FSDP.
- "train": AdamW steps on the batches, gradients clipped; rank 0 saves the per-step global mean
  loss and gradient norm, and the final weights.
It drives the building blocks the training loop uses: init_distributed, build_mesh, parallelize,
make_optimizer, clip_grad_norm.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims
from kiln.tasks.train.distributed import clip_grad_norm, init_distributed, make_optimizer
from kiln.tasks.train.model import Transformer
from kiln.tasks.train.parallel import (
    build_mesh,
    check_context_split,
    check_divisible,
    context_chunk,
    dp_cp_mesh,
    parallelize,
)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_case(case: dict, model_cfg: ModelConfig, optim_cfg: OptimConfig, data: dict) -> dict:
    dims = ParallelDims.model_validate(case["parallel"])
    xs, ys = data["x"], data["y"]  # [steps, B, T]
    mesh = build_mesh(dims, "cpu")
    model = Transformer(model_cfg, data["vocab_size"])
    model.load_state_dict(data["init"])
    check_divisible(dims, model_cfg)
    check_context_split(dims, xs.shape[2])
    parallelize(model, dims, mesh, case.get("activation_checkpointing", "none"))
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    rows = xs.shape[1] // dims.dp
    loss_mesh = dp_cp_mesh(mesh)

    def local_loss(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = xs[step, dp_rank * rows : (dp_rank + 1) * rows], ys[step, dp_rank * rows : (dp_rank + 1) * rows]
        x, y, start = context_chunk(x, y, cp_rank, dims.cp)
        logits = model(x, start_pos=start)
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def global_mean(value: torch.Tensor) -> float:
        value = value.detach().clone()
        dist.all_reduce(value, group=loss_mesh.get_group())  # gloo has no AVG
        return value.item() / loss_mesh.size()

    if case["kind"] == "grads":
        assert dims.dp == 1, "the grads case gathers logits over cp only"
        logits, loss = local_loss(0)
        loss.backward()
        chunks = [torch.empty_like(logits) for _ in range(dims.cp)]
        dist.all_gather(chunks, logits.detach().contiguous(), group=mesh["cp"].get_group())
        return {
            "logits": torch.cat(chunks, dim=1),
            "loss": global_mean(loss),
            "grads": {name: full(p.grad) for name, p in model.named_parameters()},
        }
    optimizer = make_optimizer(model, optim_cfg, torch.device("cpu"))
    losses, grad_norms = [], []
    for step in range(xs.shape[0]):
        _, loss = local_loss(step)
        loss.backward()
        grad_norms.append(clip_grad_norm(list(model.parameters()), optim_cfg.grad_clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(global_mean(loss))
    return {"loss": losses, "grad_norm": grad_norms,
            "weights": {name: full(p) for name, p in model.named_parameters()}}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    init_distributed("cpu")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    model_cfg = ModelConfig.model_validate(spec["model"])
    optim_cfg = OptimConfig.model_validate(spec["optim"])
    data = torch.load(spec["data"], weights_only=True)
    try:
        for case in spec["cases"]:
            result = run_case(case, model_cfg, optim_cfg, data)
            if dist.get_rank() == 0:
                torch.save(result, out_dir / f"{case['name']}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
