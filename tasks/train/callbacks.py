"""The callbacks every training run gets (progress, metric logging, the checkpoint cadence) and
`CallbackSpec`, how a callback travels to another process (a torchrun worker): its class's dotted
path and JSON keyword arguments. The `TrainCallback` interface and its hook points are in
`kiln.tasks.train.trainer`; the health monitor is `kiln.tasks.train.rollback`.
"""

from __future__ import annotations

import importlib
import json
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.tasks.constants import METRICS_LOG
from kiln.tasks.errors import ConfigError
from kiln.tasks.progress import Progress
from kiln.tasks.train.checkpoint import BEFORE_PHASE_DIR
from kiln.tasks.train.model import flops_per_token
from kiln.tasks.train.trainer import StepOutput, TrainCallback, Trainer, TrainResult

@dataclass(frozen=True)
class CallbackSpec:
    """A callback another process builds: `target` is its class's dotted path, `kwargs` JSON values."""

    target: str  # "package.module.ClassName"
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, callback: type[TrainCallback], **kwargs: Any) -> CallbackSpec:
        return cls(f"{callback.__module__}.{callback.__qualname__}", kwargs)

    @classmethod
    def from_json(cls, raw: Any) -> CallbackSpec:
        if not isinstance(raw, dict) or set(raw) - {"target", "kwargs"} or not isinstance(raw.get("target"), str):
            raise ConfigError(f"a callback spec is {{'target': 'module.Class', 'kwargs': {{...}}}}, got {raw!r}")
        return cls(raw["target"], raw.get("kwargs", {}))

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "kwargs": self.kwargs}

    def build(self) -> TrainCallback:
        module, _, name = self.target.rpartition(".")
        try:
            callback = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError):
            raise ConfigError(f"callback {self.target!r} not found: give a TrainCallback's dotted path") from None
        if not (isinstance(callback, type) and issubclass(callback, TrainCallback)):
            raise ConfigError(f"{self.target} is not a TrainCallback subclass")
        try:
            return callback(**self.kwargs)
        except TypeError as error:
            raise ConfigError(f"callback {self.target}: {error}") from None


class ProgressBar(TrainCallback):
    """Rank 0's progress line (`tasks.progress`): steps, rate, time left, the loss at log steps."""

    def on_start(self, trainer: Trainer) -> None:
        self.progress = Progress("train", trainer.run_cfg.steps, "steps", done=trainer.step) if trainer.is_main else None

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        if self.progress is not None:  # out.step: the first step after a rollback moves it back
            self.progress.update(out.step, f"loss {out.loss:.4f}" if trainer.is_log_step(out.step) else "")

    def on_end(self, trainer: Trainer, result: TrainResult) -> None:
        if self.progress is not None:
            self.progress.close()

    def on_error(self, trainer: Trainer, error: BaseException) -> None:
        if self.progress is not None:
            self.progress.close()


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


class MetricsLogger(TrainCallback):
    """Rank 0, every `log_every` steps and the last: loss, lr, grad norm, throughput since the last
    log, peak memory and (given `run.peak_tflops`) MFU, to `train_metrics.jsonl` and `on_metrics`;
    at the end, the validation loss to `on_metrics`."""

    def __init__(self, on_metrics: Callable[[int, dict[str, float]], None] | None = None) -> None:
        self.on_metrics = on_metrics

    def on_start(self, trainer: Trainer) -> None:
        self._t_log, self._tokens_at_log = time.perf_counter(), trainer.tokens_run
        if trainer.is_main:
            drop_rows_after(trainer.out_dir / METRICS_LOG, trainer.step)
        self._flops_per_token = flops_per_token(trainer.model_cfg, trainer.mixture.vocab_size, trainer.run_cfg.seq_len)

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        if not (trainer.is_main and trainer.is_log_step(out.step)):
            return
        now = time.perf_counter()
        # every update since the last log counts, rolled-back ones too: they took the time
        tokens_per_s = (trainer.tokens_run - self._tokens_at_log) / max(now - self._t_log, 1e-9)
        metrics = {"loss": out.loss, "lr": out.lr, "grad_norm": out.grad_norm, "tokens_per_s": tokens_per_s,
                   "peak_memory_mb": peak_memory_mb(trainer.device)}
        peak_tflops = trainer.run_cfg.peak_tflops
        if peak_tflops is not None:
            # per device: the whole job's FLOPs over all its devices' peak
            metrics["mfu"] = self._flops_per_token * tokens_per_s / (peak_tflops * 1e12 * trainer.layout.dims.world_size)
        phase = trainer.mixture.phase_at(out.step)
        if phase is not None:  # the data schedule, charted: the phase, its context and its mixture at this step
            metrics |= {"data/phase": float(trainer.mixture.phases.index(phase)), "data/seq_len": float(phase.seq_len)}
            metrics |= {f"mixture/{name}": 0.0 for name in trainer.mixture.domains}  # a domain the phase leaves out
            metrics |= {f"mixture/{name}": d.weight for name, d in phase.domains.items()}
        with (trainer.out_dir / METRICS_LOG).open("a") as log:
            log.write(json.dumps({"step": out.step, **metrics}) + "\n")
        if self.on_metrics is not None:
            self.on_metrics(out.step, metrics)
        self._t_log, self._tokens_at_log = now, trainer.tokens_run

    def on_end(self, trainer: Trainer, result: TrainResult) -> None:
        if trainer.is_main and result.model_dir is not None and self.on_metrics is not None:
            val = {f"val_loss/{d}": v for d, v in result.val_loss_by_domain.items()}
            self.on_metrics(result.steps, {"val_loss": result.val_loss, **val})


def drop_rows_after(log: Path, step: int) -> None:
    """Keep `log`'s rows up to `step`: a resumed run starts again after its checkpoint at `step`, and logs
    the steps an earlier attempt logged past it again (each step must be in the log once)."""
    if not log.is_file():
        return
    lines = log.read_text().splitlines()
    kept = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
    if len(kept) != len(lines):
        temporary = log.with_name(log.name + ".tmp")
        temporary.write_text("".join(f"{line}\n" for line in kept))
        temporary.replace(log)


class Checkpointer(TrainCallback):
    """A sharded checkpoint every `run.checkpoint_every` steps (every rank writes its shard)."""

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        if out.step % trainer.run_cfg.checkpoint_every == 0:
            trainer.save_checkpoint()


def extension_boundaries(trainer: Trainer) -> dict[int, str]:
    """{the last step before a phase whose rotary settings differ from the previous phase's: that phase}."""
    phases = trainer.mixture.phases
    return {p.first_step - 1: p.name for prev, p in zip(phases, phases[1:]) if p.rope != prev.rope}


class ExtensionSnapshot(TrainCallback):
    """The whole model, saved to `before_phase/<phase>/` at the last step before a context-extension phase
    (one that changes the rotary base or scaling): the pre-extension model the long-context evaluation
    sets beside the final one. Runs before the checkpoint of that step, so a run resumed from it has it; a
    run that starts at that step (a branch from another run's checkpoint: an extension as an adjustment)
    saves what it starts from."""

    def on_start(self, trainer: Trainer) -> None:
        phase = extension_boundaries(trainer).get(trainer.step)
        if phase is not None and not (trainer.out_dir / BEFORE_PHASE_DIR / phase).is_dir():
            trainer.save_full_model(trainer.out_dir / BEFORE_PHASE_DIR / phase, trainer.step)

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        phase = extension_boundaries(trainer).get(out.step)
        if phase is not None:
            trainer.save_full_model(trainer.out_dir / BEFORE_PHASE_DIR / phase, out.step)


class TrainerHandle(TrainCallback):
    """Keeps hold of the trainer, so a caller whose run raised can still read its steps and curve."""

    trainer: Trainer | None = None

    def on_start(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def steps_and_curve(self) -> tuple[int, list[tuple[int, float]]]:
        if self.trainer is None:
            return 0, []
        return self.trainer.step, list(self.trainer.curves["loss"])
