"""Sweep: the proxy runs the fit decides from, as a design (data) and a runner.

Three designs, each a list of named trials (named by their hyper-parameters):

- **IsoFLOP grid** (Hoffmann et al. 2022, approach 2): for each compute budget C, several model
  widths, each trained on D = C / (6 N) tokens (N: parameters, the embedding included). These points feed
  both the parametric law L(N, D) and the per-budget parabola minima.
- **LR × batch grid** (DeepSeek LLM 2024): at each budget's best width (known once its IsoFLOP
  trials finished, so this is a second phase), every `lr_multipliers` × `batch_sizes` pair, at the
  same token count. The best points per budget give LR*(C) and batch*(C).
- **Mixture design** (RegMix, Liu et al. 2024): the named mixtures plus Dirichlet samples around
  the reference (first named) mixture, each a short run of one small model; the fit regresses
  validation loss on the weights.

A trial's learning rate is `lr · (model.d_model / width) ^ lr_width_exponent`: a μP-style width
rule, so that every width trains near its own best LR and an IsoFLOP profile measures size rather
than LR mismatch (one LR for all widths favours the widths it happens to suit).

Each trial is a sub-run of the stage (`trials/<name>/`: its own key, lock, manifest and MLflow child
run; `kiln.tasks.ledger.SubRuns`). The process that trains a trial commits it (`OpenSubRun`): its
manifest's stats are its whole result, the one record a rerun reuses, so an interrupted sweep reuses
every committed trial and resumes the others from their folders; the second phase is designed again
from the first phase's results, so it comes out the same. Where trials train is
`tasks.scaling.trial_runs`: `sweep.max_parallel` processes of the stage, or as many jobs at a time
through `cluster.launcher`.

A trial's failure is data, not the sweep's end: a trial that diverges (`TrainingDivergedError`)
is committed with its status, reason and the steps it reached, and the fit leaves it out; it is
not run again (same seed, same data, same divergence). One that failed (an exception, a killed
process, a cancelled or preempted job) is retried on its own, resuming from its folder; if it
keeps failing it is left uncommitted, its failure recorded in its folder (`Store.record_failure`),
and the fit leaves it out too.

The mixture design grows with the number of domains: it samples at least as many mixtures as the
mixture regression needs (`mixture_regression.minimum_trials`, for `fit.mixture_folds` folds).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from kiln.tasks.configbase import Reference, Section, runtime_field
from kiln.tasks.errors import ConfigError, KilnError, TrainingDivergedError
from kiln.tasks.ledger import OpenSubRun, StageRecorder, SubRun, SubRuns
from kiln.tasks.progress import Progress
from kiln.tasks.store import Store
from kiln.tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig

if TYPE_CHECKING:  # torch-backed: imported where trials run, so that the config tree stays light
    from kiln.tasks.train.data_loader import Mixture

TRIALS_FILE = "trials.json"  # every trial in design order: the fit's input
TRIALS_DIR = "trials"  # trials/<name>/: a trial's sub-run (its training run; its result is its manifest's stats)
ATTEMPTS_FILE = "attempts.jsonl"  # in its folder: one line per time a process started training it
REASON_TAG_CHARS = 1000  # MLflow caps tag values; the whole reason is in the sub-run's manifest or failure record
DEFAULT_FOLDS = 5  # fit.mixture_folds' default: the folds the mixture design sizes itself for
TrialStatus = Literal["ok", "diverged", "failed"]
TrialKind = Literal["isoflop", "hyper", "mixture"]
FINAL_STATUSES = ("ok", "diverged")  # kept by a rerun; "failed" trials are run again
SAMPLED_PREFIX = "dirichlet"  # sampled mixtures are named dirichlet00, dirichlet01, ...


def _default_proxy_model() -> ModelConfig:
    return ModelConfig(d_model=4, n_layers=2, n_heads=2, max_seq_len=64)


def _default_proxy_run() -> TrainRunConfig:
    return TrainRunConfig(steps=30, batch_size=8, seq_len=64, eval_batches=4, checkpoint_every=100_000)


class IsoFlopBudget(Section):
    """One compute budget of the IsoFLOP grid and the widths trained at it."""

    flops: float = Field(gt=0, description="C = 6·N·D with N every parameter (see params_at_width) and D the tokens")
    widths: list[int] = Field(min_length=1, description="d_model values trained at this budget, each on C/(6N) tokens")


def _default_isoflop() -> list[IsoFlopBudget]:
    return [IsoFlopBudget(flops=2e9, widths=[2, 4, 6, 8]), IsoFlopBudget(flops=4e9, widths=[2, 4, 6, 8]),
            IsoFlopBudget(flops=8e9, widths=[4, 6, 8, 12])]


class MixtureDesign(Section):
    """The RegMix-style mixture trials: Dirichlet samples around the reference mixture."""

    num_samples: int = Field(18, ge=0, description="sampled mixtures (0: only the named ones)")
    concentration: float = Field(
        4.0, gt=0, description="Dirichlet(concentration x reference weights): lower spreads the samples wider")
    width: int | None = Field(None, description="d_model of the mixture trials (null: model.d_model)")
    seed: int = Field(0, ge=0)


class SweepConfig(Section):
    model: ModelConfig = Field(default_factory=_default_proxy_model,
                               description="the proxy family: depth, head size and context; d_model is the width "
                                           "the LR rule is anchored at and the mixture trials' default width")
    lr: float = Field(0.06, gt=0, description="the learning rate at width model.d_model")
    lr_width_exponent: float = Field(
        0.0, ge=0, description="a trial at width w uses lr * (model.d_model / w) ** this (0: one LR for every width)")
    isoflop: list[IsoFlopBudget] = Field(default_factory=_default_isoflop,
                                         description="compute budgets, ascending, each with its widths")
    lr_multipliers: list[float] = Field(
        [0.5, 1.0, 2.0], min_length=1,
        description="at each budget's best width: these multiples of its LR, crossed with batch_sizes")
    batch_sizes: list[int] = Field(
        [], description="batch sizes crossed with lr_multipliers at each budget's best width (run.batch_size is "
        "always one of them)")
    mixtures: dict[str, dict[str, float]] = Field(
        default_factory=lambda: {
            "uniform": {"web": 1, "code": 1, "prose": 1, "multilingual": 1},
            "prose_heavy": {"web": 1, "code": 1, "prose": 3, "multilingual": 1},
        },
        description="named domain weights (normalised); the first is the reference: the IsoFLOP and LR x batch "
                    "trials train on it, and the Dirichlet samples centre on it",
    )
    mixture_design: MixtureDesign = MixtureDesign()
    optim: OptimConfig = Field(OptimConfig(), description="every optimizer setting but lr (see lr, lr_multipliers)")
    run: TrainRunConfig = Field(
        default_factory=_default_proxy_run,
        description="batch_size and seq_len of every trial; steps is the mixture trials' length (the IsoFLOP and "
                    "LR x batch trials' lengths follow from their budgets)")
    max_parallel: int = runtime_field(
        2, gt=0, description="trials training at once: processes of the stage with cluster.launcher=local, "
        "else jobs through cluster.launcher (each trains its share of the trials, one after another)")

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        if "lr" in self.optim.model_fields_set:
            raise ValueError("sweep.optim.lr is not used: the sweep's learning rate is sweep.lr (times the width rule "
                             "and sweep.lr_multipliers)")
        if not self.mixtures:
            raise ValueError("sweep.mixtures is empty: name at least one mixture (the first is the reference)")
        for name, weights in self.mixtures.items():
            if not weights or sum(weights.values()) <= 0 or any(w < 0 for w in weights.values()):
                raise ValueError(f"sweep.mixtures.{name} needs non-negative weights with a positive sum")
            if name.startswith(SAMPLED_PREFIX):
                raise ValueError(f"sweep.mixtures.{name}: names starting with '{SAMPLED_PREFIX}' are the sampled "
                                 "mixtures'; choose another name")
        if any(b <= 0 for b in self.batch_sizes):
            raise ValueError(f"sweep.batch_sizes must be positive, got {self.batch_sizes}")
        if any(m <= 0 for m in self.lr_multipliers):
            raise ValueError(f"sweep.lr_multipliers must be positive, got {self.lr_multipliers}")
        budgets = [b.flops for b in self.isoflop]
        if budgets != sorted(set(budgets)):
            raise ValueError(f"sweep.isoflop budgets must be distinct and ascending, got {budgets}")
        head = self.model.head_dim
        widths = [w for b in self.isoflop for w in b.widths] + [self.mixture_width]
        bad = sorted({w for w in widths if w <= 0 or w % head})
        if bad:
            raise ValueError(f"sweep widths {bad} are not positive multiples of the proxy head size "
                             f"{head} (model.d_model / model.n_heads)")
        return self

    @property
    def reference(self) -> str:
        return next(iter(self.mixtures))

    @property
    def mixture_width(self) -> int:
        return self.mixture_design.width or self.model.d_model

    @property
    def all_batch_sizes(self) -> list[int]:
        """run.batch_size, then the other swept batch sizes in ascending order."""
        return [self.run.batch_size, *sorted(set(self.batch_sizes) - {self.run.batch_size})]

    def lr_at(self, width: int) -> float:
        """The width rule: `lr` at model.d_model, scaled by (d_model / width) ** lr_width_exponent."""
        return self.lr * (self.model.d_model / width) ** self.lr_width_exponent

    def names_used(self) -> list[Reference]:
        return super().names_used() + [Reference(f"mixtures.{name}", "domain", tuple(weights), keyed=True)
                                       for name, weights in self.mixtures.items()]

    @model_serializer(mode="wrap")
    def _without_optim_lr(self, handler: SerializerFunctionWrapHandler) -> dict:
        """Dumps (`kiln config`, logged params) leave out `optim.lr`, which this section refuses: what
        `kiln config` prints must load back as it is."""
        dumped = handler(self)
        dumped["optim"].pop("lr", None)
        return dumped

    def identity(self) -> dict:
        identity = super().identity()
        del identity["optim"]["lr"]  # never used: each trial takes its lr from the design
        identity["batch_sizes"] = self.all_batch_sizes  # [] and [run.batch_size] are the same design
        return identity


class SweepFailedError(KilnError):
    """No trial of the sweep succeeded; the message lists why they failed."""


@dataclass(frozen=True)
class Trial:
    name: str
    kind: TrialKind
    width: int
    lr: float
    batch_size: int
    steps: int
    mixture: str
    weights: dict[str, float]  # normalised
    budget: float | None = None  # the nominal compute of an IsoFLOP / LR x batch trial


@dataclass
class TrialResult:
    name: str
    width: int
    lr: float
    mixture: str
    batch_size: int
    num_params: int
    non_embedding_params: int  # Kaplan et al.'s N, recorded; the laws use num_params (see params_at_width)
    val_loss: float | None  # None unless status is "ok"
    final_train_loss: float | None
    val_loss_by_domain: dict[str, float]
    tokens_seen: int
    wall_s: float
    status: TrialStatus = "ok"
    reason: str | None = None  # why it diverged or failed
    steps: int = 0  # optimizer steps completed (the run's steps when it finished)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)  # up to where it stopped
    kind: TrialKind = "isoflop"
    budget: float | None = None
    weights: dict[str, float] = field(default_factory=dict)
    tokens: int = 0  # the tokens the design asked for (steps x batch x seq_len)

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
        raise ConfigError(f"sweep: width {width} is not a multiple of the base head size {head_dim}")
    return base.model_copy(update={"d_model": width, "n_heads": width // head_dim})


def params_at_width(base: ModelConfig, width: int, vocab_size: int) -> int:
    """N of the scaling law: every parameter, the (tied) embedding included, as Hoffmann et al. count.

    At proxy sizes the V x d embedding is most of the model, and its output projection most of
    a step's FLOPs, so leaving it out (Kaplan et al.'s N) would misstate both size and compute.
    """
    from kiln.tasks.train.model import count_parameters  # defers torch

    return count_parameters(model_at_width(base, width), vocab_size)


def normalised(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {d: w / total for d, w in sorted(weights.items())}


def _name(width: int, lr: float, batch: int, steps: int, mixture: str) -> str:
    return f"w{width}-lr{lr:.3g}-bs{batch}-s{steps}-{mixture}"


def steps_for(tokens: float, batch_size: int, seq_len: int) -> int:
    return max(1, round(tokens / (batch_size * seq_len)))


def sampled_mixtures(cfg: SweepConfig, num_samples: int | None = None) -> dict[str, dict[str, float]]:
    """The Dirichlet samples around the reference mixture (its zero-weight domains stay at zero):
    `num_samples` of them (default: `mixture_design.num_samples`). The seed fixes the sequence, so a
    larger design keeps the smaller one's samples."""
    design = cfg.mixture_design
    num_samples = design.num_samples if num_samples is None else num_samples
    reference = normalised(cfg.mixtures[cfg.reference])
    domains = [d for d, w in reference.items() if w > 0]
    if num_samples and len(domains) < 2:
        raise ConfigError(f"sweep.mixture_design samples mixtures of the reference '{cfg.reference}', which has "
                          f"{len(domains)} domain with weight; give it at least 2 (or num_samples: 0)")
    rng = np.random.default_rng(design.seed)
    alpha = np.array([reference[d] for d in domains]) * design.concentration
    return {f"{SAMPLED_PREFIX}{i:02d}": dict(zip(domains, map(float, rng.dirichlet(alpha)), strict=True))
            for i in range(num_samples)}


def num_samples_needed(cfg: SweepConfig, num_named: int, mixture_folds: int) -> int:
    """`mixture_design.num_samples`, raised so that the named and sampled mixture trials reach the mixture
    regression's minimum for the reference's domains and `mixture_folds` folds (0 stays 0: no regression
    is wanted then)."""
    from kiln.tasks.scaling.mixture_regression import minimum_trials  # defers sklearn

    asked = cfg.mixture_design.num_samples
    if asked == 0:
        return 0
    domains = sum(w > 0 for w in cfg.mixtures[cfg.reference].values())
    return max(asked, minimum_trials(domains, mixture_folds) - num_named)


def design_trials(cfg: SweepConfig, vocab_size: int, mixture_folds: int = DEFAULT_FOLDS) -> list[Trial]:
    """The first phase: the IsoFLOP grid, then the named and sampled mixtures (at least as many mixture
    trials as the mixture regression needs, see `num_samples_needed`)."""
    batch, seq = cfg.run.batch_size, cfg.run.seq_len
    reference = cfg.reference
    ref_weights = normalised(cfg.mixtures[reference])
    trials = []
    for budget in cfg.isoflop:
        for width in budget.widths:
            steps = steps_for(budget.flops / (6 * params_at_width(cfg.model, width, vocab_size)), batch, seq)
            lr = cfg.lr_at(width)
            trials.append(Trial(_name(width, lr, batch, steps, reference), "isoflop", width, lr, batch, steps,
                                reference, ref_weights, budget.flops))
    width, lr, steps = cfg.mixture_width, cfg.lr_at(cfg.mixture_width), cfg.run.steps

    def mixture_trial(name: str, weights: dict[str, float]) -> Trial:
        return Trial(_name(width, lr, batch, steps, name), "mixture", width, lr, batch, steps, name, weights)

    # the reference may already be an IsoFLOP trial (same width, LR and steps): then it is not a mixture trial
    named = [trial for name, w in cfg.mixtures.items()
             if (trial := mixture_trial(name, normalised(w))).name not in {t.name for t in trials}]
    sampled = sampled_mixtures(cfg, num_samples_needed(cfg, len(named), mixture_folds))
    return trials + named + [mixture_trial(name, weights) for name, weights in sampled.items()]


def best_isoflop_trials(cfg: SweepConfig, results: Sequence[TrialResult]) -> dict[float, TrialResult]:
    """Per budget, its finished IsoFLOP trial with the lowest validation loss."""
    best: dict[float, TrialResult] = {}
    for r in succeeded(results):
        if r.kind == "isoflop" and r.budget is not None and (r.budget not in best or r.val_loss < best[r.budget].val_loss):
            best[r.budget] = r
    return {b.flops: best[b.flops] for b in cfg.isoflop if b.flops in best}


def design_hyper_trials(cfg: SweepConfig, first_phase: Sequence[TrialResult]) -> list[Trial]:
    """The second phase: lr_multipliers x batch sizes at each budget's best width, on the same tokens."""
    seq, reference = cfg.run.seq_len, cfg.reference
    ref_weights = normalised(cfg.mixtures[reference])
    trials = []
    for budget, best in best_isoflop_trials(cfg, first_phase).items():
        tokens = budget / (6 * best.num_params)
        for batch in cfg.all_batch_sizes:
            for multiplier in cfg.lr_multipliers:
                if multiplier == 1.0 and batch == cfg.run.batch_size:
                    continue  # the IsoFLOP trial itself
                lr, steps = cfg.lr_at(best.width) * multiplier, steps_for(tokens, batch, seq)
                trials.append(Trial(_name(best.width, lr, batch, steps, reference), "hyper", best.width, lr, batch,
                                    steps, reference, ref_weights, budget))
    return trials


def run_trial(cfg: SweepConfig, trial: Trial, mixture: Mixture, out_dir: Path) -> TrialResult:
    """Train one trial into out_dir (resuming a crashed attempt there). A divergence or an exception
    becomes a result with status "diverged" or "failed"; a `KilnError` (the user's to fix: the same
    for every trial) is raised."""
    import torch

    from kiln.tasks.train.callbacks import TrainerHandle  # defers torch
    from kiln.tasks.train.loop import train_model  # defers torch
    from kiln.tasks.train.model import count_parameters  # defers torch

    torch.set_num_threads(1)  # results must not depend on how many trials share the machine
    model = model_at_width(cfg.model, trial.width)
    run_cfg = cfg.run.model_copy(update={"batch_size": trial.batch_size, "steps": trial.steps})
    reached = TrainerHandle()
    design = {"kind": trial.kind, "budget": trial.budget, "weights": trial.weights,
              "tokens": trial.steps * trial.batch_size * cfg.run.seq_len}
    try:
        result = train_model(model, cfg.optim.model_copy(update={"lr": trial.lr}), run_cfg, mixture, out_dir,
                             callbacks=[reached])
    except KilnError:
        raise
    except Exception as error:  # recorded with its reason below: the sweep goes on, the fit leaves it out
        status: TrialStatus = "diverged" if isinstance(error, TrainingDivergedError) else "failed"
        steps, curve = reached.steps_and_curve()
        return TrialResult(trial.name, trial.width, trial.lr, trial.mixture, trial.batch_size,
                           count_parameters(model, mixture.vocab_size), count_parameters(model, 0), None, None, {},
                           steps * trial.batch_size * cfg.run.seq_len, 0.0,
                           status=status, reason=f"{type(error).__name__}: {error}", steps=steps, loss_curve=curve,
                           **design)
    return TrialResult(trial.name, trial.width, trial.lr, trial.mixture, trial.batch_size, result.num_params,
                       count_parameters(model, 0), result.val_loss, result.final_train_loss,
                       result.val_loss_by_domain, result.tokens_seen, result.wall_s,
                       steps=result.steps, loss_curve=[(s, v) for s, v in result.loss_curve], **design)


TrialFn = Callable[[SweepConfig, Trial, "Mixture", Path], TrialResult]


def train_trial(trial_fn: TrialFn, cfg: SweepConfig, trial: Trial, mixture: Mixture, run: OpenSubRun,
                launcher: str) -> TrialResult:
    """Train one trial in its sub-run's partial folder (resuming what an earlier attempt left there) and,
    when its result is final (ok, diverged), commit the sub-run with it, launched by `launcher`; a failed
    result is recorded in the folder for the next attempt to replace. A trial committed already (its
    process died after the commit, before it could say so) is not trained again: its result is its
    manifest's."""
    committed = run.committed()
    if committed is not None:
        return trial_result(committed["stats"])
    with (run.folder / ATTEMPTS_FILE).open("a") as attempts:  # which job, node and process trained it, and when
        attempts.write(json.dumps({"job_id": os.environ.get("SLURM_JOB_ID") or os.environ.get("KILN_JOB_ID"),
                                   # the scheduler's node name (a Slurm node need not be named as its host)
                                   "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                                   "host": socket.gethostname(), "pid": os.getpid(), "started_unix": time.time()})
                       + "\n")
    cpu = time.process_time()
    result = trial_fn(cfg, trial, mixture, run.folder)
    if result.status in FINAL_STATUSES:
        run.commit(trial_stats(result), wall_s=result.wall_s,
                   launch={**launch_record(launcher, run.folder), "cpu_s": time.process_time() - cpu})
    else:
        run.record_failure(failure_record(result))
    return result


def launch_record(launcher: str, folder: Path) -> dict:
    """How a trial was launched, for its sub-run's manifest: the launcher and each attempt that trained it."""
    path = folder / ATTEMPTS_FILE
    attempts = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return {"launcher": launcher, "attempts": attempts}


def trial_stats(result: TrialResult) -> dict:
    """A trial's result as its sub-run's stats: all of it, the record a rerun reuses (`trial_result`)."""
    return asdict(result)


def trial_result(stats: dict) -> TrialResult:
    """The result a committed trial's stats hold."""
    return _result_from_json(stats)


def failure_record(result: TrialResult) -> dict:
    """A failed trial's result as its partial folder's failure record (`Store.record_failure`)."""
    return {"error": f"trial {result.status}", "message": result.reason, "retryable": True, "result": asdict(result)}


def failed_result(failure: dict | None) -> TrialResult | None:
    """The failed result a trial's failure record holds (None: none, or a failure that is no trial's result)."""
    return _result_from_json(failure["result"]) if failure and "result" in failure else None


def worker_died(cfg: SweepConfig, trial: Trial, vocab_size: int, reason: str) -> TrialResult:
    """The result of a trial whose process never returned one (killed, its job failed)."""
    from kiln.tasks.train.model import count_parameters  # defers torch

    model = model_at_width(cfg.model, trial.width)
    return TrialResult(trial.name, trial.width, trial.lr, trial.mixture, trial.batch_size,
                       count_parameters(model, vocab_size), count_parameters(model, 0), None, None, {}, 0, 0.0,
                       status="failed", reason=reason, kind=trial.kind, budget=trial.budget, weights=trial.weights,
                       tokens=trial.steps * trial.batch_size * cfg.run.seq_len)


def trial_cost(trial: Trial) -> float:
    """A trial's rough CPU cost, to start the longest first (the workers then end evenly)."""
    return trial.steps * trial.batch_size * (trial.width + 64)


def trial_subrun(trial: Trial) -> SubRun:
    """A trial as its stage's sub-run `trials/<name>`: its key hashes its design (the sweep's settings
    and the tokenized data are in its stage's key)."""
    params = {"lr": trial.lr, "width": trial.width, "mixture": trial.mixture, "batch_size": trial.batch_size,
              "steps": trial.steps, "kind": trial.kind, **({"budget": trial.budget} if trial.budget else {}),
              **{f"weight.{d}": w for d, w in trial.weights.items()}}
    return SubRun(TRIALS_DIR, trial.name, asdict(trial), params=params)


Pending = list[tuple[Trial, OpenSubRun]]  # each trial with its begun sub-run (its partial folder)
Finished = tuple[Trial, TrialResult]  # ...and its result: final (committed by its worker) or failed


class TrialLauncher(Protocol):
    """Where a sweep's trials train (`kiln.tasks.scaling.trial_runs`: processes here, or cluster jobs); the
    stage chooses one from `cluster.launcher` and hands it to `run_sweep`."""

    def run(self, cfg: SweepConfig, shards: dict, shards_root: Path, pending: Pending,
            label: str) -> Iterator[Finished]:
        """Train `pending`; yield each trial's final (or, after its retries, failed) result as it comes."""

    def launch_record(self, name: str) -> dict | None:
        """Where trial `name` ran, once its phase has ended (`tasks.launch.cluster.launch_record`'s shape: its
        jobs, nodes and attempts as the scheduler recorded them, each job's log); None: in the stage's processes."""


def run_trials(cfg: SweepConfig, shards: dict, shards_root: Path, subruns: SubRuns, trials: list[Trial], *,
               where: TrialLauncher, label: str, what: str, results: dict[str, TrialResult],
               subrun_of: Callable[[Trial], SubRun] | None = None,
               on_trial: Callable[[TrialResult, bool], None] | None = None, log_every: int | None = None) -> None:
    """One phase of trials of `cfg`'s proxy family, each the sub-run `subrun_of(trial)` (default
    `trial_subrun`): complete ones are reused, the others run where `where` trains them (their
    workers commit them); each trial's result goes into `results` under its name (one already there
    is skipped). A failed trial's child run is marked failed and its reason recorded in its folder.
    The sweep's phases run through it, and so do the research stage's (variant, seed) groups."""
    subrun_of = subrun_of or trial_subrun
    if not trials:
        return
    with ExitStack() as locks:  # each pending trial's sub-run lock, held until it is committed or failed
        pending = []
        for trial in trials:
            if trial.name in results:
                continue
            lock = subruns.lock(subrun_of(trial))
            lock.acquire()
            reused = subruns.reuse(subrun_of(trial))
            if reused is None:
                locks.callback(lock.release)
                pending.append(trial)
                continue
            lock.release()
            results[trial.name] = trial_result(reused.stats)
            if on_trial:
                on_trial(results[trial.name], True)
        progress = Progress(what, len(trials), "trials", done=len(trials) - len(pending))
        started = {}
        for trial in pending:
            sub = subrun_of(trial)
            _, recorder = subruns.begin(sub)
            started[trial.name] = (sub, recorder, subruns.opened(sub, recorder))
        pending.sort(key=lambda t: -trial_cost(t))
        ran: list[tuple[Trial, StageRecorder]] = []
        with progress:
            try:
                for trial, result in where.run(cfg, shards, shards_root,
                                               [(t, started[t.name][2]) for t in pending], label):
                    sub, recorder, run = started.pop(trial.name)
                    record_trial(recorder, result, log_every or cfg.run.log_every)
                    if result.status in FINAL_STATUSES:  # its worker committed it
                        manifest = run.committed()
                        assert manifest is not None, f"trial {trial.name} ended {result.status} uncommitted"
                        subruns.recorded(sub, recorder, manifest, failed=not result.ok)
                    else:
                        run.record_failure(failure_record(result))  # the reason, for whoever opens the folder
                        subruns.fail(recorder, result.reason or "failed")
                    results[trial.name] = result
                    bad = sum(r.status != "ok" for r in results.values())
                    progress.advance(note=f"{bad} failed or diverged" if bad else "")
                    if on_trial:
                        on_trial(result, False)
                    ran.append((trial, recorder))
            except BaseException as error:  # the trials still running stop with the sweep: their child runs say so
                for _, recorder, _ in started.values():
                    subruns.fail(recorder, f"the sweep stopped before it finished: {type(error).__name__}: {error}")
                raise
        # where each ran, once the phase's jobs have ended (a job trains several trials; its end is the scheduler's
        # record of them all): the stage's manifest's launch.runs[trials/<name>] and the trial's child run's tags
        for trial, recorder in ran:
            record = getattr(where, "launch_record", lambda _: None)(trial.name)
            if record is not None:
                recorder.launched(record)


def run_sweep(cfg: SweepConfig, shards: dict, shards_root: Path, subruns: SubRuns, *,
              where: TrialLauncher, mixture_folds: int = DEFAULT_FOLDS,
              on_trial: Callable[[TrialResult, bool], None] | None = None,
              log_every: int | None = None, committed_as: Path | None = None) -> list[TrialResult]:
    """Run both phases, each trial a sub-run of the stage (`subruns`, in `trials/<name>/`): complete
    ones are reused (their manifests hold their results), the others run where `where` trains them,
    whose workers commit each as it finishes; write `trials.json` beside them; return results in
    design order.

    A trial that ends ok or diverged is committed (a divergence is data: same seed, same data, same
    divergence, so it is not run again). One that failed (an exception, a killed process or job) is
    retried on its own by `where`; if it still fails it is recorded and left uncommitted, so the next
    attempt of the stage runs it again. `on_trial(result, resumed)` is called once per trial, as it
    is reused (resumed=True) or finishes. Raises `SweepFailedError` when no trial succeeded.

    `committed_as`: the folder `subruns`' root becomes when its stage commits (the stage's partial
    folder is renamed): a failed trial's reason names its job's log there (in `trials.json`, the
    results and its failure record), since the sweep's returning is what lets the stage commit. A
    sweep that fails keeps the partial folder, and the reasons name it."""
    results: dict[str, TrialResult] = {}

    def run_phase(trials: list[Trial], label: str, what: str) -> None:
        run_trials(cfg, shards, shards_root, subruns, trials, where=where, label=label, what=what, results=results,
                   on_trial=on_trial, log_every=log_every)

    first = design_trials(cfg, shards["vocab_size"], mixture_folds)
    run_phase(first, "phase1", "sweep (IsoFLOP and mixture trials)")
    second = design_hyper_trials(cfg, [results[t.name] for t in first])
    run_phase(second, "phase2", "sweep (LR x batch trials)")
    ordered = [results[t.name] for t in first + second]
    if committed_as is not None and succeeded(ordered):
        ordered = [_committed_reason(r, subruns.store, Path(committed_as)) for r in ordered]
    (subruns.store.root / TRIALS_FILE).write_text(json.dumps([asdict(r) for r in ordered], indent=2))
    if not succeeded(ordered):
        raise SweepFailedError(_all_failed_message(ordered, subruns.store.root / TRIALS_DIR))
    return ordered


def _committed_reason(result: TrialResult, store: Store, committed_as: Path) -> TrialResult:
    """`result` with the paths into `store`'s root in its reason (a job's log) named where they will be once
    the stage commits (`run_sweep`'s `committed_as`), its failure record too."""
    root = store.root.resolve()
    if not result.reason or str(root) not in result.reason:
        return result
    moved = replace(result, reason=result.reason.replace(str(root), str(committed_as.resolve())))
    if moved.status not in FINAL_STATUSES and store.failure(TRIALS_DIR, moved.name) is not None:
        store.record_failure(TRIALS_DIR, moved.name, failure_record(moved))
    return moved


def record_trial(recorder: StageRecorder, trial: TrialResult, log_every: int) -> None:
    """The trial's status, reason and loss curve (at the training loop's logging cadence and its last
    step: a few calls per trial) on its child run; its final numbers come with its commit."""
    tags = {"kiln.trial.status": trial.status, "kiln.trial.kind": trial.kind}
    if trial.reason:
        tags["kiln.trial.reason"] = trial.reason[:REASON_TAG_CHARS]  # MLflow caps tags; the manifest has it all
    recorder.tracker.set_tags(recorder.run_id, tags)
    curve = trial.loss_curve
    for step, loss in curve:
        if step % log_every == 0 or step == curve[-1][0]:
            recorder.metrics(step, {"train.loss": loss})


def _all_failed_message(results: list[TrialResult], trials_dir: Path) -> str:
    counts = Counter(r.status for r in results)
    reasons = Counter((r.reason or "").split("\n")[0][:300] for r in results)
    listed = "; ".join(f"{n}x {reason}" for reason, n in reasons.most_common(3))
    return (f"every sweep trial failed ({', '.join(f'{n} {s}' for s, n in sorted(counts.items()))}), "
            f"so there is nothing to fit. Most common reasons: {listed}. Each trial's run is in "
            f"{trials_dir}/<trial name>/ (a failed one's in {trials_dir}/.<trial name>.partial/); {failure_advice(results)}")


def failure_advice(results: Sequence[TrialResult]) -> str:
    """What to do about failed trials, by how they failed: a diverged trial's loss blew up (its settings'
    fault), a failed one never returned a result (its process or job died: the machines' fault)."""
    diverged = sum(r.status == "diverged" for r in results)
    failed = sum(r.status == "failed" for r in results)
    advice = []
    if diverged:
        advice.append(f"{diverged} diverged: a diverging sweep wants a smaller sweep.lr (or more sweep.optim.warmup_steps)")
    if failed:
        advice.append(f"{failed} failed without a result (the process or job died: infrastructure, not divergence; "
                      "its log is named in its reason): fix what broke, then rerun, which resumes them")
    return "; ".join(advice) + "."


def _result_from_json(row: dict) -> TrialResult:
    row = {**row, "loss_curve": [(int(s), float(v)) for s, v in row.get("loss_curve", [])]}
    return TrialResult(**row)


def load_trials(path: Path) -> list[TrialResult]:
    """Every trial in `trials.json`, failed ones included (see `succeeded`)."""
    return [_result_from_json(row) for row in json.loads(path.read_text())]
