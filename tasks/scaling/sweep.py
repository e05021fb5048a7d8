"""Sweep: many tiny proxy training runs over learning rate, mixture, model width and batch size.

A sweep is data: `design_trials` turns the config into named trials (named by their
hyper-parameters), `run_trial` trains one, and `run_sweep` runs them in worker processes.
The design is an LR × mixture grid at the base width, an LR sweep at every other width (so the
fit can use each width's best-LR loss, as in Chinchilla's approach 1), and an LR sweep at every
other batch size (the LR/batch law's points).

A trial's failure is data, not the sweep's end: a trial that diverges (`TrainingDivergedError`)
or raises is recorded with its status, reason and the steps it reached, and the fit leaves it
out. Each trial's result is written to `trials/<name>.json` the moment it finishes, so an
interrupted sweep (the stage is resumable) reruns only the trials without one. Diverged
results are kept on a rerun: same seed, same data, same divergence. Failed ones are retried:
an exception or a killed worker (out of memory, a preempted host) may not happen twice.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from tasks.configbase import Section, runtime_field
from tasks.errors import ConfigError, KilnError
from tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig

if TYPE_CHECKING:  # torch-backed: imported where trials run, so that the config tree stays light
    from tasks.train.data_loader import Mixture

TRIALS_FILE = "trials.json"  # every trial in design order: the fit's input
TRIALS_DIR = "trials"  # trials/<name>/: a trial's training run; trials/<name>.json: its result, once finished
TrialStatus = Literal["ok", "diverged", "failed"]
FINAL_STATUSES = ("ok", "diverged")  # kept by a rerun; "failed" trials are run again


def _default_proxy_model() -> ModelConfig:
    return ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64)


def _default_proxy_run() -> TrainRunConfig:
    return TrainRunConfig(steps=60, batch_size=8, seq_len=64, eval_batches=4, checkpoint_every=1000)


class SweepConfig(Section):
    model: ModelConfig = Field(default_factory=_default_proxy_model, description="the base proxy model")
    widths: list[int] = Field([32, 64, 96], description="d_model values for the size axis (head size kept fixed)")
    lrs: list[float] = Field([1e-3, 3e-3, 1e-2], min_length=1)
    batch_sizes: list[int] = Field(
        [], description="micro-batch sizes for an LR sweep at the base width and reference mixture; "
        "run.batch_size is always swept and the rest of the design uses it (empty: only run.batch_size)")
    mixtures: dict[str, dict[str, float]] = Field(
        default_factory=lambda: {
            "uniform": {"web": 1, "code": 1, "prose": 1, "multilingual": 1},
            "prose_heavy": {"web": 1, "code": 1, "prose": 3, "multilingual": 1},
        },
        description="candidate domain weights (normalised); the first is the reference for the size axis",
    )
    optim: OptimConfig = Field(OptimConfig(), description="every optimizer setting but lr (the grid is `lrs`)")
    run: TrainRunConfig = Field(default_factory=_default_proxy_run)
    num_workers: int = runtime_field(2)

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        if "lr" in self.optim.model_fields_set:
            raise ValueError("sweep.optim.lr is not used: the sweep's learning rates are sweep.lrs")
        for name, weights in self.mixtures.items():
            if not weights:
                raise ValueError(f"sweep.mixtures.{name} is empty: give at least one domain weight")
        if any(b <= 0 for b in self.batch_sizes):
            raise ValueError(f"sweep.batch_sizes must be positive, got {self.batch_sizes}")
        return self

    @property
    def all_batch_sizes(self) -> list[int]:
        """run.batch_size, then the other swept batch sizes in ascending order."""
        return [self.run.batch_size, *sorted(set(self.batch_sizes) - {self.run.batch_size})]

    def identity(self) -> dict:
        identity = super().identity()
        del identity["optim"]["lr"]  # never used: each trial takes its lr from the grid
        identity["batch_sizes"] = self.all_batch_sizes  # [] and [run.batch_size] are the same design
        return identity


class SweepFailedError(KilnError):
    """No trial of the sweep succeeded; the message lists why they failed."""


@dataclass(frozen=True)
class Trial:
    name: str
    width: int
    lr: float
    mixture: str
    batch_size: int


@dataclass
class TrialResult:
    name: str
    width: int
    lr: float
    mixture: str
    batch_size: int
    num_params: int
    non_embedding_params: int  # the N of the scaling law (Kaplan et al.): embeddings dominate tiny models
    val_loss: float | None  # None unless status is "ok"
    final_train_loss: float | None
    val_loss_by_domain: dict[str, float]
    tokens_seen: int
    wall_s: float
    status: TrialStatus = "ok"
    reason: str | None = None  # why it diverged or failed
    steps: int = 0  # optimizer steps completed (the run's steps when it finished)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)  # up to where it stopped

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def succeeded(trials: Sequence[TrialResult]) -> list[TrialResult]:
    """The trials with a validation loss: the only ones a fit may use."""
    return [t for t in trials if t.ok]


def model_at_width(base: ModelConfig, width: int) -> ModelConfig:
    """The base model with d_model = width and the same head size."""
    head_dim = base.head_dim
    if width % head_dim:
        raise ConfigError(f"sweep.widths: {width} is not a multiple of the base head size {head_dim}")
    return base.model_copy(update={"d_model": width, "n_heads": width // head_dim})


def design_trials(cfg: SweepConfig) -> list[Trial]:
    base, batch = cfg.model.d_model, cfg.run.batch_size
    reference = next(iter(cfg.mixtures))

    def trial(width: int, lr: float, mixture: str, batch_size: int) -> Trial:
        return Trial(f"w{width}-lr{lr:g}-{mixture}-bs{batch_size}", width, lr, mixture, batch_size)

    trials = [trial(base, lr, mix, batch) for mix in cfg.mixtures for lr in cfg.lrs]
    for width in sorted(set(cfg.widths) - {base}):
        trials += [trial(width, lr, reference, batch) for lr in cfg.lrs]
    for batch_size in cfg.all_batch_sizes[1:]:
        trials += [trial(base, lr, reference, batch_size) for lr in cfg.lrs]
    return trials


def run_trial(cfg: SweepConfig, trial: Trial, mixture: Mixture, out_dir: Path) -> TrialResult:
    """Train one trial into out_dir (resuming a crashed attempt there). A divergence or an exception
    becomes a result with status "diverged" or "failed"; a `KilnError` (the user's to fix: the same
    for every trial) is raised."""
    import torch

    from tasks.train.callbacks import TrainerHandle
    from tasks.train.health import TrainingDivergedError
    from tasks.train.loop import train_model
    from tasks.train.model import count_parameters

    torch.set_num_threads(1)  # results must not depend on how many trials share the machine
    model = model_at_width(cfg.model, trial.width)
    reached = TrainerHandle()
    try:
        result = train_model(
            model,
            cfg.optim.model_copy(update={"lr": trial.lr}),
            cfg.run.model_copy(update={"batch_size": trial.batch_size}),
            mixture,
            out_dir,
            callbacks=[reached],
        )
    except KilnError:
        raise
    except Exception as error:  # recorded with its reason below: the sweep goes on, the fit leaves it out
        status: TrialStatus = "diverged" if isinstance(error, TrainingDivergedError) else "failed"
        steps, curve = reached.steps_and_curve()
        return TrialResult(trial.name, trial.width, trial.lr, trial.mixture, trial.batch_size,
                           count_parameters(model, mixture.vocab_size), count_parameters(model, 0), None, None, {},
                           steps * trial.batch_size * cfg.run.seq_len, 0.0,
                           status=status, reason=f"{type(error).__name__}: {error}", steps=steps, loss_curve=curve)
    return TrialResult(trial.name, trial.width, trial.lr, trial.mixture, trial.batch_size, result.num_params,
                       count_parameters(model, 0), result.val_loss, result.final_train_loss,
                       result.val_loss_by_domain, result.tokens_seen, result.wall_s,
                       steps=result.steps, loss_curve=[(s, v) for s, v in result.loss_curve])


TrialFn = Callable[[SweepConfig, Trial, "Mixture", Path], TrialResult]


def _run_and_save(trial_fn: TrialFn, cfg: SweepConfig, trial: Trial, mixture: Mixture, trials_dir: Path) -> TrialResult:
    """Run one trial and persist its result before returning it: a result on disk is a finished trial."""
    result = trial_fn(cfg, trial, mixture, trials_dir / trial.name)
    save_trial(result, trials_dir)
    return result


def save_trial(result: TrialResult, trials_dir: Path) -> None:
    path = trials_dir / f"{result.name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(asdict(result), indent=2))
    os.replace(tmp, path)  # atomic: a crash leaves no half-written result


def load_finished(trials_dir: Path, trial: Trial) -> TrialResult | None:
    """The trial's persisted result if a rerun keeps it (status ok or diverged), else None."""
    path = trials_dir / f"{trial.name}.json"
    if not path.is_file():
        return None
    result = _result_from_json(json.loads(path.read_text()))
    return result if result.status in FINAL_STATUSES else None


def _worker_died(cfg: SweepConfig, trial: Trial, vocab_size: int, trials_dir: Path) -> TrialResult:
    from tasks.train.model import count_parameters

    model = model_at_width(cfg.model, trial.width)
    result = TrialResult(trial.name, trial.width, trial.lr, trial.mixture, trial.batch_size,
                         count_parameters(model, vocab_size), count_parameters(model, 0), None, None, {}, 0, 0.0,
                         status="failed", reason="its worker process died (killed, e.g. out of memory, or crashed)")
    save_trial(result, trials_dir)
    return result


def run_sweep(cfg: SweepConfig, shards: dict, shards_root: Path, out_dir: Path,
              on_trial: Callable[[TrialResult, bool], None] | None = None,
              trial_fn: TrialFn = run_trial) -> list[TrialResult]:
    """Run every trial without a kept result in `out_dir/trials/` (in `num_workers` processes);
    write `trials.json`; return results in design order.

    `on_trial(result, resumed)` is called once per trial: first for the results a previous attempt
    left (resumed=True), then for each trial as it finishes. Raises `SweepFailedError` when no
    trial succeeded."""
    from tasks.train.data_loader import mixture_with_weights

    mixtures = {name: mixture_with_weights(shards, shards_root, weights, f"sweep.mixtures.{name}")
                for name, weights in cfg.mixtures.items()}
    trials = design_trials(cfg)
    trials_dir = out_dir / TRIALS_DIR
    trials_dir.mkdir(parents=True, exist_ok=True)
    for torn in trials_dir.glob("*.json.tmp"):  # a result being written when the last attempt died
        torn.unlink()
    results: dict[str, TrialResult] = {}
    for trial in trials:
        if (kept := load_finished(trials_dir, trial)) is not None:
            results[trial.name] = kept
            if on_trial:
                on_trial(kept, True)

    def finished(result: TrialResult) -> None:
        results[result.name] = result
        if on_trial:
            on_trial(result, False)

    pending = [t for t in trials if t.name not in results]
    if cfg.num_workers <= 1:
        for trial in pending:
            finished(_run_and_save(trial_fn, cfg, trial, mixtures[trial.mixture], trials_dir))
    else:
        broken = _run_in_pool(pending, cfg.num_workers, trial_fn, cfg, mixtures, trials_dir, finished)
        _run_isolated(broken, trial_fn, cfg, mixtures, trials_dir, finished)
    ordered = [results[t.name] for t in trials]
    (out_dir / TRIALS_FILE).write_text(json.dumps([asdict(r) for r in ordered], indent=2))
    if not succeeded(ordered):
        raise SweepFailedError(_all_failed_message(ordered, trials_dir))
    return ordered


def _run_in_pool(trials: list[Trial], num_workers: int, trial_fn: TrialFn, cfg: SweepConfig,
                 mixtures: dict[str, Mixture], trials_dir: Path,
                 finished: Callable[[TrialResult], None]) -> list[Trial]:
    """Run `trials` in a pool of spawned processes; return those left unfinished by a dead worker."""
    if not trials:
        return []
    pool = ProcessPoolExecutor(min(num_workers, len(trials)), mp_context=get_context("spawn"))
    futures: dict[Future, Trial] = {
        pool.submit(_run_and_save, trial_fn, cfg, t, mixtures[t.mixture], trials_dir): t for t in trials}
    broken: list[Trial] = []
    try:
        for future in as_completed(futures):
            try:
                result = future.result()
            except BrokenProcessPool:
                broken.append(futures[future])
                continue
            finished(result)
    finally:
        # on an interrupt, trials not yet started are dropped; running ones finish and save their results
        pool.shutdown(wait=True, cancel_futures=True)
    return sorted(broken, key=trials.index)


def _run_isolated(trials: list[Trial], trial_fn: TrialFn, cfg: SweepConfig, mixtures: dict[str, Mixture],
                  trials_dir: Path, finished: Callable[[TrialResult], None]) -> None:
    """Run trials one at a time in a one-process pool. A dead worker took a pool down with every trial
    in it, unfinished; alone, a trial that kills its worker again is the one named and recorded."""
    pool: ProcessPoolExecutor | None = None
    try:
        for trial in trials:
            pool = pool or ProcessPoolExecutor(1, mp_context=get_context("spawn"))
            try:
                result = pool.submit(_run_and_save, trial_fn, cfg, trial, mixtures[trial.mixture], trials_dir).result()
            except BrokenProcessPool:
                pool.shutdown(wait=True)
                pool = None
                result = _worker_died(cfg, trial, mixtures[trial.mixture].vocab_size, trials_dir)
            finished(result)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _all_failed_message(results: list[TrialResult], trials_dir: Path) -> str:
    counts = Counter(r.status for r in results)
    reasons = Counter((r.reason or "").split("\n")[0][:300] for r in results)
    listed = "; ".join(f"{n}x {reason}" for reason, n in reasons.most_common(3))
    return (f"every sweep trial failed ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}), "
            f"so there is nothing to fit. Most common reasons: {listed}. Each trial's run is in "
            f"{trials_dir}/<trial name>/; a diverging grid wants smaller sweep.lrs (or sweep.optim.warmup_steps).")


def _result_from_json(row: dict) -> TrialResult:
    row = {**row, "loss_curve": [(int(s), float(v)) for s, v in row.get("loss_curve", [])]}
    return TrialResult(**row)


def load_trials(path: Path) -> list[TrialResult]:
    """Every trial in `trials.json`, failed ones included (see `succeeded`)."""
    return [_result_from_json(row) for row in json.loads(path.read_text())]
