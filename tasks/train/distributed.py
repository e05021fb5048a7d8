"""Multi-process training under torchrun: process group, device mesh, data sharding, the step loop.

Every rank builds the same model from the same seed, `parallelize` splits it over the
("pp", "dp", "tp") mesh, and each data-parallel rank trains on its own rows of the global batch
from `batch_for_step` (TP ranks of one dp group share rows). With pp > 1 each rank keeps only its
pipeline stage and a GPipe schedule runs the grad_accum micro-batches through the stages. The
global batch per step is `batch_size * grad_accum` rows whatever the world size, exactly the
rows the single-process loop uses, so a parallel run's loss curve matches `train_model`'s up to
float summation order.

Given an `out_dir`, the run checkpoints every `checkpoint_every` steps with DCP (`tasks.train.dcp`)
into `out_dir/checkpoints` and, when started again, resumes from the newest intact checkpoint
there, whatever the new world size or parallel layout: the data stays exact because the global
batch of a step does not depend on them, which each step's `batch_checksum` records. The mixture
may change between attempts (new shards or domains): steps before the resume keep the data they
saw, later ones draw from the new mixture, and `mixture_history` says from which step each
applied. A finished run writes the gathered model with `save_model` to `out_dir/model`.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor import DTensor

from tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig, revalidated
from tasks.train.data_loader import Mixture, batch_for_step
from tasks.train.dcp import load_latest_dcp, save_dcp
from tasks.train.loop import make_optimizer
from tasks.train.model import Transformer, build_model, save_model
from tasks.train.parallel import ParallelDims, build_mesh, check_divisible, parallelize, pipeline_stage
from tasks.train.schedule import lr_at


@dataclass
class DistributedResult:
    world_size: int
    parallel: dict
    rank0_local_numel: int  # parameter elements rank 0 holds: shows how far the model is sharded
    loss_curve: list[tuple[int, float]]  # mean over the whole global batch
    grad_norm_curve: list[tuple[int, float]]  # before clipping
    lr_curve: list[tuple[int, float]]
    batch_checksum_curve: list[tuple[int, int]]  # `batch_checksum` of each step's global batch
    mixture_history: list[tuple[int, dict]]  # (steps completed before it applied, mixture summary)
    resumed_from_step: int | None
    model_dir: str | None  # the gathered final model, when the run finished with an out_dir
    wall_s: float  # this attempt only
    tokens_per_s: float  # tokens trained in this attempt / its training time
    started_unix: float  # when this attempt's worker began (before building the model and loading checkpoints)
    first_step_unix: float | None  # when this attempt's first optimizer step finished: "training resumed"


CHECKSUM_MOD = 2**48  # ranks' partial sums stay below 2**63 for up to 2**15 data-parallel ranks


def init_distributed(device_type: str) -> torch.device:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA); returns this rank's device.

    Started without torchrun (no WORLD_SIZE in the environment), the process forms a group of one
    over an in-memory store, so a single process can run (or resume) without a launcher.
    """
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(device_type)
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        device_id = device if device_type == "cuda" else None
        if "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=device_id)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)
    return device


def batch_checksum(x: torch.Tensor, y: torch.Tensor, first_row: int) -> int:
    """Order-sensitive digest of a batch whose rows are global rows first_row, first_row + 1, ...

    The sum over rows of a 48-bit hash of (global row index, inputs, targets), mod 2**48: the
    ranks' partial checksums add up to the global batch's, so runs with different data-parallel
    degrees can be compared step by step.
    """
    total = 0
    for r in range(x.shape[0]):
        h = hashlib.blake2b(digest_size=6)
        h.update((first_row + r).to_bytes(8, "little"))
        h.update(x[r].cpu().numpy().tobytes())
        h.update(y[r].cpu().numpy().tobytes())
        total += int.from_bytes(h.digest(), "little")
    return total % CHECKSUM_MOD


def _global_checksum(partial: int, dp_mesh: DeviceMesh, device: torch.device) -> int:
    value = torch.tensor(partial, dtype=torch.int64, device=device)  # nccl reduces device tensors only
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dp_mesh.get_group())
    return value.item() % CHECKSUM_MOD


def mixture_summary(mixture: Mixture) -> dict:
    """Each domain's weight and train shard file names: what `mixture_history` compares."""
    return {
        name: {"weight": d.weight, "train": [p.name for p in d.train]} for name, d in sorted(mixture.domains.items())
    }


def _save_full_model(model: nn.Module, model_cfg: ModelConfig, vocab_size: int, model_dir: Path) -> None:
    """Gather the (possibly sharded) weights and write them on rank 0 as a plain `save_model` folder."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        plain = Transformer(model_cfg, vocab_size)
        plain.load_state_dict(full)
        save_model(plain, model_cfg, vocab_size, model_dir)
    dist.barrier()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, pp_mesh: DeviceMesh | None = None) -> float:
    """Total L2 norm of all gradients (sharded or not), scaling them down to max_norm if above.

    Unlike torch's `clip_grad_norm_`, this takes plain tensors and DTensors on different meshes
    together (TP leaves embeddings and norms plain). Grads are grouped by layout so each group
    costs one reduction. With `pp_mesh` each rank holds a different stage, so the squared norms
    are summed over it.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            g = p.grad
            groups[(g.device_mesh, g.placements) if isinstance(g, DTensor) else None].append(g)
    sq_total = 0.0
    for grads in groups.values():
        norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
        group_norm = torch.linalg.vector_norm(norms)
        if isinstance(group_norm, DTensor):
            group_norm = group_norm.full_tensor()  # sums the shards' partial norms
        sq_total += group_norm.item() ** 2
    if pp_mesh is not None and pp_mesh.size() > 1:
        sq = torch.tensor(sq_total, dtype=torch.float64)
        dist.all_reduce(sq, group=pp_mesh.get_group())
        sq_total = sq.item()
    total = sq_total**0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def make_parallel_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """`make_optimizer`'s AdamW with each param group split by tensor kind (plain, or DTensor per mesh).

    A fused/foreach AdamW kernel cannot take plain tensors and DTensors in one call, and TP
    leaves some parameters plain (embeddings, block norms) beside DTensor ones.
    """
    base = make_optimizer(model, cfg, device)
    groups = []
    for group in base.param_groups:
        by_kind: dict[object, list[torch.Tensor]] = defaultdict(list)
        for p in group["params"]:
            by_kind[p.device_mesh if isinstance(p, DTensor) else None].append(p)
        settings = {k: v for k, v in group.items() if k != "params"}
        groups += [{**settings, "params": params} for params in by_kind.values()]
    return type(base)(groups, **{k: base.defaults[k] for k in ("lr", "betas", "eps", "fused")})


@contextmanager
def _gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    # FSDP skips the reduce-scatter on all but the last micro-batch of an accumulated step
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield


def _mean_over(value: torch.Tensor, mesh: DeviceMesh) -> float:
    # gloo has no AVG reduction: sum then divide
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
    return value.item() / mesh.size()


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _data_parallel_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, grad_accum: int, local_batch: int, dp_mesh: DeviceMesh
) -> float:
    """Forward and backward over this rank's micro-batches; returns the global batch's mean loss."""
    loss_sum = torch.zeros((), device=x.device)
    for m in range(grad_accum):
        rows = slice(m * local_batch, (m + 1) * local_batch)
        with _gradient_sync(model, m == grad_accum - 1):
            # bf16 autocast on GPU only: CPU runs stay fp32, as in the single-process loop
            with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
                logits = model(x[rows])
            loss = _loss(logits, y[rows])
            (loss / grad_accum).backward()
        loss_sum += loss.detach()
    return _mean_over(loss_sum / grad_accum, dp_mesh)


def _pipeline_step(schedule: ScheduleGPipe, pp_mesh: DeviceMesh, x: torch.Tensor, y: torch.Tensor) -> float:
    """One GPipe forward/backward; the last stage's mean micro-batch loss, broadcast to every stage."""
    pp_rank, last = pp_mesh.get_local_rank(), pp_mesh.size() - 1
    losses: list[torch.Tensor] = []
    if pp_rank == 0:
        schedule.step(x)
    elif pp_rank == last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    loss = torch.stack(losses).mean().detach() if pp_rank == last else torch.zeros((), device=x.device)
    dist.broadcast(loss, group=pp_mesh.get_group(), group_src=last)
    return loss.item()


def train_distributed(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    run_cfg: TrainRunConfig,
    dims: ParallelDims,
    mixture: Mixture,
    out_dir: Path | None = None,
    stop_after: int | None = None,
    fault_injection: dict | None = None,
) -> DistributedResult:
    """Train `run_cfg.steps` steps on this rank's part of the mesh; every rank returns the same curves.

    With `out_dir`: checkpoints, resume and the final model there (see the module docstring).
    `stop_after`: return once that many steps are done, as if the job were stopped there (steps
    after the last checkpoint are then re-run by the next attempt).
    """
    model_cfg, optim_cfg, run_cfg = revalidated(model_cfg), revalidated(optim_cfg), revalidated(run_cfg)
    run_cfg.check_fits(model_cfg)
    if out_dir is not None and (dims.pp > 1 or dims.tp > 1):
        # pp: each stage numbers its blocks from 0, so the stages' checkpoint keys collide;
        # tp: the fused qkv / gate_up weights are split in strided blocks, which DCP cannot save
        raise ValueError(
            f"checkpointing (an out_dir) with parallel.pp={dims.pp}, tp={dims.tp} is not supported yet; "
            "use pp=1 and tp=1 (dp with fsdp or ddp) for checkpointed runs"
        )
    t_start = time.perf_counter()
    started_unix = time.time()
    first_step_unix = None
    device = init_distributed(torch.device(run_cfg.device).type)
    if dist.get_world_size() != dims.world_size:
        raise ValueError(
            f"parallel.dp * parallel.tp = {dims.world_size} but torchrun started {dist.get_world_size()} "
            "processes: make --nproc_per_node * --nnodes equal dp * tp"
        )
    mesh = build_mesh(dims, device.type)
    dp_mesh, pp_mesh = mesh["dp"], mesh["pp"]
    dp_rank = dp_mesh.get_local_rank()

    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    if run_cfg.num_threads is not None:
        torch.set_num_threads(run_cfg.num_threads)
    # same seed on every rank: identical full weights before sharding, as in the single-process loop
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(run_cfg.seed)
        model = build_model(model_cfg, mixture.vocab_size)
    check_divisible(dims, model, run_cfg.batch_size)
    model = model.to(device)
    schedule = None
    if dims.pp > 1:
        pp_rank = pp_mesh.get_local_rank()
        model = pipeline_stage(model, pp_rank, dims.pp)
        stage = PipelineStage(model, pp_rank, dims.pp, device, group=pp_mesh.get_group())
        # GPipe cuts the step's rows into grad_accum micro-batches in order, as the loop does,
        # and scales their gradients by 1 / grad_accum
        schedule = ScheduleGPipe(stage, n_microbatches=run_cfg.grad_accum, loss_fn=_loss)
    else:
        model = parallelize(model, dims, mesh)
    optimizer = make_parallel_optimizer(model, optim_cfg, device)
    local_numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    max_norm = optim_cfg.grad_clip if optim_cfg.grad_clip > 0 else float("inf")

    identity = {
        "model": model_cfg.identity(),
        "optim": optim_cfg.identity(),
        "run": run_cfg.identity(),
        "vocab_size": mixture.vocab_size,
    }
    identity = json.loads(json.dumps(identity))  # as it reads back from a checkpoint
    ckpt_root = out_dir / "checkpoints" if out_dir is not None else None
    curves: dict[str, list] = {"loss": [], "grad_norm": [], "lr": [], "batch_checksum": []}
    mixture_history = [[0, mixture_summary(mixture)]]
    resumed = load_latest_dcp(ckpt_root, model, optimizer) if ckpt_root is not None else None
    if resumed is not None:
        if resumed["identity"] != identity:
            raise ValueError(
                f"checkpoints in {ckpt_root} were written by a run with a different model, optim or "
                "train config (or vocabulary); use a fresh out_dir or delete that folder"
            )
        curves = {name: [tuple(p) for p in curve] for name, curve in resumed["curves"].items()}
        mixture_history = resumed["mixture_history"]
        if mixture_history[-1][1] != mixture_summary(mixture):
            mixture_history.append([resumed["step"], mixture_summary(mixture)])
    start = resumed["step"] if resumed is not None else 0

    rows_per_step = run_cfg.batch_size * run_cfg.grad_accum
    local_batch = run_cfg.batch_size // dims.dp
    model.train()
    t_train = time.perf_counter()
    step = start
    for i in range(start, run_cfg.steps):
        lr = lr_at(i, optim_cfg, run_cfg.steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = batch_for_step(
            mixture, run_cfg.seed, i, dp_rank, dims.dp, rows_per_step // dims.dp, run_cfg.seq_len
        )
        checksum = _global_checksum(batch_checksum(x, y, dp_rank * (rows_per_step // dims.dp)), dp_mesh, device)
        x, y = x.to(device), y.to(device)
        if schedule is not None:
            step_loss = _pipeline_step(schedule, pp_mesh, x, y)
        else:
            step_loss = _data_parallel_step(model, x, y, run_cfg.grad_accum, local_batch, dp_mesh)
        grad_norm = clip_grad_norm(list(model.parameters()), max_norm, pp_mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step = i + 1
        if first_step_unix is None:
            first_step_unix = time.time()
        _maybe_inject_fault(fault_injection, out_dir, step)
        for name, value in (("loss", step_loss), ("grad_norm", grad_norm), ("lr", lr), ("batch_checksum", checksum)):
            curves[name].append((step, value))
        if ckpt_root is not None and step % run_cfg.checkpoint_every == 0:
            train_state = {"identity": identity, "curves": curves, "mixture_history": mixture_history}
            save_dcp(ckpt_root, step, model, optimizer, train_state, run_cfg.keep_checkpoints, run_cfg.keep_every)
        if stop_after is not None and step >= stop_after:
            break
    train_s = time.perf_counter() - t_train
    model_dir = None
    if out_dir is not None and step == run_cfg.steps:
        model_dir = out_dir / "model"
        _save_full_model(model, model_cfg, mixture.vocab_size, model_dir)
    return DistributedResult(
        world_size=dims.world_size,
        parallel=dims.model_dump(mode="json"),
        rank0_local_numel=local_numel,
        loss_curve=curves["loss"],
        grad_norm_curve=curves["grad_norm"],
        lr_curve=curves["lr"],
        batch_checksum_curve=curves["batch_checksum"],
        mixture_history=[tuple(entry) for entry in mixture_history],
        resumed_from_step=start if resumed is not None else None,
        model_dir=str(model_dir) if model_dir is not None else None,
        wall_s=time.perf_counter() - t_start,
        tokens_per_s=(step - start) * rows_per_step * run_cfg.seq_len / train_s if train_s > 0 else 0.0,
        started_unix=started_unix,
        first_step_unix=first_step_unix,
    )


def _maybe_inject_fault(fault_injection: dict | None, out_dir: Path | None, step: int) -> None:
    """Tests only: `{"kill_rank_at_step": [rank, step]}` SIGKILLs that rank once (a marker in out_dir
    makes the relaunched job run clean), as a crashed node would."""
    if not fault_injection:
        return
    unknown = set(fault_injection) - {"kill_rank_at_step"}
    if unknown or out_dir is None:
        raise ValueError(f"fault_injection supports kill_rank_at_step with an out_dir; got {sorted(fault_injection)}")
    rank, at_step = fault_injection["kill_rank_at_step"]
    marker = out_dir / ".fault_injected"
    if step == at_step and dist.get_rank() == rank and not marker.exists():
        marker.write_text(f"rank {rank} killed at step {step}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def write_result(result: DistributedResult, out_path: Path) -> None:
    """Rank 0 writes the result as JSON (other ranks hold the same numbers and write nothing)."""
    if dist.get_rank() == 0:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(asdict(result), indent=2) + "\n")
