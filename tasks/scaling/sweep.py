"""Sweep: many tiny proxy training runs over learning rate, mixture and model width.

A sweep is data: `design_trials` turns the config into named trials (named by their
hyper-parameters), `run_trial` trains one, and `run_sweep` runs them in worker processes.
The design is an LR × mixture grid at the base width, plus an LR sweep at every other width
(so the fit can use each width's best-LR loss, as in Chinchilla's approach 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from pydantic import Field, model_validator

from tasks.configbase import Section, runtime_field
from tasks.errors import ConfigError
from tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig
from tasks.train.data_loader import Mixture, mixture_with_weights

TRIALS_FILE = "trials.json"


def _default_proxy_model() -> ModelConfig:
    return ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64)


def _default_proxy_run() -> TrainRunConfig:
    return TrainRunConfig(steps=60, batch_size=8, seq_len=64, eval_batches=4, checkpoint_every=1000)


class SweepConfig(Section):
    model: ModelConfig = Field(default_factory=_default_proxy_model, description="the base proxy model")
    widths: list[int] = Field([32, 64, 96], description="d_model values for the size axis (head size kept fixed)")
    lrs: list[float] = Field([1e-3, 3e-3, 1e-2], min_length=1)
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
        return self

    def identity(self) -> dict:
        identity = super().identity()
        del identity["optim"]["lr"]  # never used: each trial takes its lr from the grid
        return identity


@dataclass(frozen=True)
class Trial:
    name: str
    width: int
    lr: float
    mixture: str


@dataclass
class TrialResult:
    name: str
    width: int
    lr: float
    mixture: str
    num_params: int
    non_embedding_params: int  # the N of the scaling law (Kaplan et al.): embeddings dominate tiny models
    val_loss: float
    final_train_loss: float
    val_loss_by_domain: dict[str, float]
    tokens_seen: int
    wall_s: float


def model_at_width(base: ModelConfig, width: int) -> ModelConfig:
    """The base model with d_model = width and the same head size."""
    head_dim = base.head_dim
    if width % head_dim:
        raise ConfigError(f"sweep.widths: {width} is not a multiple of the base head size {head_dim}")
    return base.model_copy(update={"d_model": width, "n_heads": width // head_dim})


def design_trials(cfg: SweepConfig) -> list[Trial]:
    base = cfg.model.d_model
    reference = next(iter(cfg.mixtures))
    trials = [Trial(f"w{base}-lr{lr:g}-{mix}", base, lr, mix) for mix in cfg.mixtures for lr in cfg.lrs]
    for width in sorted(set(cfg.widths) - {base}):
        trials += [Trial(f"w{width}-lr{lr:g}-{reference}", width, lr, reference) for lr in cfg.lrs]
    return trials


def run_trial(cfg: SweepConfig, trial: Trial, mixture: Mixture, out_dir: Path) -> TrialResult:
    import torch

    from tasks.train.loop import train_model
    from tasks.train.model import count_parameters

    torch.set_num_threads(1)  # results must not depend on how many trials share the machine
    model = model_at_width(cfg.model, trial.width)
    result = train_model(
        model,
        cfg.optim.model_copy(update={"lr": trial.lr}),
        cfg.run,
        mixture,
        out_dir,
    )
    return TrialResult(trial.name, trial.width, trial.lr, trial.mixture, result.num_params,
                       count_parameters(model, 0), result.val_loss,
                       result.final_train_loss, result.val_loss_by_domain, result.tokens_seen, result.wall_s)


def run_sweep(cfg: SweepConfig, shards: dict, shards_root: Path, out_dir: Path,
              on_trial: Callable[[TrialResult], None] | None = None) -> list[TrialResult]:
    """Run every trial (in `num_workers` processes); write `trials.json`; return results in design order."""
    mixtures = {name: mixture_with_weights(shards, shards_root, weights, f"sweep.mixtures.{name}")
                for name, weights in cfg.mixtures.items()}
    trials = design_trials(cfg)
    results: dict[str, TrialResult] = {}
    jobs = [(cfg, t, mixtures[t.mixture], out_dir / "trials" / t.name) for t in trials]
    if cfg.num_workers <= 1:
        for job in jobs:
            results[job[1].name] = result = run_trial(*job)
            if on_trial:
                on_trial(result)
    else:
        with ProcessPoolExecutor(cfg.num_workers, mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(run_trial, *job) for job in jobs]
            for future in as_completed(futures):
                result = future.result()
                results[result.name] = result
                if on_trial:
                    on_trial(result)
    ordered = [results[t.name] for t in trials]
    (out_dir / TRIALS_FILE).write_text(json.dumps([asdict(r) for r in ordered], indent=2))
    return ordered


def load_trials(path: Path) -> list[TrialResult]:
    return [TrialResult(**row) for row in json.loads(path.read_text())]
