"""The planner checked against torch: build a planned layout for real and measure one training step.

`measure_rank` builds the layout exactly as training does (`Layout` and
`tasks.train.parallel.build_parallel`: meta device, TP, CP, activation checkpointing, FSDP2 with
the run's mixed-precision policy, `to_empty`), in one process posing as one rank of the job on
torch's fake process group (`FakeStore`: any world size, collectives return at once) and on fake
tensors (`FakeTensorMode`: shapes, dtypes and devices, but no data and no memory), then runs one
training step under torch's `MemTracker`, which follows every tensor storage the step creates and
frees, and reports its peak. This is torchtitan's `scripts/estimate/estimation.py` method; unlike
it, TP, CP and pipeline layouts are measured too.

What runs is the trainer's own step where fake tensors allow: `Layout.accumulate_gradients`
(forward, loss, backward for each micro-batch), then AdamW's step. Three departures, each from a
fake-mode limit:
- gradient clipping is left out: it reads the norm's value (`.item()`), which fake tensors do not
  have; it allocates one scalar per parameter group;
- AdamW runs its foreach kernels, not the fused one the trainer uses on GPUs: under FakeTensorMode
  the fused kernel's DTensor path materialises unsharded states (measured: 60 GiB for a model
  whose sharded states take 0.5 GiB; on real tensors both keep sharded states);
- a pipeline rank runs its micro-batches in the order torch's schedule gives it
  (`pipeline_order`, from the schedule object itself), forward and backward on its stage modules,
  with FSDP held unsharded and unsynchronised between micro-batches as `PipelineStage` does; the
  schedule's own `step` cannot run on a fake group (it exchanges shapes and reads values).
Optimizer states are created before the tracked step (AdamW creates them lazily in its first
step), so the step measured is a steady one. The CUDA caching allocator's rounding and
fragmentation are not modelled (the planner's `reserved_gb` stands for them).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from kiln.tasks.train.distributed import Layout, make_optimizer
from kiln.tasks.train.loss import objective
from kiln.tasks.train.model import materialize
from kiln.tasks.train.parallel import TransformerStage, build_mesh
from kiln.tasks.train.plan_memory import rank_memory, rank_parameters, stage_layers
from kiln.tasks.train.planner import Plan, PlanSearch

DEVICE = torch.device("cpu")  # fake tensors carry a device but use none; CUDA is not needed


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds, in bytes, measured on the built layout."""

    rank: int
    param_bytes: int  # this rank's shards of the fp32 master weights
    grad_bytes: int  # its gradients after the step's backward
    optimizer_bytes: int  # AdamW's states
    peak_bytes: int  # the step's peak, as MemTracker reports it


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def measured_microbatches(dims: ParallelDims, grad_accum: int) -> int:
    """How many of a step's `grad_accum` micro-batches reach its peak: the step repeats itself
    after that, so measuring the rest would only cost time (each takes seconds on fake tensors).
    Outside a pipeline, two: the second's backward starts with the first's gradients reduced.
    Under 1F1B or interleaved 1F1B, 2 pp: the warm-up, then the most micro-batches in flight
    again, with gradients (for interleaved, rounds of pp micro-batches, as in the full step).
    GPipe holds every micro-batch at once, so it runs them all."""
    if dims.pp == 1:
        return min(grad_accum, 2)
    if dims.pp_schedule == "gpipe" or grad_accum % dims.pp:
        return grad_accum
    return min(grad_accum, 2 * dims.pp)


def measure_rank(cfg: ModelConfig, vocab_size: int, dims: ParallelDims, run: TrainRunConfig, rank: int,
                 step: bool = True) -> RankMemory:
    """Build `rank`'s part of the `dims` layout on the fake process group and fake tensors, and
    measure one training step of `run` (micro-batches of `run.batch_size / (dp * grad_accum)`
    sequences, `measured_microbatches` of them); with `step=False` only what it holds before one
    (gradient and peak bytes are then 0)."""
    run = run.model_copy(update={"batch_size": run.batch_size // run.grad_accum
                                 * measured_microbatches(dims, run.grad_accum),
                                 "grad_accum": measured_microbatches(dims, run.grad_accum)})
    fake_group = dims.world_size > 1
    if fake_group:
        dist.init_process_group("fake", rank=rank, world_size=dims.world_size, store=FakeStore())
    try:
        # the mesh and the parallelised model are built on the meta device outside FakeTensorMode:
        # FSDP over a TP mesh computes mesh coordinates from tensor values, which fake tensors lack
        layout = Layout(dims, DEVICE, build_mesh(dims, DEVICE.type) if fake_group else None)
        model, schedule = layout.build(cfg, vocab_size, run, 0.0, None)
        # the mesh's own (real) index tensors meet fake ones in DTensor's redistributions
        with FakeTensorMode(allow_non_fake_inputs=True):
            for module in layout._stages or [model]:
                materialize(module, DEVICE)
            return _measure(layout, model, schedule, cfg, vocab_size, run, rank, step)
    finally:
        if fake_group:
            dist.destroy_process_group()



def _measure(layout: Layout, model: nn.Module, schedule: Any, cfg: ModelConfig, vocab_size: int,
             run: TrainRunConfig, rank: int, step: bool) -> RankMemory:
    dims = layout.dims
    optimizer = make_optimizer(model, OptimConfig(), DEVICE, fused=False)
    params = [p for p in model.parameters()]
    for p in params:  # AdamW's states, as after any step but the first
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state_bytes = sum(_nbytes(v) for state in optimizer.state.values() for v in state.values()
                      if isinstance(v, torch.Tensor))
    param_bytes = sum(_nbytes(p) for p in params)
    if not step:
        return RankMemory(rank, param_bytes, 0, state_bytes, 0)

    rows = run.batch_size // dims.dp
    x = torch.randint(0, vocab_size, (rows, run.seq_len), device=DEVICE)
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        if dims.pp > 1:
            _pipeline_rank_step(layout, schedule, cfg, run, x)
        else:
            for x_mb, y_mb, start_pos in layout.microbatches(x, x, run.grad_accum):
                total = _Step()(lambda: layout.microbatch_loss(model, x_mb, y_mb, start_pos, 0.0)[1])
                (total / run.grad_accum).backward()
        grad_bytes = sum(_nbytes(p.grad) for p in params if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return RankMemory(rank, param_bytes, grad_bytes, state_bytes, tracker.get_tracker_snapshot("peak")[DEVICE]["Total"])


class _Step(nn.Module):
    """One micro-batch's work as a call of a new module: MemTracker refuses a second forward of a
    top-level module (it takes it for the next iteration), but follows a module called again
    inside another one."""

    def forward(self, work: Callable[[], torch.Tensor]) -> torch.Tensor:
        return work()


def _pipeline_rank_step(layout: Layout, schedule: Any, cfg: ModelConfig, run: TrainRunConfig, x: torch.Tensor) -> None:
    """This pipeline rank's forwards and backwards of one step, in the order torch's schedule runs
    them. A stage's backwards follow its forwards in micro-batch order, so each backward takes the
    oldest forward still waiting (torch 2.13 numbers 1F1B's micro-batches in `pipeline_order` for
    display, one off on later ranks; the order of the actions is what its runtime follows)."""
    pp_rank = layout.mesh["pp"].get_local_rank()
    stages = layout._stages
    by_index = {pp_rank + i * layout.dims.pp: stage for i, stage in enumerate(stages)}
    order = schedule_order(schedule, pp_rank)
    micro = x.shape[0] // run.grad_accum
    dtype = torch.bfloat16 if run.resolved_precision == "bf16-mixed" else torch.float32
    waiting: dict[int, deque[torch.Tensor]] = {index: deque() for index in by_index}
    last_backward = {index: max(i for i, (s, kind) in enumerate(order) if s == index and kind == "B")
                     for index in by_index}
    for stage in stages:
        if isinstance(stage, FSDPModule):  # as PipelineStage keeps them between micro-batches
            stage.set_requires_gradient_sync(False)
            stage.set_reshard_after_backward(False)
    forwards = dict.fromkeys(by_index, 0)
    for i, (stage_index, kind) in enumerate(order):
        stage = by_index[stage_index]
        if kind == "F":
            rows = slice(forwards[stage_index] * micro, (forwards[stage_index] + 1) * micro)
            forwards[stage_index] += 1
            if stage.tok_emb is not None:
                inputs = x[rows]
            else:  # the activation the previous stage sends
                inputs = torch.empty(micro, run.seq_len, cfg.d_model, dtype=dtype, device=DEVICE, requires_grad=True)
            waiting[stage_index].append(_Step()(lambda: _stage_forward(stage, inputs, x[rows])))
            continue
        if i == last_backward[stage_index] and isinstance(stage, FSDPModule):
            # the step's last backward of the stage reduce-scatters its gradients and reshards
            stage.set_requires_gradient_sync(True)
            stage.set_reshard_after_backward(True)
        out = waiting[stage_index].popleft()
        if out.dim() == 0:
            (out / run.grad_accum).backward()
        else:  # the gradient the next stage sends back
            out.backward(torch.empty_like(out))


def _stage_forward(stage: TransformerStage, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A stage's output for one micro-batch; the last stage's is its loss, as the schedule's loss_fn computes it."""
    out = stage(inputs)
    return objective(out, targets, 0.0)[1] if stage.lm_head is not None else out


def schedule_order(schedule: Any, pp_rank: int) -> list[tuple[int, str]]:
    """(stage index, "F" or "B") of pipeline rank `pp_rank`'s compute actions in one step, in
    order, from the `pipeline_order` of torch's schedule object."""
    return [(action.stage_index, action.computation_type.value) for action in schedule.pipeline_order[pp_rank]
            if action is not None and action.computation_type.value in ("F", "B")]


# ---- the planner's figures against the measurement -------------------------------------------

BYTES_TOLERANCE = 0.01  # parameter, gradient and optimizer bytes: the same tensors, counted twice
PEAK_TOLERANCE = 0.15  # the step's peak: a model of when tensors are freed, against their tracking


@dataclass(frozen=True)
class RankCheck:
    """One rank's figures from the planner (`planned`) and from torch (`measured`), in bytes."""

    rank: int
    pp_rank: int
    planned: dict[str, int]
    measured: dict[str, int]

    def errors(self) -> dict[str, float]:
        """Relative error of each planned figure against the measured one."""
        return {k: abs(self.planned[k] - self.measured[k]) / max(self.measured[k], 1) for k in self.planned}

    @property
    def agrees(self) -> bool:
        return all(err <= (PEAK_TOLERANCE if k == "peak" else BYTES_TOLERANCE) for k, err in self.errors().items())


@dataclass(frozen=True)
class Verification:
    plan: Plan
    checks: list[RankCheck]
    wall_s: float
    scaled_from: tuple[int, ...] | None = None  # blocks per stage the step was measured at, when extended

    @property
    def agrees(self) -> bool:
        return all(check.agrees for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"agrees": self.agrees, "wall_s": self.wall_s, "layout": self.plan.layout.describe(),
                "scaled_from": self.scaled_from,
                "ranks": [{"rank": c.rank, "pp_rank": c.pp_rank, "planned": c.planned, "measured": c.measured,
                           "errors": c.errors()} for c in self.checks]}

    def max_error(self, kind: str) -> float:
        """The largest relative error of `kind` ("params", "grads", "optimizer" or "peak") over the ranks."""
        return max(check.errors()[kind] for check in self.checks)


def verify_plan(search: PlanSearch, plan: Plan | None = None) -> Verification:
    """Build `plan` (the search's best by default) for real on the fake process group and compare
    the planner's per-rank figures with torch's: the first and the last pipeline rank (the first
    holds the embedding and the most micro-batches in flight, the last the head).

    Parameter and optimizer bytes come from the whole model as planned. The training step costs
    about a second per block on fake tensors, so when the rank's stages are deeper than
    SCALING_DEPTHS[-1] blocks, gradient bytes and the step's peak are measured at a few depths
    and extended linearly to the planned one (`scaled_step`): every block adds the same tensors,
    and the increments are checked equal to the byte."""
    plan = plan or search.require_best()
    lo, started = plan.layout, time.perf_counter()
    dims, cfg = plan.layout_dims(), search.model
    run = TrainRunConfig(batch_size=search.global_batch_seqs, seq_len=search.seq_len,
                         grad_accum=plan.num_microbatches, activation_checkpointing=lo.checkpointing,
                         precision=search.precision)
    checks: list[RankCheck] = []
    scaled: tuple[int, ...] | None = None
    for pp_rank in sorted({0, lo.pp - 1}):
        # the last cp rank of the stage: its queries see every key (the mask the planner prices)
        rank = pp_rank * lo.dp * lo.cp * lo.tp + (lo.cp - 1) * lo.tp
        states = measure_rank(cfg, search.vocab_size, dims, run, rank, step=False)
        depth = max(stage_layers(cfg, lo, pp_rank))
        if cfg.n_layers <= dims.num_stages * SCALING_DEPTHS[-1]:
            stepped = measure_rank(cfg, search.vocab_size, dims, run, rank)
        else:
            stepped, scaled = scaled_step(cfg, search.vocab_size, dims, run, rank, depth)
        est = rank_memory(cfg, search.vocab_size, search.seq_len, lo, plan.num_microbatches, 0, search.precision,
                          pp_rank)
        params = rank_parameters(cfg, search.vocab_size, lo, pp_rank)
        planned = {"params": 4 * params, "grads": 4 * params, "optimizer": est.optimizer, "peak": est.tracked}
        checks.append(RankCheck(rank, pp_rank, planned, {
            "params": states.param_bytes, "grads": stepped.grad_bytes, "optimizer": states.optimizer_bytes,
            "peak": stepped.peak_bytes}))
    return Verification(plan, checks, time.perf_counter() - started, scaled)


SCALING_DEPTHS = (3, 4, 5)  # blocks per pipeline stage a deep model's step is first measured at


class NotLinearError(RuntimeError):
    """The step's bytes did not settle into the same growth per block: extending them would be a guess."""


def scaled_step(cfg: ModelConfig, vocab_size: int, dims: ParallelDims, run: TrainRunConfig, rank: int,
                depth: int) -> tuple[RankMemory, tuple[int, ...]]:
    """`rank`'s gradient bytes and step peak at `depth` blocks per stage, from measurements of the
    same layout and batch at SCALING_DEPTHS, and more, blocks per stage, extended by the last
    per-block increment once two consecutive increments are equal; returns them with the depths
    measured.

    The peak is the largest of moments (the loss's backward, a block's backward, the end of
    backward) whose bytes each grow linearly with the blocks; the ones holding activations grow
    fastest and win in deep models, but may not yet at a few blocks, so measuring continues
    until the growth is the same twice in a row."""
    depths = list(SCALING_DEPTHS)
    samples = [measure_rank(cfg.model_copy(update={"n_layers": k * dims.num_stages}), vocab_size, dims, run, rank)
               for k in depths]
    while True:
        grads, peaks = ([getattr(s, kind) for s in samples[-3:]] for kind in ("grad_bytes", "peak_bytes"))
        if grads[2] - grads[1] == grads[1] - grads[0] and peaks[2] - peaks[1] == peaks[1] - peaks[0]:
            break
        if depths[-1] >= depth:
            raise NotLinearError(f"the step's bytes at {depths} blocks per stage ({[s.peak_bytes for s in samples]}) "
                                 f"never grew by the same amount twice: cannot extend them to {depth} blocks")
        depths.append(depths[-1] + 1)
        samples.append(measure_rank(cfg.model_copy(update={"n_layers": depths[-1] * dims.num_stages}), vocab_size,
                                    dims, run, rank))
    extra = depth - depths[-1]
    return RankMemory(rank, 0, grads[2] + extra * (grads[2] - grads[1]), 0,
                      peaks[2] + extra * (peaks[2] - peaks[1])), tuple(depths)


def render_verification(verification: Verification) -> str:
    """The planner's and torch's figures side by side, per rank checked, and the verdict."""
    lo = verification.plan.layout
    step = "one training step under MemTracker"
    if verification.scaled_from:
        step += (f" at {', '.join(map(str, verification.scaled_from))} blocks per stage, gradients and peak extended "
                 "by the per-block increment (checked equal)")
    lines = ["", f"Verified against torch: {lo.describe()} built for real on the fake process group "
             f"(world size {lo.world_size}, fake tensors), {step} ({verification.wall_s:.0f} s)",
             f"  {'rank':>5} {'':10} {'planner GiB':>12} {'torch GiB':>10} {'error':>7}  bound"]
    for check in verification.checks:
        errors = check.errors()
        for kind in ("params", "grads", "optimizer", "peak"):
            bound = PEAK_TOLERANCE if kind == "peak" else BYTES_TOLERANCE
            lines.append(f"  {check.rank:>5} {kind:10} {check.planned[kind] / 2**30:12.3f} "
                         f"{check.measured[kind] / 2**30:10.3f} {errors[kind]:7.2%}  {bound:.0%}"
                         f"{'' if errors[kind] <= bound else '  DISAGREES'}")
    verdict = "agree" if verification.agrees else "DISAGREE"
    lines.append(f"  planner and torch {verdict} (bytes held within {BYTES_TOLERANCE:.0%}, step peak within "
                 f"{PEAK_TOLERANCE:.0%}; the planner's reserve for the CUDA context and fragmentation is not "
                 "tracked and not compared)")
    return "\n".join(lines) + "\n"
