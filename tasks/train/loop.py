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

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kiln.tasks.errors import InputError
from kiln.tasks.train.callbacks import Checkpointer, ExtensionSnapshot, MetricsLogger, ProgressBar
from kiln.tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig, revalidated
from kiln.tasks.train.data_loader import Mixture, validation_batches
from kiln.tasks.train.plots import LOSS_PLOT, plot_loss_curve
from kiln.tasks.train.rollback import HealthMonitor
from kiln.tasks.train.trainer import Hooks, TrainCallback, Trainer, TrainResult, write_metrics


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
    branch_from: Path | None = None,
) -> TrainResult:
    """Train for `run_cfg.steps` steps into out_dir (resuming a crashed attempt found there).

    `dims` is the parallel layout (default: one process); with a world size above 1 every rank
    of a torchrun job calls this together and out_dir must be on a filesystem they share.
    `on_metrics(step, metrics)` gets train metrics every `log_every` steps and validation loss at
    the end; `on_event(event)` gets each health event (a rollback, or giving up) as it is written
    to `health_events.jsonl`; both are called on rank 0 only. `callbacks` run after the health
    monitor and the progress bar, before metric logging and checkpointing (see
    `tasks.train.callbacks`). `stop_after`: return once that many steps are done, as a stopped
    job would (no final model). `branch_from`: a checkpoint of another run to go on from when out_dir
    has none (`Trainer.start`): an adjustment trains only the steps after it.
    """
    model_cfg, optim_cfg, run_cfg = revalidated(model_cfg), revalidated(optim_cfg), revalidated(run_cfg)
    dims = revalidated(dims) if dims is not None else ParallelDims()
    run_cfg.check_fits(model_cfg)
    for phase in mixture.phases:
        if phase.seq_len > model_cfg.max_seq_len:
            raise ValueError(f"data phase {phase.name!r} trains at seq_len {phase.seq_len}, above model.max_seq_len="
                             f"{model_cfg.max_seq_len}: lower the phase's seq_len or raise max_seq_len")
    dims.check_holds_batch(run_cfg)
    t_start, started_unix = time.perf_counter(), time.time()
    # built first so that a mixture without usable validation data fails before training
    val_batches = validation_batches(mixture, run_cfg.seq_len, run_cfg.eval_batches, run_cfg.batch_size)
    if not val_batches:
        raise InputError(
            f"no domain has a validation shard of at least seq_len + 1 = {run_cfg.seq_len + 1} "
            "tokens, so there is no validation loss: give the tokenize stage a larger val split"
        )
    hooks = Hooks([HealthMonitor(on_event), ProgressBar(), *callbacks, MetricsLogger(on_metrics), ExtensionSnapshot(),
                   Checkpointer()])

    with _torch_settings(run_cfg, torch.device(run_cfg.device)):
        trainer = Trainer.start(model_cfg, optim_cfg, run_cfg, mixture, out_dir, dims, init_model_dir, hooks,
                                branch_from)
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


