"""Research: does a change to the model or its objective help, and does the gain hold as the model grows?

A study (`research` config section) compares named variants (`variants: {name: {key: value}}`:
overrides of `model.*` and `optim.*`) with the baseline (the config's model: `train.model`'s
architecture options when it names a model, on the sweep's proxy family's depth, head size and
context) at several proxy sizes (`scales`, by default one per sweep IsoFLOP budget at its middle
width), each with several seeds. Every (variant, scale, seed) is a sweep trial of the variant's
proxy family (`tasks.scaling.sweep.run_trials`): a sub-run of the ledger, launched through
`cluster.launcher` by the sweep's launchers (`tasks.scaling.trial_runs`), resumed and reused like
a trial. Sub-runs are keyed by their content (model, optimizer, run, learning rate, data) and
stored in the store itself (`research_runs/<key>`), so a study that adds a variant reuses the
baseline's runs, and a null variant shares the baseline's.

**Budgets are matched by tokens.** At a scale, every variant trains the baseline's token count
(C / (6 N_baseline)) with the same batch, context, seed and therefore the same data in the same
order: the seed pairs the runs, and the paired difference is the variant's effect alone. Matching
FLOPs instead would give a variant that costs more per token fewer steps, so different data and a
different schedule, and the pairing would be lost. What a variant costs per token is reported
beside its effect (`train_tokens_per_s_ratio`, parameters), and its loss is plotted against its
own compute.

**Learning rate.** With `lr_sweep` (multipliers of the sweep's LR at that width), seed 0 trains at
every multiplier and the best one per (variant, scale) is the LR of the other seeds; the baseline is
tuned the same way. Without it, every variant uses the baseline's LR and the report warns.

The decision (`tasks.scaling.research_decision`) is written to `decision.json`, `report.md` and two
plots in the stage's folder; costs are priced from the config (parameters, KV-cache bytes per token
at max_seq_len) and measured (training tokens/s from the runs, decode tokens/s by greedy decoding).
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, ValidationError, model_validator

from kiln.tasks.configbase import Section, runtime_field
from kiln.tasks.errors import ConfigError
from kiln.tasks.ledger import SubRun, SubRuns, keyed_subrun
from kiln.tasks.scaling.research_decision import ScaleRuns, decide, noise_floor, paired_interval
from kiln.tasks.scaling.sweep import (
    IsoFlopBudget,
    MixtureDesign,
    SweepConfig,
    Trial,
    TrialLauncher,
    TrialResult,
    normalised,
    params_at_width,
    run_trials,
    steps_for,
)
from kiln.tasks.train.config import ModelConfig, OptimConfig, revalidated

BASELINE = "baseline"
RUNS_KIND = "research_runs"  # in the store itself: keyed by content, shared by every study that declares them
DECISION_FILE, REPORT_FILE, RUNS_FILE = "decision.json", "report.md", "runs.json"
LOSS_PLOT, GAP_PLOT = "loss_vs_compute.png", "gap_vs_compute.png"
SHAPE_FIELDS = ("d_model", "n_layers", "n_heads", "n_kv_heads", "max_seq_len")  # the proxy family's, not the baseline's
SCALE_FIELDS = ("d_model", "n_heads")  # set by each scale: a variant cannot override them
VARIANT_SECTIONS: dict[str, type[Section]] = {"model": ModelConfig, "optim": OptimConfig}
KV_BYTES_PER_VALUE = 2  # the KV cache in bf16, as inference servers keep it
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*$")


class ResearchScale(Section):
    """One proxy size: the width and the compute the baseline trains at it (its tokens: C / (6 N))."""

    width: int = Field(gt=0, description="d_model of the proxy (a multiple of the proxy family's head size)")
    flops: float = Field(gt=0, description="the baseline's training compute 6·N·D at this width")


class ResearchConfig(Section):
    """A study of model and objective variants against the baseline, across proxy sizes and seeds."""

    variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="name -> overrides of model.* and optim.* (dotted keys, e.g. "
        "model.norm: layernorm); model.d_model and model.n_heads are the scales', optim.lr the LR sweep's")
    scales: list[ResearchScale] = Field(
        default_factory=list, description="at least 3 proxy sizes, ascending compute ([]: one per sweep.isoflop "
        "budget at its middle width, doubled budgets added to reach 3)")
    seeds: int = Field(3, ge=2, description="seeds per (variant, scale): the pairs of the paired difference")
    lr_sweep: list[float] = Field(
        default_factory=list, description="LR multipliers tried at seed 0 per (variant, scale), the best one used "
        "for the other seeds ([]: every variant at the baseline's LR; the report warns)")
    alpha: float = Field(0.05, gt=0, lt=1, description="the test level, after Holm's correction across variants")
    production_flops: float | None = Field(
        None, gt=0, description="the compute the gap is extrapolated to (null: fit.budget_flops, else train.model "
        "trained on train.run's tokens)")
    decode_tokens: int = runtime_field(32, gt=0, description="tokens generated to measure decode tokens/s")
    max_parallel: int = runtime_field(
        2, gt=0, description="runs at once: processes with cluster.launcher=local, else jobs through cluster.launcher")

    @model_validator(mode="after")
    def _check(self) -> ResearchConfig:
        for name, overrides in self.variants.items():
            where = f"research.variants.{name}"
            if name == BASELINE or not NAME.match(name):
                raise ValueError(f"{where}: a variant's name is letters, digits and _ (not '{BASELINE}', the "
                                 "config's own model)")
            for key in overrides:
                section, _, field = key.partition(".")
                if section not in VARIANT_SECTIONS or field not in VARIANT_SECTIONS[section].model_fields:
                    raise ValueError(f"{where}.{key}: a variant overrides model.<field> or optim.<field> of "
                                     f"{', '.join(VARIANT_SECTIONS)} (e.g. model.norm, optim.z_loss)")
                if (section == "model" and field in SCALE_FIELDS) or key == "optim.lr":
                    raise ValueError(f"{where}.{key}: set by the study (the scales' widths, the LR sweep), not by "
                                     "a variant")
        if self.scales:
            flops = [s.flops for s in self.scales]
            if len(flops) < 3 or flops != sorted(set(flops)):
                raise ValueError(f"research.scales needs at least 3 distinct, ascending compute budgets, got {flops}")
        if any(m <= 0 for m in self.lr_sweep):
            raise ValueError(f"research.lr_sweep multipliers must be positive, got {self.lr_sweep}")
        return self

    @property
    def multipliers(self) -> list[float]:
        return sorted(set(self.lr_sweep) | {1.0}) if self.lr_sweep else [1.0]


@dataclass(frozen=True)
class Study:
    """A study resolved against the rest of the config (by the research stage)."""

    cfg: ResearchConfig
    sweep: SweepConfig
    baseline: ModelConfig  # the proxy family with the config's model's architecture options
    scales: list[ResearchScale]
    production_flops: float
    cost_model: ModelConfig  # the baseline whose costs are priced: the production model when the config names it

    def variants(self) -> dict[str, dict[str, Any]]:
        return {BASELINE: {}, **self.cfg.variants}

    def family(self, name: str) -> tuple[ModelConfig, OptimConfig]:
        """The variant's proxy family and optimizer (the baseline's with its overrides), validated."""
        return apply_overrides(name, self.variants()[name], self.baseline, self.sweep.optim)

    def scale_name(self, scale: ResearchScale) -> str:
        return f"w{scale.width}-{scale.flops:.3g}"

    def proxy_config(self, name: str, seed: int) -> SweepConfig:
        """The variant's proxy family as a sweep config: what its runs train with (each a trial of it)."""
        model, optim = self.family(name)
        reference = self.sweep.reference
        return revalidated(self.sweep.model_copy(update={
            "model": model, "optim": optim, "run": self.sweep.run.model_copy(update={"seed": seed}),
            "mixtures": {reference: self.sweep.mixtures[reference]}, "batch_sizes": [], "lr_multipliers": [1.0],
            "mixture_design": MixtureDesign(num_samples=0),
            "isoflop": [IsoFlopBudget(flops=self.scales[-1].flops, widths=sorted({s.width for s in self.scales}))]}))


def apply_overrides(name: str, overrides: dict[str, Any], model: ModelConfig, optim: OptimConfig
                    ) -> tuple[ModelConfig, OptimConfig]:
    """`model` and `optim` with a variant's dotted overrides, validated (an error names the variant)."""
    updates: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        updates[section][field] = value
    try:
        return (ModelConfig.model_validate({**model.model_dump(), **updates["model"]}),
                # without lr: the study sets it per run (and a sweep config refuses a set optim.lr)
                OptimConfig.model_validate({**optim.model_dump(exclude={"lr"}), **updates["optim"]}))
    except ValidationError as error:
        raise ConfigError(f"research.variants.{name}: its overrides make an invalid config: {error}") from error


def default_scales(sweep: SweepConfig) -> list[ResearchScale]:
    """One scale per sweep IsoFLOP budget at its middle width; doubled budgets (at the last width) up to 3."""
    scales = [ResearchScale(width=sorted(b.widths)[len(b.widths) // 2], flops=b.flops) for b in sweep.isoflop]
    while len(scales) < 3:
        scales.append(ResearchScale(width=scales[-1].width, flops=scales[-1].flops * 2))
    return scales


def resolve_study(cfg: ResearchConfig, sweep: SweepConfig, config_model: ModelConfig | None,
                  production_flops: float | None) -> Study:
    """The study: `config_model` is the config's production model when it names one (else the sweep's
    proxy family is the baseline's architecture); `production_flops` the compute to extrapolate to."""
    options = {k: v for k, v in (config_model or sweep.model).model_dump().items() if k not in SHAPE_FIELDS}
    baseline = ModelConfig.model_validate({**sweep.model.model_dump(), **options})
    scales = cfg.scales or default_scales(sweep)
    bad = [s.width for s in scales if s.width % baseline.head_dim]
    if bad:
        raise ConfigError(f"research.scales widths {bad} are not multiples of the proxy head size {baseline.head_dim} "
                          "(sweep.model.d_model / sweep.model.n_heads)")
    flops = cfg.production_flops or production_flops
    if flops is None:
        raise ConfigError("research: no production compute to extrapolate the gap to: set research.production_flops, "
                          "fit.budget_flops, or train.model (with train.run's steps, batch and seq_len)")
    if flops <= scales[-1].flops:
        raise ConfigError(f"research: the production compute {flops:.3g} is not above the largest scale's "
                          f"{scales[-1].flops:.3g}; raise research.production_flops or lower research.scales")
    cost = config_model or baseline.model_copy(update={"d_model": scales[-1].width,
                                                       "n_heads": scales[-1].width // baseline.head_dim})
    study = Study(cfg, sweep, baseline, scales, flops, cost)
    for name in study.variants():  # every variant's family is a valid model before anything trains
        study.proxy_config(name, 0)
    return study


@dataclass(frozen=True)
class ResearchRun:
    """One (variant, scale, seed, LR multiplier): a trial of the variant's proxy family."""

    variant: str
    scale: str
    seed: int
    multiplier: float
    trial: Trial


def design_runs(study: Study, name: str, seed: int, vocab_size: int,
                multipliers: dict[str, float] | None = None) -> list[ResearchRun]:
    """The variant's runs at `seed`: every scale at each LR multiplier (`multipliers` None), or at its
    chosen one. Each scale trains the baseline's tokens there, so every variant sees the same data."""
    sweep, run = study.sweep, study.sweep.run
    reference = sweep.reference
    weights = normalised(sweep.mixtures[reference])
    runs = []
    for scale in study.scales:
        label = study.scale_name(scale)
        tokens = scale.flops / (6 * params_at_width(study.baseline, scale.width, vocab_size))
        steps = steps_for(tokens, run.batch_size, run.seq_len)
        chosen = study.cfg.multipliers if multipliers is None else [multipliers[label]]
        for m in chosen:
            lr = sweep.lr_at(scale.width) * m
            trial = Trial(f"{label}-lr{lr:.3g}", "isoflop", scale.width, lr, run.batch_size, steps, reference,
                          weights, scale.flops)
            runs.append(ResearchRun(name, label, seed, m, trial))
    return runs


def run_subrun(proxy: SweepConfig, run: ResearchRun, tokenize_key: str) -> SubRun:
    """The run as a ledger sub-run, keyed by what it trains (not the variant's name: an identical variant
    is the same run) and the tokenized data."""
    model, optim = proxy.model, proxy.optim.model_copy(update={"lr": run.trial.lr})
    identity = {"model": model.identity(), "optim": optim.identity(), "run": proxy.run.identity(),
                "trial": {k: v for k, v in asdict(run.trial).items() if k != "name"}}
    params = {"variant": run.variant, "scale": run.scale, "seed": run.seed, "lr": run.trial.lr,
              "width": run.trial.width, "steps": run.trial.steps, "lr_multiplier": run.multiplier}
    return keyed_subrun(RUNS_KIND, identity, {"tokenize": tokenize_key}, params=params)


def run_study(study: Study, shards: dict, shards_root: Path, subruns: SubRuns, tokenize_key: str, *,
              where: TrialLauncher, on_group: Callable[[str, int], None] | None = None
              ) -> list[tuple[ResearchRun, TrialResult]]:
    """Every run of the study, each a sub-run in `subruns` (complete ones reused), grouped by (variant,
    seed) through `where`: seed 0 first at every LR multiplier, then the other seeds at the best."""
    vocab = shards["vocab_size"]
    out: list[tuple[ResearchRun, TrialResult]] = []

    def group(name: str, seed: int, runs: list[ResearchRun]) -> None:
        proxy = study.proxy_config(name, seed)
        by_trial = {r.trial.name: r for r in runs}
        results: dict[str, TrialResult] = {}
        run_trials(proxy, shards, shards_root, subruns, [r.trial for r in runs], where=where,
                   label=f"{name}-seed{seed}", what=f"research {name} seed {seed}", results=results,
                   subrun_of=lambda trial: run_subrun(proxy, by_trial[trial.name], tokenize_key))
        out.extend((by_trial[n], results[n]) for n in by_trial)
        if on_group:
            on_group(name, seed)

    for name in study.variants():
        first = design_runs(study, name, 0, vocab)
        group(name, 0, first)
        best: dict[str, float] = {}
        for scale in {r.scale for r in first}:
            tried = [(res.val_loss, r.multiplier) for r, res in out if r.variant == name and r.scale == scale
                     and r.seed == 0 and res.ok]
            best[scale] = min(tried)[1] if tried else 1.0
        for seed in range(1, study.cfg.seeds):
            group(name, seed, design_runs(study, name, seed, vocab, best))
    return out


def chosen_runs(runs: list[tuple[ResearchRun, TrialResult]]) -> dict[tuple[str, str, int], TrialResult]:
    """(variant, scale, seed) -> the run the decision uses: at seeds > 0 the only one; at seed 0 the one
    at the multiplier the other seeds use."""
    multiplier = {(r.variant, r.scale): r.multiplier for r, _ in runs if r.seed > 0}
    return {(r.variant, r.scale, r.seed): res for r, res in runs
            if r.seed > 0 or multiplier.get((r.variant, r.scale), 1.0) == r.multiplier}


def kv_cache_bytes_per_token(model: ModelConfig) -> float:
    """KV-cache bytes per token of a sequence at max_seq_len: every layer keeps K and V (kv_dim each)
    for the tokens it attends to (a sliding-window layer only its window), in bf16."""
    t = model.max_seq_len
    kept = sum(min(model.window(layer) or t, t) for layer in range(model.n_layers))
    return 2 * model.kv_dim * kept * KV_BYTES_PER_VALUE / t


def measure_decode(model_cfg: ModelConfig, vocab_size: int, tokens: int, seed: int = 0) -> float:
    """Greedy decode tokens/s of a freshly initialised model, batch 1, one thread, through the model's
    inference path (each step a forward over the context so far, the last max_seq_len tokens)."""
    import torch  # defers torch

    from kiln.tasks.train.model import build_model  # defers torch

    torch.set_num_threads(1)
    model = build_model(model_cfg, vocab_size, seed=seed).eval()
    context = torch.zeros((1, 1), dtype=torch.long)
    with torch.no_grad():
        model(context)  # warm-up: the first call allocates
        started = time.perf_counter()
        for _ in range(tokens):
            logits = model(context[:, -model_cfg.max_seq_len:])
            context = torch.cat([context, logits[:, -1:].argmax(-1)], dim=1)
        return tokens / (time.perf_counter() - started)


def variant_costs(study: Study, name: str, vocab_size: int, runs: dict[tuple[str, str, int], TrialResult]
                  ) -> dict[str, float]:
    """What the variant costs: training tokens/s relative to the baseline (over their runs), parameters,
    KV-cache bytes per token at max_seq_len and decode tokens/s, these three of the cost model."""
    from kiln.tasks.train.model import count_parameters  # defers torch

    def tokens_per_s(variant: str) -> float:
        done = [r for (v, _, _), r in runs.items() if v == variant and r.ok and r.wall_s > 0]
        return sum(r.tokens_seen for r in done) / sum(r.wall_s for r in done) if done else float("nan")

    model, _ = apply_overrides(name, study.variants()[name], study.cost_model, study.sweep.optim)
    return {"train_tokens_per_s": tokens_per_s(name),
            "train_tokens_per_s_ratio": tokens_per_s(name) / tokens_per_s(BASELINE),
            "parameters": count_parameters(model, vocab_size),
            "kv_cache_bytes_per_token": kv_cache_bytes_per_token(model),
            "decode_tokens_per_s": measure_decode(model, vocab_size, study.cfg.decode_tokens)}


def bytes_per_token_by_domain(shards: dict, shards_root: Path, tokenizer_file: Path) -> dict[str, float]:
    """UTF-8 bytes per token of each domain's validation split (the text its loss is measured on), by
    decoding its shards with the tokenizer (byte-level BPE: the decoded bytes are the text's; EOS adds
    none). Each domain's bits per byte divides by its own: code and other languages fit a different
    number of bytes in a token than prose, so one corpus-wide ratio would misstate them."""
    from tokenizers import Tokenizer  # defers tokenizers

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    out: dict[str, float] = {}
    for domain, splits in shards["domains"].items():
        num_bytes = num_tokens = 0
        for shard in splits["val"]["shards"]:
            ids = np.fromfile(shards_root / shard["path"], dtype=shards["dtype"])
            num_bytes += len(tokenizer.decode(ids.tolist(), skip_special_tokens=True).encode("utf-8"))
            num_tokens += len(ids)
        if num_tokens:
            out[domain] = num_bytes / num_tokens
    return out


def decide_study(study: Study, runs: dict[tuple[str, str, int], TrialResult],
                 bytes_per_token: float | dict[str, float]) -> dict[str, Any]:
    """The decision document: the noise floor, and per variant its decision, effects and trend.
    `bytes_per_token` converts a domain's loss difference to bits per byte: one ratio, or one per
    domain (`bytes_per_token_by_domain`)."""
    scale_flops = {study.scale_name(s): s.flops for s in study.scales}
    seeds = range(study.cfg.seeds)

    def losses(variant: str, scale: str) -> dict[int, float]:
        return {k: runs[(variant, scale, k)].val_loss for k in seeds
                if (variant, scale, k) in runs and runs[(variant, scale, k)].ok}

    base = {s: losses(BASELINE, s) for s in scale_flops}
    floor = noise_floor(base)
    variants = {name: {s: ScaleRuns(c, losses(name, s), base[s]) for s, c in scale_flops.items()}
                for name in study.cfg.variants}
    decisions = decide(variants, study.production_flops, floor, study.cfg.alpha)
    out: dict[str, Any] = {}
    for name, decision in decisions.items():
        bpb: dict[str, dict[str, dict[str, float]]] = {}
        for scale in scale_flops:
            pairs = [(runs[(name, scale, k)], runs[(BASELINE, scale, k)]) for k in seeds
                     if (name, scale, k) in runs and (BASELINE, scale, k) in runs
                     and runs[(name, scale, k)].ok and runs[(BASELINE, scale, k)].ok]
            for domain in sorted(pairs[0][1].val_loss_by_domain) if len(pairs) >= 2 else []:
                ratio = bytes_per_token[domain] if isinstance(bytes_per_token, dict) else bytes_per_token
                diffs = [(v.val_loss_by_domain[domain] - b.val_loss_by_domain[domain]) / (math.log(2) * ratio)
                         for v, b in pairs]
                bpb.setdefault(domain, {})[scale] = asdict(paired_interval(diffs, study.cfg.alpha))
        diverged = sum(1 for (v, _, _), r in runs.items() if v == name and not r.ok)
        out[name] = {**decision.as_json(), "overrides": study.cfg.variants[name], "bpb_effect_by_scale": bpb,
                     "runs_not_ok": diverged}
    return {"noise_floor": floor, "alpha": study.cfg.alpha, "production_flops": study.production_flops,
            "scales": {s: {"flops": c} for s, c in scale_flops.items()}, "seeds": study.cfg.seeds,
            "budget_matched_by": "tokens", "lr_sweep": study.cfg.lr_sweep,
            "bytes_per_token": bytes_per_token, "variants": out}


def decision_table(decision: dict[str, Any]) -> str:
    """The decision as a markdown table: one row per variant."""
    scales = list(decision["scales"])
    head = (["variant", "decision"] + [f"Δloss {s}" for s in scales]
            + ["Δloss at production", "p (Holm)", "crossover", "train tok/s ×", "params", "KV B/token", "decode tok/s"])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in decision["variants"].items():
        cells = [name, f"**{v['decision']}**"]
        for s in scales:
            e = v["effect_by_scale"].get(s)
            cells.append(f"{e['mean']:+.4f} [{e['ci_low']:+.4f}, {e['ci_high']:+.4f}]" if e else "n/a")
        x = v["extrapolated"]
        cells += [f"{x['mean']:+.4f} [{x['ci_low']:+.4f}, {x['ci_high']:+.4f}]", f"{v['p_holm']:.3g}",
                  "yes" if v["crossover"] else "no", f"{v['train_tokens_per_s_ratio']:.2f}",
                  f"{v['parameters']:,}", f"{v['kv_cache_bytes_per_token']:,.0f}", f"{v['decode_tokens_per_s']:.0f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_report(study: Study, decision: dict[str, Any], folder: Path, wall_s: float) -> None:
    """report.md: the table, the rule's inputs (noise floor, budgets, LR) and each variant's reasons."""
    lines = [f"# Research: {len(study.cfg.variants)} variant(s) against the baseline", "",
             decision_table(decision), "",
             f"- Scales: {', '.join(decision['scales'])} (width-compute), {study.cfg.seeds} seeds each; production "
             f"compute {study.production_flops:.3g} FLOPs. Δloss = variant − baseline (final validation loss, nats; "
             "negative is better), mean over seeds with its "
             f"{100 * (1 - study.cfg.alpha):.0f}% t interval.",
             f"- Noise floor (the baseline's seed-to-seed spread of the final loss): {decision['noise_floor']:.4f}.",
             "- Budgets are matched by tokens: every variant trains the baseline's tokens at each scale, on the same "
             "data in the same order per seed (a FLOPs match would change its steps, data and schedule).",
             f"- Costs priced on the model with d_model={study.cost_model.d_model}, n_layers={study.cost_model.n_layers}, "
             f"max_seq_len={study.cost_model.max_seq_len}; training tokens/s from the runs.",
             f"- Took {wall_s:.0f} s.", ""]
    if not study.cfg.lr_sweep:
        lines += ["> **Warning: no LR sweep** (`research.lr_sweep` is empty): every variant trained at the "
                  "baseline's learning rate; a variant that moves the best LR is judged at the wrong one.", ""]
    for name, v in decision["variants"].items():
        lines.append(f"## {name}: {v['decision']}")
        lines.append("")
        lines.append(f"Overrides: `{json.dumps(study.cfg.variants[name])}`. "
                     + ("; ".join(v["reasons"]) or "every condition of its decision holds") + ".")
        if v["runs_not_ok"]:
            lines.append(f"{v['runs_not_ok']} of its runs diverged or failed (left out of the pairs).")
        for domain, scales in v["bpb_effect_by_scale"].items():
            cells = ", ".join(f"{s}: {e['mean']:+.4f} [{e['ci_low']:+.4f}, {e['ci_high']:+.4f}]" for s, e in scales.items())
            lines.append(f"- Δbpb {domain}: {cells}")
        lines.append("")
    lines += [f"![loss vs compute]({LOSS_PLOT})", "", f"![gap vs compute]({GAP_PLOT})", ""]
    (folder / REPORT_FILE).write_text("\n".join(lines))


def promoted_config(config_path: Path, decision_file: Path, name: str, key: str, train_model_named: bool) -> Path:
    """Write the production config with variant `name` applied, beside `config_path`: it extends that
    config and sets the variant's overrides on the proxy family (sweep.model, sweep.optim), the
    validate model and the production run (train.model when the config names one, train.optim), with
    train.promoted_from naming the decision. Refused unless the decision for `name` is `promote`."""
    import yaml  # defers pyyaml

    decision = json.loads(decision_file.read_text())["variants"]
    if name not in decision:
        raise ConfigError(f"--promote {name}: no such variant in {decision_file}; variants: {', '.join(decision)}")
    if decision[name]["decision"] != "promote":
        raise ConfigError(f"--promote {name}: its decision is {decision[name]['decision']} "
                          f"({'; '.join(decision[name]['reasons'])}); only a promoted variant is written "
                          "as a production config")
    overrides = decision[name]["overrides"]
    model = {k.partition(".")[2]: v for k, v in overrides.items() if k.startswith("model.")}
    optim = {k.partition(".")[2]: v for k, v in overrides.items() if k.startswith("optim.")}
    tree: dict[str, Any] = {"extends": str(config_path.resolve())}
    if model or optim:
        tree["sweep"] = {**({"model": model} if model else {}), **({"optim": optim} if optim else {})}
    if model:
        tree["validate"] = {"model": model}
    tree["train"] = {**({"model": model} if model and train_model_named else {}),
                     **({"optim": optim} if optim else {}), "promoted_from": f"research/{key}:{name}"}
    out = config_path.resolve().with_name(f"{config_path.stem}.promoted-{name}.yaml")
    out.write_text(f"# Written by `kiln research {config_path} --promote {name}` from the decision in {decision_file}\n"
                   + yaml.safe_dump(tree, sort_keys=False))
    return out

