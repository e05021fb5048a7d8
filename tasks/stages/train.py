"""Stage `train`: production training, in this process or under torchrun (FSDP2/DDP/TP/PP/CP, DCP
checkpoints, resume, loss-spike rollback, relaunch of a failed job).

It starts only behind a passed validation gate, unless `train.gate_override` says why not (the
reason is recorded in the manifest and as an MLflow tag). With `train.model: plan` (the default) it
trains the fit's production run: the data-feasible shape, steps, batch and context; every setting
that differs from the plan is recorded as a departure. It records the law's prediction for what it
trains (on the effective tokens it sees, with its interval) and says in its headline whether it
landed inside; and it sets its validation loss beside validate's, saying why in words when the
production model is not the better one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PositiveFloat,
    SerializerFunctionWrapHandler,
    StringConstraints,
    model_serializer,
    model_validator,
)

from kiln.tasks.configbase import Reference, Section, added_field, runtime_field
from kiln.tasks.constants import SHARDS_FILE
from kiln.tasks.errors import ConfigError
from kiln.tasks.scaling.fit import PLAN_FILE, loss_law_from_dict
from kiln.tasks.scaling.plan import DataBudget, predicted
from kiln.tasks.scaling.validate import REPORT_FILE as GATE_FILE
from kiln.tasks.scaling.validate import ValidationGateError
from kiln.tasks.stage import STATS_FILE, Stage, StageContext
from kiln.tasks.stages._training import (
    kept_train_steps,
    plan_mixture,
    planned_lr,
    run_training,
    train_headline,
    train_stats,
)
from kiln.tasks.train.checkpoint import checkpoint_dir
from kiln.tasks.train.config import (
    DataPhase,
    ModelConfig,
    OptimConfig,
    ParallelDims,
    TrainRunConfig,
    check_phases,
    check_phases_fit,
)

PLANNED_RUN_FIELDS = {"steps", "batch_size", "seq_len"}  # under `model: plan`, the plan's unless train.run sets them


class Branch(Section):
    """An adjustment: go on from step `from_step` of the train run of key `prefix` (its kept checkpoint:
    weights, optimizer, curves), training only the steps after it under this config's schedule. The
    run's key hashes the prefix's key, the step and everything this config sets: `kiln adjust` writes it."""

    prefix: str = Field(pattern=r"^[0-9a-f]+$", description="the train key of the run this one continues")
    from_step: int = Field(gt=0, description="the prefix run's kept checkpoint this run goes on from")


class TrainConfig(Section):
    """The production run.

    `lr: plan` (the default) takes the fit stage's learning rate; a number overrides it. `optim.lr`
    is therefore not a setting here (the key hashes `lr`, never an unused `optim.lr`). `model: plan`
    (the default) takes the plan's production shape (the data-feasible run for `fit.budget_flops`),
    and with it the plan's steps, batch and context unless `run` sets them: what it sets stays,
    recorded as a departure from the plan. `parallel` is
    the layout (dp x tp x pp x cp), or `auto` for the planner's choice on `cluster`; like
    `run.grad_accum` it is runtime: the global batch (`run.batch_size`) is what the key holds, so a
    run stopped under one layout resumes under another. Above one process (or with a `torchrun`,
    `slurm` or `kubernetes` launcher) the stage runs through `cluster.launcher`.

    `phases` is the data schedule (`DataPhase`: each phase's bound, mixture, order and sequence
    length; see `tasks.train.data_schedule`); none: the mix stage's mixture for every step.
    """

    model: ModelConfig | Literal["plan"] = "plan"
    optim: OptimConfig = OptimConfig()
    run: TrainRunConfig = TrainRunConfig()
    parallel: ParallelDims | Literal["auto"] = runtime_field(ParallelDims())
    lr: Literal["plan"] | PositiveFloat = "plan"
    promoted_from: str | None = added_field(
        None, description="the research decision this config was promoted from (research/<key>:<variant>), written "
        "by `kiln research CONFIG --promote NAME`; `kiln lineage` names it")
    gate_override: str | None = runtime_field(
        None, description="start although the validation gate failed; the reason you give is recorded")
    phases: list[DataPhase] = added_field([], description="the data schedule: phases of mixture, order and "
                                                          "sequence length; none: the mix stage's mixture throughout")
    branch: Branch | None = added_field(None, description="go on from another train run's checkpoint (an "
                                                          "adjustment, see `kiln adjust`); None: train from step 0")
    batches: list[Annotated[str, StringConstraints(pattern=r"^[0-9a-f]+$")]] = added_field(
        [], description="keys of new data batches (the batch stage's, decontaminated and tokenized) whose documents "
                        "join their domains from this run's first step: set it in an adjustment (`kiln adjust CONFIG "
                        "--from-step N train.batches=[KEY]`) and they join after step N")

    @model_validator(mode="after")
    def _phases_cover_the_run(self) -> TrainConfig:
        check_phases(self.phases)
        if self.model != "plan":
            check_phases_fit(self.phases, self.model)
        return self

    def names_used(self) -> list[Reference]:
        return super().names_used() + [Reference(f"phases.{i}.{ref.key}", ref.kind, ref.names, ref.keyed)
                                       for i, phase in enumerate(self.phases) for ref in phase.names_used()]

    @model_validator(mode="after")
    def _lr_lives_in_train_lr(self) -> TrainConfig:
        if "lr" in self.optim.model_fields_set:
            raise ValueError("train.optim.lr is not used: the learning rate is train.lr "
                             "('plan' for the fit stage's choice, or a number)")
        return self

    @model_serializer(mode="wrap")
    def _without_optim_lr(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Dumps (`kiln config`, logged params) leave out `optim.lr`, which this section refuses: what
        `kiln config` prints must load back as it is."""
        dumped = handler(self)
        dumped["optim"].pop("lr", None)
        return dumped

    @property
    def run_identity(self) -> dict:
        """`run`'s identity, each field the plan decides (`model: plan`, the field unset) as "plan", not as
        the field's default: setting a field to its default value departs from the plan, and moves keys."""
        identity = self.run.identity()
        if self.model == "plan":
            for name in PLANNED_RUN_FIELDS - self.run.model_fields_set:
                identity[name] = "plan"
        return identity

    def identity(self) -> dict:
        identity = super().identity()
        del identity["optim"]["lr"]
        identity["run"] = self.run_identity
        return identity


def check_gate_passed(ctx: StageContext) -> dict[str, Any]:
    """The validate stage's gate report; a ValidationGateError when it failed and nothing overrides it."""
    gate = ctx.read_json("validate", GATE_FILE)
    override = ctx.cfg.train.gate_override
    if gate["passed"]:
        return {"gate_passed": True}
    if not override:
        reasons = "\n".join(f"  - {r}" for r in gate["reasons"])
        raise ValidationGateError(
            f"production training refused: the validation gate failed\n{reasons}\n"
            f"(report: {ctx.inputs['validate'] / GATE_FILE}). Fix the plan (see the reasons), or start anyway "
            "with train.gate_override='<why>': the reason is recorded with the run")
    ctx.recorder.tracker.set_tags(ctx.recorder.run_id, {"kiln.gate_override": override[:1000]})
    return {"gate_passed": False, "gate_override": override}


def planned_run(ctx: StageContext) -> tuple[ModelConfig, TrainRunConfig, dict[str, Any]]:
    """The model and run budget this stage trains, and where they depart from the plan."""
    cfg = ctx.cfg.train
    plan = ctx.read_json("fit", PLAN_FILE)
    production = plan["runs"].get("production")
    run = cfg.run
    if cfg.model != "plan":
        model = with_longest_phase(cfg.model, run, cfg.phases)
        departures = {} if production is None else _departures(production, model, run)
        return model, run, departures
    if production is None:
        raise ConfigError("train.model: plan, but the fit could not plan a production run: "
                          f"{plan['refused'].get('production', 'no production run in the plan')}")
    if "seq_len" not in run.model_fields_set:  # the context the law was fitted at
        run = run.model_copy(update={"seq_len": production["seq_len"]})
    model = with_longest_phase(ModelConfig(**production["model"]), run, cfg.phases)
    # the plan's batch is in sequences of its own context: keep its tokens per step and in total
    batch = max(1, round(production["batch_size"] * production["seq_len"] / run.seq_len))
    updates = {}
    if "batch_size" not in run.model_fields_set:
        updates["batch_size"] = batch
    if "steps" not in run.model_fields_set:
        updates["steps"] = max(1, round(production["tokens"] / (updates.get("batch_size", run.batch_size) * run.seq_len)))
    run = run.model_copy(update=updates)
    return model, run, _departures(production, model, run)


def with_longest_phase(model: ModelConfig, run: TrainRunConfig, phases: list[DataPhase]) -> ModelConfig:
    """`model` built to hold the longest sequences the run trains: a data phase may train longer ones than
    `model.max_seq_len` (a long-context extension, x4 say), which raises it. A ConfigError when a phase
    changes rotary positions of a model without them, or would stretch learned positions."""
    try:
        check_phases_fit(phases, model)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    longest = max([run.seq_len] + [p.seq_len or 0 for p in phases])
    if longest <= model.max_seq_len:
        return model
    if model.position == "learned":
        raise ConfigError(f"train.phases train {longest}-token sequences, but model.max_seq_len={model.max_seq_len} "
                          "and model.position='learned' has no embedding past it: raise model.max_seq_len")
    return model.model_copy(update={"max_seq_len": longest})


def _departures(production: dict[str, Any], model: ModelConfig, run: TrainRunConfig) -> dict[str, Any]:
    """Each setting that differs from the plan: {setting: {"plan": ..., "config": ...}}."""
    planned_model = ModelConfig(**production["model"]).model_dump(exclude={"max_seq_len"})
    actual = model.model_dump(exclude={"max_seq_len"})
    out: dict[str, Any] = {f"model.{k}": {"plan": v, "config": actual[k]}
                           for k, v in planned_model.items() if actual[k] != v}
    tokens = run.steps * run.batch_size * run.seq_len
    if tokens != production["tokens"]:
        out["tokens"] = {"plan": production["tokens"], "config": tokens}
    if run.batch_size * run.seq_len != production["batch_size"] * production["seq_len"]:
        out["batch_tokens"] = {"plan": production["batch_size"] * production["seq_len"],
                               "config": run.batch_size * run.seq_len}
    return out


def run(ctx: StageContext) -> dict:
    cfg = ctx.cfg
    gate = check_gate_passed(ctx)
    lr = planned_lr(ctx)
    model, run_cfg, departures = planned_run(ctx)
    plan = ctx.read_json("fit", PLAN_FILE)
    if cfg.train.lr != "plan":
        departures["lr"] = {"plan": plan["lr"], "config": lr}
    (ctx.out_dir / "plan_departures.json").write_text(json.dumps(departures, indent=2))
    optim = cfg.train.optim.model_copy(update={"lr": lr})
    from kiln.tasks.train.data_schedule import scheduled_mixture, tokens_by_batch, with_batches  # defers torch

    batches = new_batches(ctx)
    mixture = with_batches(scheduled_mixture(plan_mixture(ctx), cfg.train.phases, run_cfg, ctx.out_dir), batches)
    branch = cfg.train.branch
    result = run_training(ctx, model, optim, run_cfg, mixture,
                          branch_from=None if branch is None else branch_checkpoint(ctx, branch, run_cfg.steps))
    restarts = sum(e["kind"] == "process_failure" for e in result.health_events)
    prediction = law_prediction(plan, model, run_cfg)
    stats = train_stats(result, device=run_cfg.device, lr=lr, world_size=result.world_size,
                        num_restarts=restarts, plan_departures=departures, **gate, **prediction)
    stats |= landed(stats)
    if branch is not None:
        stats["branch"] = branch.model_dump()
    if batches:  # the tokens each new batch gave in each phase (the loader's count)
        stats["batches"] = {b.name: {"key": key, "tokens_by_phase": tokens}
                            for b, key, tokens in zip(batches, cfg.train.batches,
                                                      tokens_by_batch(result.tokens_by_phase, [b.name for b in batches]).values())}
    return stats | against_validate(stats, ctx.read_json("validate", STATS_FILE), plan)


def new_batches(ctx: StageContext) -> list:
    """The `NewBatch` of each key of `train.batches`: a complete batch stage output, decontaminated and tokenized
    under this run's corpus (the same decontaminate and tokenize keys as the mix it trains on); a ConfigError
    naming the key otherwise. A batch is eligible only once the batch stage committed it, after its
    decontamination."""
    keys = ctx.cfg.train.batches
    if not keys:
        return []
    from kiln.tasks.train.data_schedule import NewBatch  # defers torch

    store = ctx.store
    tokenize = store.manifest("mix", ctx.inputs["mix"].name)["inputs"].get("tokenize")
    decontaminate = store.manifest("tokenize", tokenize)["inputs"].get("decontaminate") if tokenize else None
    out = []
    for i, key in enumerate(keys):
        where = f"train.batches[{i}]={key}"
        if not store.is_complete("batch", key):
            raise ConfigError(f"{where}: no complete batch of that key in {store.root}; a batch is eligible once the "
                              "batch stage has decontaminated and tokenized it (`kiln batch PATH --name NAME --domain DOMAIN "
                              "CONFIG` prints its key)")
        manifest = store.manifest("batch", key)
        made = (manifest["inputs"]["tokenize"], manifest["inputs"]["decontaminate"])
        if made != (tokenize, decontaminate):
            raise ConfigError(f"{where}: the batch was decontaminated by decontaminate {made[1]} and tokenized by "
                              f"tokenize {made[0]}, this run's corpus by decontaminate {decontaminate} and tokenize "
                              f"{tokenize}: run the batch stage again under this run's config")
        folder = store.path("batch", key) / "tokenize"
        shards = json.loads((folder / SHARDS_FILE).read_text())
        out.append(NewBatch(manifest["stats"]["name"], {
            domain: tuple(folder / shard["path"] for shard in splits["train"]["shards"])
            for domain, splits in shards["domains"].items() if splits["train"]["num_tokens"]}))
    return out


def branch_checkpoint(ctx: StageContext, branch: Branch, steps: int) -> Path:
    """The prefix run's checkpoint of `branch.from_step` (committed, or of a run still training); a
    ConfigError naming what exists when it is not there."""
    folder = ctx.store.live_path("train", branch.prefix)
    if folder is None:
        raise ConfigError(f"train.branch.prefix={branch.prefix}: no train run of that key in {ctx.store.root}; "
                          "give the key `kiln status` shows for the run to adjust")
    kept = kept_train_steps(folder)
    if branch.from_step not in kept:
        raise ConfigError(f"train.branch.from_step={branch.from_step}: the run {branch.prefix} kept checkpoints of "
                          f"steps {kept} (train.run.keep_every keeps more); choose one of them")
    if branch.from_step >= steps:
        raise ConfigError(f"train.branch.from_step={branch.from_step} leaves nothing to train: this run has "
                          f"{steps} steps; raise train.run.steps or branch earlier")
    return checkpoint_dir(folder / "checkpoints", branch.from_step)


def law_prediction(plan: dict[str, Any], model: ModelConfig, run: TrainRunConfig) -> dict[str, Any]:
    """What the fitted law predicts for this run's N and D, its tokens counted at their effective value
    D' on the plan's data (nothing when the fit refused the law).

    The law was fitted at the proxies' context length; a run with another `seq_len` sees another
    loss per token, so the number is a guide there, not a check (`prediction_comparable` says which)."""
    if not plan["loss_law"]:
        return {}
    from kiln.tasks.train.model import count_parameters  # defers torch

    law = loss_law_from_dict(plan["loss_law"])
    data = DataBudget(**{k: v for k, v in plan["data"].items() if k != "r_star"}) if plan.get("data") else None
    n, d = count_parameters(model, plan["family"]["vocab_size"]), run.steps * run.batch_size * run.seq_len
    prediction = predicted(law, n, d, data)
    out = {"predicted_val_loss": prediction["predicted_loss"], "predicted_interval": prediction["interval"],
           "prediction_level": prediction["level"], "prediction_seq_len": plan["family"]["seq_len"],
           "prediction_comparable": run.seq_len == plan["family"]["seq_len"]}
    if data is not None:
        out |= {"effective_tokens": prediction["effective_tokens"], "max_epochs": prediction["data"]["max_epochs"]}
    return out


def landed(stats: dict[str, Any]) -> dict[str, Any]:
    """Where the validation loss landed against the predicted interval: inside, above or below."""
    if "predicted_interval" not in stats:
        return {}
    low, high = stats["predicted_interval"]
    loss = stats["val_loss"]
    return {"landed": "inside" if low <= loss <= high else "above" if loss > high else "below"}


def against_validate(stats: dict[str, Any], validate: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    """The production model's validation loss beside the validate run's (the plan's mixture, a smaller
    model): production should be at most as high. When it is not, `why_not_below_validate` says why in
    words, from what differs between the two runs and what the law predicted for each."""
    out = {"validate_val_loss": validate["val_loss"], "at_most_validate": stats["val_loss"] <= validate["val_loss"]}
    if out["at_most_validate"]:
        return out
    reasons = []
    planned = plan["runs"].get("validate", {})
    train_compute = 6.0 * stats["num_params"] * stats["tokens_seen"]
    if planned.get("compute") and train_compute < planned["compute"]:
        reasons.append(f"it was trained on less compute ({train_compute:.3g} FLOPs) than the validate run "
                       f"({planned['compute']:.3g})")
    if stats["tokens_seen"] < validate["tokens_seen"]:
        reasons.append(f"it saw fewer tokens ({stats['tokens_seen']:,}) than the validate run ({validate['tokens_seen']:,})")
    if stats.get("max_epochs", 0) > 1:
        reasons.append(f"it repeated its data up to {stats['max_epochs']:.1f} times, so its {stats['tokens_seen']:,} "
                       f"tokens count as {stats['effective_tokens']:,.0f} effective ones")
    if stats["plan_departures"]:
        reasons.append("it departs from the plan in " + ", ".join(sorted(stats["plan_departures"])))
    if not stats.get("prediction_comparable", True):
        reasons.append(f"its context ({stats.get('prediction_seq_len')} tokens in the plan) differs from what it "
                       "trained at, so the two losses are per token of different contexts")
    predicted_train, predicted_validate = stats.get("predicted_val_loss"), planned.get("predicted_loss")
    if predicted_train is not None and predicted_validate is not None:
        if predicted_train > predicted_validate:
            reasons.append(f"the law itself predicted it worse ({predicted_train:.4f} against {predicted_validate:.4f})")
        else:
            reasons.append(f"the law predicted it better ({predicted_train:.4f} against {predicted_validate:.4f}) and it "
                           f"landed {stats.get('landed', 'away from its prediction')}: the law's extrapolation to "
                           "this size did not hold")
    if stats["num_rollbacks"]:
        reasons.append(f"it rolled back {stats['num_rollbacks']} times after loss spikes")
    out["why_not_below_validate"] = (f"the production model's validation loss {stats['val_loss']:.4f} is above the "
                                     f"validate run's {validate['val_loss']:.4f}: " + "; ".join(
                                         reasons or ["no difference between the runs explains it"]))
    return out


def headline(stats: dict[str, Any]) -> dict[str, Any]:
    out = train_headline(stats)
    if "predicted_interval" in stats:
        low, high = stats["predicted_interval"]
        out["predicted"] = f"{stats['predicted_val_loss']:.4f} [{low:.4f}, {high:.4f}]"
        out["landed"] = stats["landed"]
    out["vs_validate"] = (f"{'<=' if stats['at_most_validate'] else '>'} {stats['validate_val_loss']:.4f}")
    for name, batch in stats.get("batches", {}).items():  # the tokens each new batch gave, over its phases
        out[f"batch {name}"] = sum(batch["tokens_by_phase"].values())
    return out


# version 2: DCP checkpoints (version 1's torch.save checkpoints in a partial folder are not resumable)
# version 3: the key hashes train.lr instead of the unused train.optim.lr
# version 4: train.parallel no longer holds activation_checkpointing (train.run does)
# version 5: train.run.batch_size is the global batch; the layout and grad_accum left the key
# version 6: train.model may be `plan`; a failed validation gate stops it unless overridden
# version 7: `plan` (the default) takes the plan's context too; stats hold the prediction on effective tokens,
# where the loss landed against it, and the comparison with validate
STAGE = Stage(
    name="train", description="production training", body=run, inputs=("mix", "fit", "validate"),
    config=TrainConfig, version=7, resumable=True, headline=headline,
)
