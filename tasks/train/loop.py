"""The one training loop: proxy sweeps, validation, production train and anneal, on one process or many.

`train_model` builds (or loads) the model, splits it over the parallel layout (`dims`, see
`tasks.train.distributed`; one process by default, any pp x dp x tp under torchrun), trains it
with AdamW on batches from a `Mixture`, resumes from the newest intact DCP checkpoint left by a
crashed attempt — whatever layout wrote it — and finishes with the gathered model, per-domain
validation loss, `metrics.json` and `loss_curve.png`. Steps in curves, metrics and checkpoint
names count completed optimizer updates (1 .. steps). Every rank returns the same `TrainResult`.

The loop is a recipe over a `Trainer` (the state: model, optimizer, curves, skip windows) and
callbacks (`tasks.train.callbacks`) called at fixed points: the health monitor that rolls a bad
step back (`tasks.train.rollback`), the progress bar, metric logging to `train_metrics.jsonl` and
`on_metrics` (throughput, MFU, memory), the checkpoint cadence, and whatever the caller adds
(tests add `tasks.train.testing_faults.FaultInjection`).

Determinism: on CPU the loop runs under `torch.use_deterministic_algorithms(True)`, so the same
config and data give a bit-identical loss curve (resume included) for a fixed thread count and
layout; another layout or thread count changes float summation order, hence the last bits.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.tasks.errors import InputError
from kiln.tasks.train.callbacks import Checkpointer, Hooks, MetricsLogger, ProgressBar, TrainCallback
from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig, revalidated
from kiln.tasks.train.data_loader import Mixture, validation_batches
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
from kiln.tasks.train.plots import LOSS_PLOT, plot_loss_curve
from kiln.tasks.train.rollback import HealthMonitor
from kiln.tasks.train.schedule import lr_at

FINAL_LOSS_WINDOW = 10
CURVES = ("loss", "lr", "grad_norm", "batch_checksum")


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


def mixture_summary(mixture: Mixture) -> dict:
    """Each domain's weight and train shard file names: what `mixture_history` compares."""
    return {
        name: {"weight": d.weight, "train": [p.name for p in d.train]} for name, d in sorted(mixture.domains.items())
    }


@contextmanager
def _torch_settings(run_cfg: TrainRunConfig, device: torch.device) -> Iterator[None]:
    """Deterministic kernels on CPU, the requested thread count and the CPU generator seeded from the
    run's seed, all restored on exit. Checkpoints save that generator's state: seeded here, one config
    writes the same bytes in this process, a torchrun worker or a Slurm job (a resume then loads it)."""
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    if run_cfg.num_threads is not None:
        torch.set_num_threads(run_cfg.num_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.random.default_generator.manual_seed(run_cfg.seed)
            yield
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)


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


def train_model(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    run_cfg: TrainRunConfig,
    mixture: Mixture,
    out_dir: Path,
    *,
    dims: ParallelDims | None = None,
    init_model_dir: Path | None = None,
    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    callbacks: Sequence[TrainCallback] = (),
    stop_after: int | None = None,
) -> TrainResult:
    """Train for `run_cfg.steps` steps into out_dir (resuming a crashed attempt found there).

    `dims` is the parallel layout (default: one process); with a world size above 1 every rank
    of a torchrun job calls this together and out_dir must be on a filesystem they share.
    `on_metrics(step, metrics)` gets train metrics every `log_every` steps and validation loss at
    the end; `on_event(event)` gets each health event (a rollback, or giving up) as it is written
    to `health_events.jsonl`; both are called on rank 0 only. `callbacks` run after the health
    monitor and the progress bar, before metric logging and checkpointing (see
    `tasks.train.callbacks`). `stop_after`: return once that many steps are done, as a stopped
    job would (no final model).
    """
    model_cfg, optim_cfg, run_cfg = revalidated(model_cfg), revalidated(optim_cfg), revalidated(run_cfg)
    dims = revalidated(dims) if dims is not None else ParallelDims()
    run_cfg.check_fits(model_cfg)
    dims.check_holds_batch(run_cfg)
    t_start, started_unix = time.perf_counter(), time.time()
    # built first so that a mixture without usable validation data fails before training
    val_batches = validation_batches(mixture, run_cfg.seq_len, run_cfg.eval_batches, run_cfg.batch_size)
    if not val_batches:
        raise InputError(
            f"no domain has a validation shard of at least seq_len + 1 = {run_cfg.seq_len + 1} "
            "tokens, so there is no validation loss: give the tokenize stage a larger val split"
        )
    hooks = Hooks([HealthMonitor(on_event), ProgressBar(), *callbacks, MetricsLogger(on_metrics), Checkpointer()])

    with _torch_settings(run_cfg, torch.device(run_cfg.device)):
        trainer = Trainer.start(model_cfg, optim_cfg, run_cfg, mixture, out_dir, dims, init_model_dir, hooks)
        try:
            hooks.on_start(trainer)
            t_train = time.perf_counter()
            while trainer.step < run_cfg.steps:
                batch = trainer.next_batch()
                hooks.pre_step(trainer, batch)
                out = trainer.train(batch)
                if not hooks.check_step(trainer, out):
                    continue  # rolled back: trainer.step is the restored checkpoint's
                trainer.record(out)
                hooks.post_step(trainer, out)
                if stop_after is not None and trainer.step >= stop_after:
                    break
            train_s = time.perf_counter() - t_train
            finished = trainer.step == run_cfg.steps
            val_by_domain = trainer.evaluate_and_save(val_batches) if finished else {}
        except BaseException as error:
            hooks.on_error(trainer, error)
            raise

    result = trainer.result(val_by_domain, train_s, wall_s=time.perf_counter() - t_start, started_unix=started_unix)
    hooks.on_end(trainer, result)
    if trainer.is_main and finished:
        plot_loss_curve(result.loss_curve, [(run_cfg.steps, result.val_loss)], trainer.events, out_dir / LOSS_PLOT)
        write_metrics(result, out_dir)
    return result


@dataclass
class Batch:
    """One optimizer step's data as the loop is about to train on it; a `pre_step` hook may change it."""

    step: int  # the 1-based step it trains
    index: int  # its `batch_for_step` index (a rollback's skip window shifts it)
    x: torch.Tensor  # this rank's rows
    y: torch.Tensor
    checksum: int  # `batch_checksum` of the global batch as drawn
    lr: float  # the scheduled learning rate (times a rollback window's factor): what the curves record
    lr_scale: float = 1.0  # the optimizer runs at lr * lr_scale (testing faults change it)


@dataclass(frozen=True)
class StepOutput:
    """What one optimizer update produced (the same on every rank)."""

    step: int
    loss: float  # the global batch's mean cross-entropy
    lr: float
    grad_norm: float  # before clipping
    checksum: int


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

    @classmethod
    def start(cls, model_cfg: ModelConfig, optim_cfg: OptimConfig, run_cfg: TrainRunConfig, mixture: Mixture,
              out_dir: Path, dims: ParallelDims, init_model_dir: Path | None, hooks: Hooks) -> Trainer:
        """Join the layout, build and split the model, and resume from the newest intact checkpoint."""
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
        if latest is not None:
            if read_train_state(latest)["identity"] != trainer.identity:
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
        return self.rows_per_step * self.run_cfg.seq_len

    def is_log_step(self, step: int) -> bool:
        return step % self.run_cfg.log_every == 0 or step == self.run_cfg.steps

    def next_batch(self) -> Batch:
        """The batch and learning rate of step `self.step + 1`, after any rollback's skip windows."""
        step = self.step + 1
        lr = lr_at(self.step, self.optim_cfg, self.run_cfg.steps) * lr_factor(step, self.windows)
        index = data_index(step, self.windows)
        x, y, checksum = self.layout.batch(self.mixture, self.run_cfg.seed, index, self.rows_per_step,
                                           self.run_cfg.seq_len)
        return Batch(step, index, x, y, checksum, lr)

    def train(self, batch: Batch) -> StepOutput:
        for group in self.optimizer.param_groups:
            group["lr"] = batch.lr * batch.lr_scale
        grad_clip = self.optim_cfg.grad_clip
        loss, grad_norm = train_step(self.layout, self.model, self.schedule, self.optimizer, batch.x, batch.y,
                                     self.run_cfg.grad_accum, grad_clip if grad_clip > 0 else float("inf"),
                                     self.optim_cfg.z_loss, self.optim_cfg.mtp_weight)
        self.steps_run += 1
        if self.first_step_unix is None:
            self.first_step_unix = time.time()
        return StepOutput(batch.step, loss, batch.lr, grad_norm, batch.checksum)

    def record(self, out: StepOutput) -> None:
        """Keep the update: it joins the curves and `step` moves to it."""
        for name, value in zip(CURVES, (out.loss, out.lr, out.grad_norm, out.checksum)):
            self.curves[name].append((out.step, value))
        self.step = out.step

    def save_checkpoint(self) -> None:
        train_state = {"identity": self.identity, "curves": self.curves, "mixture_history": self.mixture_history}
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
        else:
            self.layout.reinitialize(self.model, self.model_cfg, self.initial)
            self.optimizer.load_state_dict(self.fresh_state[0])
            torch.set_rng_state(self.fresh_state[1])
            state = {}
            self.curves = {name: [] for name in CURVES}
            self.step = 0
        self.optimizer.zero_grad(set_to_none=True)
        return state

    def evaluate_and_save(self, val_batches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, float]:
        """The gathered model's validation loss per domain (on every rank); rank 0 saves it to out_dir/model."""
        val_by_domain: dict[str, float] = {}
        full = self.layout.full_model(self.model, self.model_cfg, self.mixture.vocab_size)
        if full is not None:
            val_by_domain = evaluate(full, val_batches, self.device)
            save_model(full, self.model_cfg, self.mixture.vocab_size, self.out_dir / "model")
        return self.layout.broadcast(val_by_domain)

    def result(self, val_by_domain: dict[str, float], train_s: float, wall_s: float,
               started_unix: float) -> TrainResult:
        """The run as it stands (every rank calls it: it broadcasts rank 0's parameter count)."""
        run_cfg, finished = self.run_cfg, self.step == self.run_cfg.steps
        tail = [loss for _, loss in self.curves["loss"][-FINAL_LOSS_WINDOW:]]
        return TrainResult(
            steps=run_cfg.steps,
            tokens_seen=run_cfg.steps * self.tokens_per_step,
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
            tokens_per_s=self.steps_run * self.tokens_per_step / train_s if train_s > 0 else 0.0,
            model_dir=self.out_dir / "model" if finished else None,
            resumed_from_step=self.resumed_from,
            num_rollbacks=len(self.windows),
            health_events=self.events,
            world_size=self.layout.dims.world_size,
            parallel=self.layout.dims.model_dump(mode="json"),
            rank0_local_numel=self.layout.broadcast(self.layout.local_numel(self.model)),
            started_unix=started_unix,
            first_step_unix=self.first_step_unix,
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
