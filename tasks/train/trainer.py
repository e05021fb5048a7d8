"""One attempt's training state and its moves (`Trainer`), and the hooks the loop calls on it.

`kiln.tasks.train.loop.train_model` is the recipe: it builds a `Trainer`, then for each step draws a
`Batch`, trains it into a `StepOutput` and calls the hooks. This module is what that recipe and the
callbacks (`kiln.tasks.train.callbacks`, the health monitor in `kiln.tasks.train.rollback`) share:
the state, the step's data, the result, and the `TrainCallback` interface with its dispatcher.

The hook points, called in order on every rank (one process or a torchrun job), OLMo-core-trainer
style; a callback whose work is rank 0's (files, progress, `on_metrics`) checks `trainer.is_main`
itself, and one that joins a collective (saving a checkpoint, a rollback) must run on every rank:

- `on_start(trainer)`: the model is built and resumed; `trainer.step` is the first step's predecessor.
- `pre_step(trainer, batch)`: before each optimizer update; may change the `Batch` (testing faults do).
- `check_step(trainer, out) -> bool`: right after the update; False means the callback undid it
  (the health monitor rolled the run back to `trainer.step`) and the loop goes on from there.
- `post_step(trainer, out)`: after an update that was kept and recorded in the curves.
- `on_checkpoint(trainer, step)`: a checkpoint of `step` was written (every rank has saved).
- `on_end(trainer, result)`: training stopped (finished or `stop_after`); `result` is final.
- `on_error(trainer, error)`: an exception is leaving the loop (it is re-raised afterwards).

Each hook dispatches only to callbacks that override it, so the per-step cost of the hooks is a
few method calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, RopeScaling, TrainRunConfig, revalidated
from kiln.tasks.train.data_loader import Mixture
from kiln.tasks.train.dcp import latest_intact_dcp, load_dcp, read_train_state, save_dcp
from kiln.tasks.train.distributed import Layout, clip_grad_norm, make_optimizer
from kiln.tasks.train.health import EVENTS_FILE, SkipWindow, data_index, lr_factor, read_events, windows_from_events
from kiln.tasks.train.model import (
    WeightSource,
    count_parameters,
    read_model_config,
    save_model,
    saved_weights,
    seeded_weights,
)
from kiln.tasks.train.schedule import lr_at

FINAL_LOSS_WINDOW = 10
CURVES = ("loss", "lr", "grad_norm", "batch_checksum")


HOOKS = ("on_start", "pre_step", "check_step", "post_step", "on_checkpoint", "on_end", "on_error")



@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    num_params: int
    final_train_loss: float  # mean of the last min(10, steps) steps
    val_loss: float | None  # unweighted mean over domains of val_loss_by_domain; None if stopped early
    val_loss_by_domain: dict[str, float]
    loss_curve: list[tuple[int, float]]  # the global batch's mean cross-entropy per step
    lr_curve: list[tuple[int, float]]
    grad_norm_curve: list[tuple[int, float]]  # before clipping
    batch_checksum_curve: list[tuple[int, int]]  # `batch_checksum` of each step's global batch
    mixture_history: list[tuple[int, dict]]  # (steps completed before it applied, mixture summary)
    wall_s: float  # this attempt only (a resumed run does not count the crashed one)
    tokens_per_s: float  # tokens trained in this attempt / its training time
    model_dir: Path | None  # None when the run stopped before its last step
    resumed_from_step: int | None
    num_rollbacks: int  # over every attempt in this out_dir
    health_events: list[dict[str, Any]]  # every line of health_events.jsonl
    world_size: int
    parallel: dict[str, Any]
    rank0_local_numel: int  # parameter elements rank 0 holds: shows how far the model is sharded
    started_unix: float  # when this attempt began (before building the model and loading checkpoints)
    first_step_unix: float | None  # when this attempt's first optimizer step finished: "training resumed"
    # tokens trained per phase ("all" without a data schedule) per source, over the kept steps
    tokens_by_phase: dict[str, dict[str, int]] = field(default_factory=dict)
    phases: list[dict] = field(default_factory=list)  # the data schedule's phases (`Phase.summary`)
    steps_trained: int = 0  # updates this attempt ran (rolled-back ones included): a branch's suffix


def mixture_summary(mixture: Mixture) -> dict:
    """Each domain's weight and train shard file names, and the data schedule's phases when there is
    one: what `mixture_history` compares."""
    summary = {
        name: {"weight": d.weight, "train": [p.name for p in d.train]} for name, d in sorted(mixture.domains.items())
    }
    if mixture.phases:
        summary["phases"] = [p.summary() for p in mixture.phases]
    return summary


NO_SCHEDULE = "all"  # the one phase name of a run without a data schedule, in `tokens_by_phase`


def with_rope(model_cfg: ModelConfig, rope: dict | None) -> ModelConfig:
    """`model_cfg` with a data phase's rotary settings (`Phase.rope`: rope_theta, rope_scaling), if any."""
    if not rope:
        return model_cfg
    update = {k: RopeScaling(**v) if k == "rope_scaling" else v for k, v in rope.items()}
    return revalidated(model_cfg.model_copy(update=update))


def _weights_shape(model_identity: dict) -> dict:
    """A model identity without what its weights do not depend on: `max_seq_len`, unless positions are learned
    (a branch may go on from a prefix run's checkpoint to extend its context)."""
    if model_identity.get("position", "rope") == "learned":
        return model_identity
    return {k: v for k, v in model_identity.items() if k != "max_seq_len"}


def _identity(model_cfg: ModelConfig, optim_cfg: OptimConfig, run_cfg: TrainRunConfig, vocab_size: int) -> dict:
    identity = {
        "model": model_cfg.identity(),
        "optim": optim_cfg.identity(),
        "run": run_cfg.identity(),
        "vocab_size": vocab_size,
    }
    return json.loads(json.dumps(identity))  # as it reads back from a checkpoint


def initial_weights(model_cfg: ModelConfig, vocab_size: int, seed: int, init_model_dir: Path | None) -> WeightSource:
    """The step-0 weights: seeded (each parameter from its own seeded generator, whatever the
    layout) or a saved model's, read lazily so each rank takes only its shards."""
    if init_model_dir is None:
        return seeded_weights(model_cfg, seed)
    saved_cfg, saved_vocab = read_model_config(init_model_dir)
    if saved_cfg != model_cfg or saved_vocab != vocab_size:
        raise ValueError(
            f"init model in {init_model_dir} has config {saved_cfg.model_dump()} and vocab_size "
            f"{saved_vocab}, but this run asks for {model_cfg.model_dump()} and vocab_size "
            f"{vocab_size}: use the same model section and tokenizer as the run that produced it"
        )
    return saved_weights(init_model_dir)


@torch.inference_mode()
def evaluate(
    model: nn.Module, batches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]], device: torch.device
) -> dict[str, float]:
    """Mean next-token cross-entropy per domain over fixed validation batches."""
    was_training = model.training
    model.eval()
    out = {}
    for name, pairs in batches.items():
        total = 0.0
        for x, y in pairs:
            logits = model(x.to(device))
            total += F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten()).item()
        out[name] = total / len(pairs)
    model.train(was_training)
    return out


def train_step(layout: Layout, model: nn.Module, schedule: Any, optimizer: torch.optim.Optimizer,
               x: torch.Tensor, y: torch.Tensor, grad_accum: int, max_norm: float, z_loss: float,
               mtp_weight: float = 0.0) -> tuple[float, float]:
    """One optimizer update over this rank's rows of x/y; returns (mean loss, grad norm before clipping)."""
    loss = layout.forward_backward(model, schedule, x, y, grad_accum, z_loss, mtp_weight)
    grad_norm = clip_grad_norm(list(model.parameters()), max_norm, layout.pp_mesh)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


@dataclass
class Batch:
    """One optimizer step's data as the loop is about to train on it; a `pre_step` hook may change it."""

    step: int  # the 1-based step it trains
    index: int  # its `batch_for_step` index (a rollback's skip window shifts it)
    x: torch.Tensor  # this rank's rows
    y: torch.Tensor
    checksum: int  # `batch_checksum` of the global batch as drawn
    lr: float  # the scheduled learning rate (times a rollback window's factor): what the curves record
    phase: str  # the data schedule's phase (NO_SCHEDULE without one)
    rows_by_domain: dict[str, int]  # rows of the global batch each domain gave
    seq_len: int
    lr_scale: float = 1.0  # the optimizer runs at lr * lr_scale (testing faults change it)


@dataclass(frozen=True)
class StepOutput:
    """What one optimizer update produced (the same on every rank)."""

    step: int
    loss: float  # the global batch's mean cross-entropy
    lr: float
    grad_norm: float  # before clipping
    checksum: int
    phase: str
    tokens_by_domain: dict[str, int]  # tokens of the global batch per domain


@dataclass
class Trainer:
    """One attempt's training state and its moves: what the loop advances and callbacks read.

    `step` counts the updates kept so far; a rollback (`restore`) sets it back. `events` and
    `windows` are the health record of every attempt in out_dir: their skip windows decide
    which batch and learning-rate factor each step gets.
    """

    model_cfg: ModelConfig
    optim_cfg: OptimConfig
    run_cfg: TrainRunConfig
    mixture: Mixture
    out_dir: Path
    initial: WeightSource  # the step-0 weights (a rollback to step 0 refills them)
    layout: Layout
    model: nn.Module
    schedule: Any  # the pipeline schedule under pipeline parallelism, else None
    optimizer: torch.optim.Optimizer
    hooks: Hooks
    identity: dict[str, Any]  # what a checkpoint must have been written with to be resumed from
    events: list[dict[str, Any]]
    windows: list[SkipWindow]
    fresh_state: tuple[dict[str, Any], torch.Tensor]  # optimizer and RNG state at step 0, for a rollback there
    step: int = 0
    curves: dict[str, list] = field(default_factory=lambda: {name: [] for name in CURVES})
    mixture_history: list = field(default_factory=list)  # [steps completed before it applied, summary]
    resumed_from: int | None = None
    steps_run: int = 0  # updates this attempt ran, rolled-back ones included
    first_step_unix: float | None = None  # when this attempt's first update finished
    tokens_run: int = 0  # tokens this attempt trained on, rolled-back steps included
    # the loader's position, kept in every checkpoint: tokens drawn per phase per source over the kept steps
    source_tokens: dict[str, dict[str, int]] = field(default_factory=dict)
    phase_mixtures: dict[str, Mixture] = field(default_factory=dict)
    rope: dict | None = None  # the data phase's rotary settings the model's tables hold now (None: the model's)

    @classmethod
    def start(cls, model_cfg: ModelConfig, optim_cfg: OptimConfig, run_cfg: TrainRunConfig, mixture: Mixture,
              out_dir: Path, dims: ParallelDims, init_model_dir: Path | None, hooks: Hooks,
              branch_from: Path | None = None) -> Trainer:
        """Join the layout, build and split the model, and resume from the newest intact checkpoint; with
        none in out_dir, from `branch_from` (another run's checkpoint, of the same model: the run goes on from
        its step, weights, optimizer and curves, under this run's schedule)."""
        layout = Layout.create(dims, torch.device(run_cfg.device))
        if layout.is_main:
            out_dir.mkdir(parents=True, exist_ok=True)
        weights = initial_weights(model_cfg, mixture.vocab_size, run_cfg.seed, init_model_dir)
        model, schedule = layout.build(model_cfg, mixture.vocab_size, run_cfg, optim_cfg.z_loss, weights)
        optimizer = make_optimizer(model, optim_cfg, layout.device)
        # the record of earlier attempts too: their skip windows must apply to this one
        events = read_events(out_dir / EVENTS_FILE)
        trainer = cls(model_cfg, optim_cfg, run_cfg, mixture, out_dir, weights, layout, model, schedule,
                      optimizer, hooks, _identity(model_cfg, optim_cfg, run_cfg, mixture.vocab_size), events,
                      windows_from_events(events), (optimizer.state_dict(), torch.get_rng_state()),
                      mixture_history=[[0, mixture_summary(mixture)]])
        latest = latest_intact_dcp(trainer.ckpt_root)
        if latest is None and branch_from is not None:
            prefix = read_train_state(branch_from)["identity"]
            if (_weights_shape(prefix["model"]), prefix["vocab_size"]) != (
                    _weights_shape(trainer.identity["model"]), trainer.identity["vocab_size"]):
                raise ValueError(f"{branch_from} holds another model (or vocabulary) than this run's: a branch goes on "
                                 "from the prefix run's weights, so keep its model section and tokenizer")
            latest = branch_from
        if latest is not None:
            if latest != branch_from and read_train_state(latest)["identity"] != trainer.identity:
                raise ValueError(
                    f"checkpoints in {trainer.ckpt_root} were written by a run with a different config (model, "
                    "optim, train run or vocabulary); use a fresh out_dir or delete that folder"
                )
            state = trainer.restore(latest)
            trainer.resumed_from = trainer.step
            trainer.mixture_history = state["mixture_history"]
            if trainer.mixture_history[-1][1] != mixture_summary(mixture):
                trainer.mixture_history.append([trainer.step, mixture_summary(mixture)])
        model.train()
        return trainer

    @property
    def is_main(self) -> bool:
        return self.layout.is_main

    @property
    def device(self) -> torch.device:
        return self.layout.device

    @property
    def ckpt_root(self) -> Path:
        return self.out_dir / "checkpoints"

    @property
    def rows_per_step(self) -> int:
        return self.run_cfg.batch_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one step at `run.seq_len` (a data schedule's phases may train at other lengths)."""
        return self.rows_per_step * self.run_cfg.seq_len

    @property
    def planned_tokens(self) -> int:
        """Tokens of all `run.steps` steps, each phase of a data schedule at its own sequence length."""
        steps, done, tokens = self.run_cfg.steps, 0, 0
        for phase in self.mixture.phases:
            last = steps if phase is self.mixture.phases[-1] else min(phase.last_step, steps)
            tokens += max(0, last - done) * self.rows_per_step * phase.seq_len
            done = max(done, last)
        return tokens + (steps - done) * self.tokens_per_step

    def model_cfg_at(self, step: int) -> ModelConfig:
        """The model as 1-based `step` trains it: `model_cfg` with the rotary settings of its data phase."""
        phase = self.mixture.phase_at(step)
        return with_rope(self.model_cfg, phase.rope if phase is not None else None)

    def use_rope(self, step: int) -> None:
        """Give the model the rotary tables of `step`'s phase when they differ from those it holds: applied
        when a long-context phase starts, on resume inside or after it, and after a rollback."""
        phase = self.mixture.phase_at(step)
        rope = phase.rope if phase is not None else None
        if rope != self.rope:
            self.layout.set_rope(self.model, self.model_cfg_at(step))
            self.rope = rope

    def is_log_step(self, step: int) -> bool:
        return step % self.run_cfg.log_every == 0 or step == self.run_cfg.steps

    def next_batch(self) -> Batch:
        """The batch and learning rate of step `self.step + 1`, after any rollback's skip windows."""
        step = self.step + 1
        self.use_rope(step)
        lr = lr_at(self.step, self.optim_cfg, self.run_cfg.steps) * lr_factor(step, self.windows)
        index = data_index(step, self.windows)
        name, data, seq_len, slot = self.data_for(step)
        x, y, checksum, rows = self.layout.batch(data, self.run_cfg.seed, index, self.rows_per_step, seq_len, slot)
        return Batch(step, index, x, y, checksum, lr, name, rows, seq_len)

    def data_for(self, step: int) -> tuple[str, Mixture, int, tuple[int, int]]:
        """What 1-based `step` draws from: its phase's name, mixture, sequence length and slot (its
        place in the phase, see `draw_batch`)."""
        phase = self.mixture.phase_at(step)
        if phase is None:
            return NO_SCHEDULE, self.mixture, self.run_cfg.seq_len, (0, 1)
        if phase.name not in self.phase_mixtures:
            self.phase_mixtures[phase.name] = self.mixture.for_phase(phase)
        slot = (min(step - phase.first_step, phase.num_steps - 1), phase.num_steps)
        return phase.name, self.phase_mixtures[phase.name], phase.seq_len, slot

    def train(self, batch: Batch) -> StepOutput:
        for group in self.optimizer.param_groups:
            group["lr"] = batch.lr * batch.lr_scale
        grad_clip = self.optim_cfg.grad_clip
        loss, grad_norm = train_step(self.layout, self.model, self.schedule, self.optimizer, batch.x, batch.y,
                                     self.run_cfg.grad_accum, grad_clip if grad_clip > 0 else float("inf"),
                                     self.optim_cfg.z_loss, self.optim_cfg.mtp_weight)
        self.steps_run += 1
        self.tokens_run += self.rows_per_step * batch.seq_len
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
        tokens = {name: rows * batch.seq_len for name, rows in batch.rows_by_domain.items()}
        return StepOutput(batch.step, loss, batch.lr, grad_norm, batch.checksum, batch.phase, tokens)

    def record(self, out: StepOutput) -> None:
        """Keep the update: it joins the curves, its tokens the loader's position, and `step` moves to it."""
        for name, value in zip(CURVES, (out.loss, out.lr, out.grad_norm, out.checksum)):
            self.curves[name].append((out.step, value))
        by_source = self.source_tokens.setdefault(out.phase, {})
        for name, tokens in out.tokens_by_domain.items():
            by_source[name] = by_source.get(name, 0) + tokens
        self.step = out.step

    def save_checkpoint(self) -> None:
        train_state = {"identity": self.identity, "curves": self.curves, "mixture_history": self.mixture_history,
                       "source_tokens": self.source_tokens}
        phase = self.mixture.phase_at(self.step)
        if phase is not None and phase.rope:
            # the weights go with the phase's rotary positions: what evaluating or annealing this checkpoint needs
            train_state["model"] = self.model_cfg_at(self.step).model_dump(mode="json")
        run_cfg = self.run_cfg
        save_dcp(self.ckpt_root, self.step, self.model, self.optimizer, train_state, run_cfg.keep_checkpoints,
                 run_cfg.keep_every)
        self.hooks.on_checkpoint(self, self.step)

    def restore(self, checkpoint: Path | None) -> dict[str, Any]:
        """Weights, optimizer, RNG, curves and `step` as `checkpoint` holds them (None: as at step 0);
        every rank calls it together. Returns the checkpoint's train state ({} for step 0)."""
        if checkpoint is not None:
            state = load_dcp(checkpoint, self.model, self.optimizer)
            self.curves = {name: [tuple(p) for p in state["curves"][name]] for name in CURVES}
            self.step = state["step"]
            self.source_tokens = state.get("source_tokens", {})
        else:
            self.layout.reinitialize(self.model, self.model_cfg, self.initial)
            self.rope = None  # the refill recomputed the model's own tables
            self.optimizer.load_state_dict(self.fresh_state[0])
            torch.set_rng_state(self.fresh_state[1])
            state = {}
            self.curves = {name: [] for name in CURVES}
            self.step = 0
            self.source_tokens = {}
        self.optimizer.zero_grad(set_to_none=True)
        return state

    def evaluate_and_save(self, val_batches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, float]:
        """The gathered model's validation loss per domain (on every rank); rank 0 saves it to out_dir/model."""
        val_by_domain: dict[str, float] = {}
        full = self.save_full_model(self.out_dir / "model", self.step)
        if full is not None:
            val_by_domain = evaluate(full, val_batches, self.device)
        return self.layout.broadcast(val_by_domain)

    def save_full_model(self, model_dir: Path, step: int) -> nn.Module | None:
        """Gather the model (collective) and save it on rank 0 with its config as `step` trained it (the
        data phase's rotary settings); rank 0 gets the gathered model, the others None."""
        cfg = self.model_cfg_at(step)
        full = self.layout.full_model(self.model, cfg, self.mixture.vocab_size)
        if full is not None:
            save_model(full, cfg, self.mixture.vocab_size, model_dir)
        return full

    def result(self, val_by_domain: dict[str, float], train_s: float, wall_s: float,
               started_unix: float) -> TrainResult:
        """The run as it stands (every rank calls it: it broadcasts rank 0's parameter count)."""
        run_cfg, finished = self.run_cfg, self.step == self.run_cfg.steps
        tail = [loss for _, loss in self.curves["loss"][-FINAL_LOSS_WINDOW:]]
        return TrainResult(
            steps=run_cfg.steps,
            tokens_seen=self.planned_tokens,
            num_params=count_parameters(self.model_cfg, self.mixture.vocab_size),
            final_train_loss=sum(tail) / len(tail),
            val_loss=sum(val_by_domain.values()) / len(val_by_domain) if val_by_domain else None,
            val_loss_by_domain=val_by_domain,
            loss_curve=self.curves["loss"],
            lr_curve=self.curves["lr"],
            grad_norm_curve=self.curves["grad_norm"],
            batch_checksum_curve=self.curves["batch_checksum"],
            mixture_history=[tuple(entry) for entry in self.mixture_history],
            wall_s=wall_s,
            tokens_per_s=self.tokens_run / train_s if train_s > 0 else 0.0,
            model_dir=self.out_dir / "model" if finished else None,
            resumed_from_step=self.resumed_from,
            num_rollbacks=len(self.windows),
            health_events=self.events,
            world_size=self.layout.dims.world_size,
            parallel=self.layout.dims.model_dump(mode="json"),
            rank0_local_numel=self.layout.broadcast(self.layout.local_numel(self.model)),
            started_unix=started_unix,
            first_step_unix=self.first_step_unix,
            tokens_by_phase=self.source_tokens,
            steps_trained=self.steps_run,
            phases=[p.summary() for p in self.mixture.phases],
        )


def write_metrics(result: TrainResult, out_dir: Path) -> None:
    """`metrics.json` in the run's folder: the result without machine paths, so the store stays relocatable."""
    metrics = asdict(result)
    del metrics["model_dir"]
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def write_result(result: TrainResult, path: Path) -> None:
    """The whole result as JSON, for the process that launched this one (see `read_result`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(result), "model_dir": str(result.model_dir) if result.model_dir else None},
                               indent=2) + "\n")


def read_result(path: Path) -> TrainResult:
    """A `TrainResult` written by `write_result` (curves as tuples again)."""
    raw = json.loads(path.read_text())
    for name in ("loss_curve", "lr_curve", "grad_norm_curve", "batch_checksum_curve", "mixture_history"):
        raw[name] = [tuple(point) for point in raw[name]]
    raw["model_dir"] = Path(raw["model_dir"]) if raw["model_dir"] else None
    return TrainResult(**raw)


class TrainCallback:
    """Base class of the loop's hooks; override the ones you need (see the module docstring)."""

    def on_start(self, trainer: Trainer) -> None:
        pass

    def pre_step(self, trainer: Trainer, batch: Batch) -> None:
        pass

    def check_step(self, trainer: Trainer, out: StepOutput) -> bool:
        return True

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        pass

    def on_checkpoint(self, trainer: Trainer, step: int) -> None:
        pass

    def on_end(self, trainer: Trainer, result: TrainResult) -> None:
        pass

    def on_error(self, trainer: Trainer, error: BaseException) -> None:
        pass


class Hooks:
    """The loop's view of its callbacks: each hook calls, in order, the callbacks that override it."""

    def __init__(self, callbacks: Iterable[TrainCallback]) -> None:
        self.callbacks = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, TrainCallback):
                raise TypeError(f"{cb!r} is not a TrainCallback: subclass kiln.tasks.train.trainer.TrainCallback")
        self._calls = {name: [getattr(cb, name) for cb in self.callbacks
                              if getattr(type(cb), name) is not getattr(TrainCallback, name)] for name in HOOKS}

    def on_start(self, trainer: Trainer) -> None:
        for call in self._calls["on_start"]:
            call(trainer)

    def pre_step(self, trainer: Trainer, batch: Batch) -> None:
        for call in self._calls["pre_step"]:
            call(trainer, batch)

    def check_step(self, trainer: Trainer, out: StepOutput) -> bool:
        """Whether the step stands; the first callback that undoes it ends the checks."""
        return all(call(trainer, out) for call in self._calls["check_step"])

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        for call in self._calls["post_step"]:
            call(trainer, out)

    def on_checkpoint(self, trainer: Trainer, step: int) -> None:
        for call in self._calls["on_checkpoint"]:
            call(trainer, step)

    def on_end(self, trainer: Trainer, result: TrainResult) -> None:
        for call in self._calls["on_end"]:
            call(trainer, result)

    def on_error(self, trainer: Trainer, error: BaseException) -> None:
        for call in self._calls["on_error"]:
            call(trainer, error)
