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

A trial's failure is data, not the sweep's end: a trial that diverges (`TrainingDivergedError`)
or raises is recorded with its status, reason and the steps it reached, and the fit leaves it
out. Each trial's result is written to `trials/<name>.json` the moment it finishes, so an
interrupted sweep (the stage is resumable) reruns only the trials without one; the second phase
is designed again from the first phase's kept results, so it comes out the same. Diverged
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

import numpy as np
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from tasks.configbase import Reference, Section, runtime_field
from tasks.errors import ConfigError, KilnError
from tasks.progress import Progress
from tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig

if TYPE_CHECKING:  # torch-backed: imported where trials run, so that the config tree stays light
    from tasks.train.data_loader import Mixture

TRIALS_FILE = "trials.json"  # every trial in design order: the fit's input
TRIALS_DIR = "trials"  # trials/<name>/: a trial's training run; trials/<name>.json: its result, once finished
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
    num_workers: int = runtime_field(2)

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
    from tasks.train.model import count_parameters

    return count_parameters(model_at_width(base, width), vocab_size)


def normalised(weights: dict[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    return {d: w / total for d, w in sorted(weights.items())}


def _name(width: int, lr: float, batch: int, steps: int, mixture: str) -> str:
    return f"w{width}-lr{lr:.3g}-bs{batch}-s{steps}-{mixture}"


def steps_for(tokens: float, batch_size: int, seq_len: int) -> int:
    return max(1, round(tokens / (batch_size * seq_len)))


def sampled_mixtures(cfg: SweepConfig) -> dict[str, dict[str, float]]:
    """The Dirichlet samples around the reference mixture (its zero-weight domains stay at zero)."""
    design = cfg.mixture_design
    reference = normalised(cfg.mixtures[cfg.reference])
    domains = [d for d, w in reference.items() if w > 0]
    if design.num_samples and len(domains) < 2:
        raise ConfigError(f"sweep.mixture_design samples mixtures of the reference '{cfg.reference}', which has "
                          f"{len(domains)} domain with weight; give it at least 2 (or num_samples: 0)")
    rng = np.random.default_rng(design.seed)
    alpha = np.array([reference[d] for d in domains]) * design.concentration
    return {f"{SAMPLED_PREFIX}{i:02d}": dict(zip(domains, map(float, rng.dirichlet(alpha)), strict=True))
            for i in range(design.num_samples)}


def design_trials(cfg: SweepConfig, vocab_size: int) -> list[Trial]:
    """The first phase: the IsoFLOP grid, then the named and sampled mixtures."""
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
    mixtures = {**{n: normalised(w) for n, w in cfg.mixtures.items()}, **sampled_mixtures(cfg)}
    for name, weights in mixtures.items():
        trial = Trial(_name(width, lr, batch, steps, name), "mixture", width, lr, batch, steps, name, weights)
        if trial.name not in {t.name for t in trials}:  # the reference may already be an IsoFLOP trial
            trials.append(trial)
    return trials


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

    from tasks.train.callbacks import TrainerHandle
    from tasks.train.health import TrainingDivergedError
    from tasks.train.loop import train_model
    from tasks.train.model import count_parameters

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
                         status="failed", reason="its worker process died (killed, e.g. out of memory, or crashed)",
                         kind=trial.kind, budget=trial.budget, weights=trial.weights,
                         tokens=trial.steps * trial.batch_size * cfg.run.seq_len)
    save_trial(result, trials_dir)
    return result


def _cost(cfg: SweepConfig, trial: Trial) -> float:
    """A trial's rough CPU cost, to start the longest first (the pool then ends evenly)."""
    return trial.steps * trial.batch_size * (trial.width + 64)


def run_sweep(cfg: SweepConfig, shards: dict, shards_root: Path, out_dir: Path,
              on_trial: Callable[[TrialResult, bool], None] | None = None,
              trial_fn: TrialFn = run_trial) -> list[TrialResult]:
    """Run both phases, each trial without a kept result in `out_dir/trials/` (in `num_workers`
    processes); write `trials.json`; return results in design order.

    `on_trial(result, resumed)` is called once per trial: for results a previous attempt left
    (resumed=True) and for each trial as it finishes. Raises `SweepFailedError` when no trial
    succeeded."""
    from tasks.train.data_loader import mixture_with_weights

    trials_dir = out_dir / TRIALS_DIR
    trials_dir.mkdir(parents=True, exist_ok=True)
    for torn in trials_dir.glob("*.json.tmp"):  # a result being written when the last attempt died
        torn.unlink()
    results: dict[str, TrialResult] = {}
    mixtures: dict[str, Mixture] = {}

    def mixture_of(trial: Trial) -> Mixture:
        if trial.mixture not in mixtures:
            mixtures[trial.mixture] = mixture_with_weights(shards, shards_root, trial.weights,
                                                           f"sweep.mixtures.{trial.mixture}")
        return mixtures[trial.mixture]

    def run_phase(trials: list[Trial], what: str) -> None:
        if not trials:
            return
        for trial in trials:
            if trial.name not in results and (kept := load_finished(trials_dir, trial)) is not None:
                results[trial.name] = kept
                if on_trial:
                    on_trial(kept, True)
        pending = sorted((t for t in trials if t.name not in results), key=lambda t: -_cost(cfg, t))
        progress = Progress(what, len(trials), "trials", done=len(trials) - len(pending))

        def finished(result: TrialResult) -> None:
            results[result.name] = result
            bad = sum(r.status != "ok" for r in results.values())
            progress.advance(note=f"{bad} failed or diverged" if bad else "")
            if on_trial:
                on_trial(result, False)

        with progress:
            if cfg.num_workers <= 1:
                for trial in pending:
                    finished(_run_and_save(trial_fn, cfg, trial, mixture_of(trial), trials_dir))
            else:
                broken = _run_in_pool(pending, cfg.num_workers, trial_fn, cfg, mixture_of, trials_dir, finished)
                _run_isolated(broken, trial_fn, cfg, mixture_of, trials_dir, finished)

    first = design_trials(cfg, shards["vocab_size"])
    run_phase(first, "sweep (IsoFLOP and mixture trials)")
    second = design_hyper_trials(cfg, [results[t.name] for t in first])
    run_phase(second, "sweep (LR x batch trials)")
    ordered = [results[t.name] for t in first + second]
    (out_dir / TRIALS_FILE).write_text(json.dumps([asdict(r) for r in ordered], indent=2))
    if not succeeded(ordered):
        raise SweepFailedError(_all_failed_message(ordered, trials_dir))
    return ordered


def _run_in_pool(trials: list[Trial], num_workers: int, trial_fn: TrialFn, cfg: SweepConfig,
                 mixture_of: Callable[[Trial], Mixture], trials_dir: Path,
                 finished: Callable[[TrialResult], None]) -> list[Trial]:
    """Run `trials` in a pool of spawned processes; return those left unfinished by a dead worker."""
    if not trials:
        return []
    pool = ProcessPoolExecutor(min(num_workers, len(trials)), mp_context=get_context("spawn"))
    futures: dict[Future, Trial] = {
        pool.submit(_run_and_save, trial_fn, cfg, t, mixture_of(t), trials_dir): t for t in trials}
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


def _run_isolated(trials: list[Trial], trial_fn: TrialFn, cfg: SweepConfig, mixture_of: Callable[[Trial], Mixture],
                  trials_dir: Path, finished: Callable[[TrialResult], None]) -> None:
    """Run trials one at a time in a one-process pool. A dead worker took a pool down with every trial
    in it, unfinished; alone, a trial that kills its worker again is the one named and recorded."""
    pool: ProcessPoolExecutor | None = None
    try:
        for trial in trials:
            pool = pool or ProcessPoolExecutor(1, mp_context=get_context("spawn"))
            try:
                result = pool.submit(_run_and_save, trial_fn, cfg, trial, mixture_of(trial), trials_dir).result()
            except BrokenProcessPool:
                pool.shutdown(wait=True)
                pool = None
                result = _worker_died(cfg, trial, mixture_of(trial).vocab_size, trials_dir)
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
            f"{trials_dir}/<trial name>/; a diverging sweep wants a smaller sweep.lr (or sweep.optim.warmup_steps).")


def _result_from_json(row: dict) -> TrialResult:
    row = {**row, "loss_curve": [(int(s), float(v)) for s, v in row.get("loss_curve", [])]}
    return TrialResult(**row)


def load_trials(path: Path) -> list[TrialResult]:
    """Every trial in `trials.json`, failed ones included (see `succeeded`)."""
    return [_result_from_json(row) for row in json.loads(path.read_text())]
