"""The parallel runtime the training loop runs on: process group, mesh, layout, one step, the gathered model.

`Layout.create(dims, device)` is the loop's only view of parallelism. With `dims.world_size == 1`
it is a single process without any process group or mesh, and every method is the plain
computation. Otherwise it joins torchrun's process group, builds the ("pp", "dp", "cp", "tp")
mesh, and `build` constructs this rank's part of the model in place (`tasks.train.parallel`):
on the meta device, then TP, context parallel, activation checkpointing, FSDP2 or DDP, or
pipeline stages driven by the configured torch schedule (GPipe, 1F1B or interleaved 1F1B), then
materialised and initialised shard by shard. `run.precision` bf16-mixed is FSDP2's
mixed-precision policy (FSDP is applied for it even without data parallelism), and bf16 autocast
where there is no FSDP (one process, DDP). Each data-parallel rank trains on its own rows of the step's global batch
(`batch`; TP, CP and PP ranks of one dp group share rows, and each CP rank takes its own chunk
of every sequence), so the global batch per step is `batch_size` rows whatever the world size —
exactly the rows a single process uses — and a parallel run's loss curve matches the
single-process one up to float summation order. `batch_checksum` digests each step's global
batch, so runs with different layouts (or a resumed run) can be compared step by step.
"""

from __future__ import annotations

import hashlib
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.data_loader import Mixture, draw_batch
from kiln.tasks.train.loss import objective
from kiln.tasks.train.model import Transformer, WeightSource, fill_weights, materialize, model_from_state, reset_rope
from kiln.tasks.train.parallel import (
    TransformerStage,
    apply_activation_checkpointing,
    build_mesh,
    build_parallel,
    check_context_split,
    check_divisible,
    context_chunk,
    dp_cp_mesh,
    init_weights,
    uses_fsdp,
)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

CHECKSUM_MOD = 2**48  # ranks' partial sums stay below 2**63 for up to 2**15 data-parallel ranks


def init_distributed(device_type: str) -> torch.device:
    """Join torchrun's process group (gloo on CPU, nccl on CUDA); returns this rank's device."""
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(device_type)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                device_id=device if device_type == "cuda" else None)
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


def make_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device, fused: bool | None = None
                   ) -> torch.optim.AdamW:
    """AdamW with weight decay on matmul weights only (not norms, embeddings or biases).

    Each group is split by tensor kind (plain, or DTensor per mesh): a fused/foreach AdamW kernel
    cannot take plain tensors and DTensors in one call, and TP leaves some parameters plain.
    `fused` defaults to the fused kernel on CPU and CUDA (`tasks.train.verify` asks for foreach).
    """
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    by_kind: dict[tuple[bool, object], list[torch.Tensor]] = defaultdict(list)
    for p in model.parameters():  # tied weights appear once
        decay = p.dim() >= 2 and id(p) not in embedding_ids
        by_kind[(decay, p.device_mesh if isinstance(p, DTensor) else None)].append(p)
    groups = [{"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
              for (decay, _), params in sorted(by_kind.items(), key=lambda kv: not kv[0][0])]
    # the fused kernel exists for CPU and CUDA in torch >= 2.4 and is the fastest option on both
    if fused is None:
        fused = device.type in ("cpu", "cuda")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def _compile_blocks(model: nn.Module) -> None:
    for block in model.blocks.children():
        block.compile()


@dataclass
class Layout:
    """Where this process sits in the parallel layout, and the collectives the loop needs."""

    dims: ParallelDims
    device: torch.device
    mesh: DeviceMesh | None  # None: a single process, no process group
    _pipeline_ce: list[torch.Tensor] = field(default_factory=list)  # the last stage's micro-batch losses
    _n_microbatches: int = 1
    _autocast: bool = False  # bf16 autocast around forward: bf16-mixed where FSDP does not cast
    _stages: list[TransformerStage] = field(default_factory=list)  # the pipeline stages this rank runs

    @classmethod
    def create(cls, dims: ParallelDims, device: torch.device) -> Layout:
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != dims.world_size:
            raise ValueError(
                f"parallel.pp * dp * cp * tp = {dims.world_size} but {launched} processes were started: make "
                "torchrun's --nproc_per_node * --nnodes equal the product, or train in one process with all of them 1"
            )
        if dims.world_size == 1:
            return cls(dims, device, None)
        device = init_distributed(device.type)
        return cls(dims, device, build_mesh(dims, device.type))

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.mesh is not None else 0

    @property
    def is_main(self) -> bool:
        """Rank 0 writes files, logs metrics and reports events; every rank holds the same numbers."""
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank() if self.mesh is not None else 0

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self.mesh["pp"] if self.mesh is not None else None

    def build(self, model_cfg: ModelConfig, vocab_size: int, run_cfg: TrainRunConfig, z_loss: float,
              source: WeightSource | None) -> tuple[nn.Module, Any]:
        """This rank's part of the model, built on the meta device, split over the layout with
        `run.activation_checkpointing` and `run.precision`, then materialised and initialised from
        `source` (None: left on the meta device, see `build_parallel`): (the module to train, the
        pipeline schedule or None). `run.compile` compiles the whole model on one process, and
        block by block when sharded (torchtitan's choice: FSDP's gathers and the pipeline's cuts
        sit at block boundaries)."""
        check_divisible(self.dims, model_cfg)
        check_context_split(self.dims, run_cfg.seq_len)
        dims, precision = self.dims, run_cfg.resolved_precision
        self._autocast = precision == "bf16-mixed" and not (self.mesh is not None and uses_fsdp(dims, precision))
        if self.mesh is None:
            model = Transformer(model_cfg, vocab_size, "meta")
            apply_activation_checkpointing(model, run_cfg.activation_checkpointing)
            if source is not None:
                materialize(model, self.device)
                fill_weights(model, model_cfg, source)
            if run_cfg.compile:
                model.compile()
            return model, None
        held, self._stages = build_parallel(model_cfg, vocab_size, dims, self.mesh, self.device, source,
                                            run_cfg.activation_checkpointing, precision)
        if run_cfg.compile:
            for module in self._stages or [held]:
                _compile_blocks(module)
        if dims.pp == 1:
            return held, None
        return held, self._schedule(run_cfg.grad_accum, z_loss)

    def _schedule(self, n_microbatches: int, z_loss: float) -> Any:
        """Torch's `dims.pp_schedule` over this rank's stages (stage s of the pipeline runs on rank s mod pp)."""
        pp_mesh = self.mesh["pp"]
        stages = [PipelineStage(module, pp_mesh.get_local_rank() + i * self.dims.pp, self.dims.num_stages,
                                self.device, group=pp_mesh.get_group()) for i, module in enumerate(self._stages)]

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss, total = objective(logits, targets, z_loss)
            self._pipeline_ce.append(loss.detach())
            return total

        # the schedule cuts the step's rows into grad_accum micro-batches in order, as the loop
        # does, and scales their gradients by 1 / grad_accum
        self._n_microbatches = n_microbatches
        if self.dims.pp_schedule == "interleaved-1f1b":
            return ScheduleInterleaved1F1B(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
        return SCHEDULES[self.dims.pp_schedule](stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)

    def reinitialize(self, model: nn.Module, model_cfg: ModelConfig, source: WeightSource) -> None:
        """Refill the (already built) model's shards from `source`: a rollback to step 0."""
        init_weights(self._stages or [model], model_cfg, source)

    def set_rope(self, model: nn.Module, model_cfg: ModelConfig) -> None:
        """Recompute this rank's RoPE tables for `model_cfg` (a data phase that changes the rotary base
        or scaling, see `Trainer.use_rope`); every part of the model this rank holds."""
        for part in self._stages or [model]:
            reset_rope(part, model_cfg)

    def batch(self, mixture: Mixture, seed: int, index: int, rows: int, seq_len: int, slot: tuple[int, int] = (0, 1)
              ) -> tuple[torch.Tensor, torch.Tensor, int, dict[str, int]]:
        """This rank's rows of batch `index`, the checksum of the whole global batch and how many of
        its rows each domain gave (`slot`: the step's place in its phase, see `draw_batch`)."""
        dp, dp_rank = self.dims.dp, self.dp_rank
        x, y, domains = draw_batch(mixture, seed, index, dp_rank, dp, rows // dp, seq_len, slot)
        checksum = batch_checksum(x, y, dp_rank * (rows // dp))
        names = sorted(n for n, d in mixture.domains.items() if d.weight > 0)
        counts = [domains.count(n) for n in names]
        if self.mesh is not None:
            # one collective for both: nccl reduces device tensors
            value = torch.tensor([checksum, *counts], dtype=torch.int64, device=self.device)
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.mesh["dp"].get_group())
            checksum, *counts = value.tolist()
            checksum %= CHECKSUM_MOD
        return x.to(self.device), y.to(self.device), checksum, dict(zip(names, counts))

    def forward_backward(self, model: nn.Module, schedule: Any, x: torch.Tensor, y: torch.Tensor,
                         grad_accum: int, z_loss: float, mtp_weight: float = 0.0) -> float:
        """Gradients of one step over this rank's rows in grad_accum micro-batches; the global batch's
        mean cross-entropy (the same number on every rank). Under context parallel each cp rank of a
        dp group takes its own chunk of every row: the global loss is the mean over all dp x cp ranks."""
        if schedule is not None:
            return self._pipeline_step(schedule, x, y)
        mean = self.accumulate_gradients(model, x, y, grad_accum, z_loss, mtp_weight)
        if self.mesh is not None:
            # gloo has no AVG reduction: sum then divide
            dist.all_reduce(mean, op=dist.ReduceOp.SUM, group=dp_cp_mesh(self.mesh).get_group())
            return mean.item() / (self.dims.dp * self.dims.cp)
        return mean.item()

    def accumulate_gradients(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, grad_accum: int,
                             z_loss: float, mtp_weight: float = 0.0) -> torch.Tensor:
        """Forward and backward of this rank's rows in grad_accum micro-batches (no pipeline); this
        rank's mean cross-entropy as a tensor.

        FSDP reduce-scatters each micro-batch's gradients as its backward ends (as torchtitan does):
        skipping the sync would keep every layer's unsharded gradient until the last micro-batch."""
        loss_sum = torch.zeros((), device=x.device)
        for x_mb, y_mb, start_pos in self.microbatches(x, y, grad_accum):
            loss, total = self.microbatch_loss(model, x_mb, y_mb, start_pos, z_loss, mtp_weight)
            (total / grad_accum).backward()
            loss_sum += loss.detach()
        return loss_sum / grad_accum

    def microbatches(self, x: torch.Tensor, y: torch.Tensor, grad_accum: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(inputs, targets, start_pos) of each micro-batch of this rank's rows: under context
        parallel, this cp rank's chunk of them."""
        start_pos = 0
        if self.dims.cp > 1:
            x, y, start_pos = context_chunk(x, y, self.mesh["cp"].get_local_rank(), self.dims.cp)
        rows = x.shape[0] // grad_accum
        return [(x[m * rows:(m + 1) * rows], y[m * rows:(m + 1) * rows], start_pos) for m in range(grad_accum)]

    def microbatch_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, start_pos: int,
                        z_loss: float, mtp_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's forward, loss included (`Transformer.forward` with targets: the output
        projection fused with the cross-entropy, z-loss and multi-token prediction): (cross-entropy,
        what to differentiate). Nothing waits on a value, so `tasks.train.verify` runs it on fake tensors."""
        with self._autocast_context():
            return model(x, start_pos=start_pos, targets=y, z_loss=z_loss, mtp_weight=mtp_weight)

    def _autocast_context(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self._autocast)

    def _pipeline_step(self, schedule: Any, x: torch.Tensor, y: torch.Tensor) -> float:
        """One pipelined forward/backward; the last stage's mean micro-batch loss, broadcast to every stage."""
        pp_mesh = self.mesh["pp"]
        pp_rank, last = pp_mesh.get_local_rank(), pp_mesh.size() - 1
        self._pipeline_ce.clear()
        with self._autocast_context():
            if pp_rank == 0:  # the first stage is rank 0's (its others, if interleaved, take no input)
                schedule.step(x)
            elif pp_rank == last:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()
        # the first step also calls loss_fn once on placeholder data to infer shapes: only the
        # last grad_accum calls are this step's micro-batches
        n = self._n_microbatches
        loss = torch.stack(self._pipeline_ce[-n:]).mean() if pp_rank == last else torch.zeros((), device=x.device)
        dist.broadcast(loss, group=pp_mesh.get_group(), group_src=last)
        if self.dims.dp > 1:  # each dp replica of the pipeline trains its own rows
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.mesh["dp"].get_group())
            return loss.item() / self.dims.dp
        return loss.item()

    def local_numel(self, model: nn.Module) -> int:
        """Parameter elements this rank holds: shows how far the model is sharded."""
        return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())

    def full_model(self, model: nn.Module, model_cfg: ModelConfig, vocab_size: int) -> Transformer | None:
        """The trained weights as one plain `Transformer` on the main rank (None elsewhere; collective).

        Sharded parameters are gathered one at a time (every rank takes part; only the main rank
        keeps them) and pipeline stages merged, each stage's main rank sending its stage's weights.
        """
        if self.mesh is None:
            assert isinstance(model, Transformer)
            return model
        state = {}
        for name, value in model.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if self.is_main or (self.dims.pp > 1 and self._is_stage_main):
                state[name] = full.detach().cpu()
        if self.dims.pp > 1:
            parts: list[dict[str, torch.Tensor]] | None = [{} for _ in range(dist.get_world_size())] \
                if self.is_main else None
            dist.gather_object(state, parts, dst=0)
            state = {k: v for part in parts or [] for k, v in part.items()}
        return model_from_state(model_cfg, vocab_size, state) if self.is_main else None

    @property
    def _is_stage_main(self) -> bool:
        """The first rank of this pipeline stage's dp x cp x tp group: the one that sends its weights."""
        return self.mesh["dp"].get_local_rank() == 0 and self.mesh["cp"].get_local_rank() == 0 \
            and self.mesh["tp"].get_local_rank() == 0

    def broadcast(self, value: Any) -> Any:
        """The main rank's `value`, on every rank."""
        if self.mesh is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()
