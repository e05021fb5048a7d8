"""Hooks of the training loop: the `TrainCallback` interface and the callbacks every run gets.

`train_model` calls its callbacks at fixed points, in order, on every rank (one process or a
torchrun job); a callback whose work is rank 0's (files, progress, `on_metrics`) checks
`trainer.is_main` itself, and one that joins a collective (saving a checkpoint, a rollback) must
run on every rank. The points, OLMo-core-trainer style:

- `on_start(trainer)`: the model is built and resumed; `trainer.step` is the first step's predecessor.
- `pre_step(trainer, batch)`: before each optimizer update; may change the `Batch` (testing faults do).
- `check_step(trainer, out) -> bool`: right after the update; False means the callback undid it
  (the health monitor rolled the run back to `trainer.step`) and the loop goes on from there.
- `post_step(trainer, out)`: after an update that was kept and recorded in the curves.
- `on_checkpoint(trainer, step)`: a checkpoint of `step` was written (every rank has saved).
- `on_end(trainer, result)`: training stopped (finished or `stop_after`); `result` is final.
- `on_error(trainer, error)`: an exception is leaving the loop (it is re-raised afterwards).

Each hook dispatches only to callbacks that override it, so the per-step cost of the hooks is a
few method calls. A callback for another process (a torchrun worker) travels as a `CallbackSpec`:
its class's dotted path and JSON keyword arguments.
"""

from __future__ import annotations

import importlib
import json
import resource
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from kiln.tasks.errors import ConfigError
from kiln.tasks.progress import Progress
from kiln.tasks.train.model import flops_per_token

if TYPE_CHECKING:
    from kiln.tasks.train.loop import Batch, StepOutput, Trainer, TrainResult

METRICS_LOG = "train_metrics.jsonl"  # every on_metrics call, for runs whose caller is another process
HOOKS = ("on_start", "pre_step", "check_step", "post_step", "on_checkpoint", "on_end", "on_error")


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
                raise TypeError(f"{cb!r} is not a TrainCallback: subclass tasks.train.callbacks.TrainCallback")
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
        self._t_log, self._steps_at_log = time.perf_counter(), trainer.steps_run
        run_cfg = trainer.run_cfg
        tokens = flops_per_token(trainer.model_cfg, trainer.mixture.vocab_size, run_cfg.seq_len)
        self._flops_per_step = tokens * trainer.tokens_per_step

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        if not (trainer.is_main and trainer.is_log_step(out.step)):
            return
        now = time.perf_counter()
        # every update since the last log counts, rolled-back ones too: they took the time
        tokens = (trainer.steps_run - self._steps_at_log) * trainer.tokens_per_step
        tokens_per_s = tokens / max(now - self._t_log, 1e-9)
        metrics = {"loss": out.loss, "lr": out.lr, "grad_norm": out.grad_norm, "tokens_per_s": tokens_per_s,
                   "peak_memory_mb": peak_memory_mb(trainer.device)}
        peak_tflops = trainer.run_cfg.peak_tflops
        if peak_tflops is not None:
            # per device: the whole job's FLOPs over all its devices' peak
            steps_per_s = tokens_per_s / trainer.tokens_per_step
            metrics["mfu"] = self._flops_per_step * steps_per_s / (peak_tflops * 1e12 * trainer.layout.dims.world_size)
        with (trainer.out_dir / METRICS_LOG).open("a") as log:
            log.write(json.dumps({"step": out.step, **metrics}) + "\n")
        if self.on_metrics is not None:
            self.on_metrics(out.step, metrics)
        self._t_log, self._steps_at_log = now, trainer.steps_run

    def on_end(self, trainer: Trainer, result: TrainResult) -> None:
        if trainer.is_main and result.model_dir is not None and self.on_metrics is not None:
            val = {f"val_loss/{d}": v for d, v in result.val_loss_by_domain.items()}
            self.on_metrics(result.steps, {"val_loss": result.val_loss, **val})


class Checkpointer(TrainCallback):
    """A sharded checkpoint every `run.checkpoint_every` steps (every rank writes its shard)."""

    def post_step(self, trainer: Trainer, out: StepOutput) -> None:
        if out.step % trainer.run_cfg.checkpoint_every == 0:
            trainer.save_checkpoint()


class TrainerHandle(TrainCallback):
    """Keeps hold of the trainer, so a caller whose run raised can still read its steps and curve."""

    trainer: Trainer | None = None

    def on_start(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def steps_and_curve(self) -> tuple[int, list[tuple[int, float]]]:
        if self.trainer is None:
            return 0, []
        return self.trainer.step, list(self.trainer.curves["loss"])
