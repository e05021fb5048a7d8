"""Stage `train`: production training, in this process or under torchrun (FSDP2/DDP/TP/PP/CP, DCP
checkpoints, resume, loss-spike rollback, relaunch of a failed job).

It starts only behind a passed validation gate, unless `train.gate_override` says why not (the
reason is recorded in the manifest and as an MLflow tag). With `train.model: plan` its shape comes
from the fit's compute-optimal plan; every setting that differs from the plan is recorded as a
departure.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import PositiveFloat, SerializerFunctionWrapHandler, model_serializer, model_validator

from tasks.configbase import Section, runtime_field
from tasks.errors import ConfigError
from tasks.scaling.fit import PLAN_FILE
from tasks.scaling.validate import REPORT_FILE as GATE_FILE
from tasks.scaling.validate import ValidationGateError
from tasks.stage import Stage, StageContext
from tasks.stages._training import plan_mixture, planned_lr, run_training, train_headline, train_stats
from tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig

TRAINED_MODEL_CONFIG = "model/model_config.json"  # the shape train trained, for the stages after it


class TrainConfig(Section):
    """The production run.

    `lr: plan` (the default) takes the fit stage's learning rate; a number overrides it. `optim.lr`
    is therefore not a setting here (the key hashes `lr`, never an unused `optim.lr`). `model: plan`
    takes the plan's compute-optimal shape (for `fit.budget_flops`), and with it the plan's steps
    and batch unless `run` sets them: what it sets stays, recorded as a departure from the plan. `parallel` is
    the layout (dp x tp x pp x cp), or `auto` for the planner's choice on `cluster`; like
    `run.grad_accum` it is runtime: the global batch (`run.batch_size`) is what the key holds, so a
    run stopped under one layout resumes under another. Above one process (or with a `torchrun`,
    `slurm` or `kubernetes` launcher) the stage runs through `cluster.launcher`.
    """

    model: ModelConfig | Literal["plan"] = ModelConfig()
    optim: OptimConfig = OptimConfig()
    run: TrainRunConfig = TrainRunConfig()
    parallel: ParallelDims | Literal["auto"] = runtime_field(ParallelDims())
    lr: Literal["plan"] | PositiveFloat = "plan"
    gate_override: str | None = runtime_field(
        None, description="start although the validation gate failed; the reason you give is recorded")

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

    def identity(self) -> dict:
        identity = super().identity()
        del identity["optim"]["lr"]
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
        departures = {} if production is None else _departures(production, cfg.model, run)
        return cfg.model, run, departures
    if production is None:
        raise ConfigError("train.model: plan, but the fit could not plan a production run: "
                          f"{plan['refused'].get('production', 'no production run in the plan')}")
    model = ModelConfig(**production["model"])
    model = model.model_copy(update={"max_seq_len": max(model.max_seq_len, run.seq_len)})
    # the plan's batch is in sequences of its own context: keep its tokens per step and in total
    batch = max(1, round(production["batch_size"] * production["seq_len"] / run.seq_len))
    updates = {}
    if "batch_size" not in run.model_fields_set:
        updates["batch_size"] = batch
    if "steps" not in run.model_fields_set:
        updates["steps"] = max(1, round(production["tokens"] / (updates.get("batch_size", run.batch_size) * run.seq_len)))
    run = run.model_copy(update=updates)
    return model, run, _departures(production, model, run)


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
    if cfg.train.lr != "plan":
        departures["lr"] = {"plan": ctx.read_json("fit", PLAN_FILE)["lr"], "config": lr}
    (ctx.out_dir / "plan_departures.json").write_text(json.dumps(departures, indent=2))
    optim = cfg.train.optim.model_copy(update={"lr": lr})
    result = run_training(ctx, model, optim, run_cfg, plan_mixture(ctx))
    restarts = sum(e["kind"] == "process_failure" for e in result.health_events)
    return train_stats(result, device=run_cfg.device, lr=lr, world_size=result.world_size,
                       num_restarts=restarts, plan_departures=departures, **gate,
                       **law_prediction(ctx.read_json("fit", PLAN_FILE), model, run_cfg))


def law_prediction(plan: dict[str, Any], model: ModelConfig, run: TrainRunConfig) -> dict[str, Any]:
    """What the fitted law predicts for this run's N and D (nothing when the fit refused the law).

    The law was fitted at the proxies' context length; a run with another `seq_len` sees another
    loss per token, so the number is a guide there, not a gate."""
    if not plan["loss_law"]:
        return {}
    from tasks.scaling.fit import loss_law_from_dict
    from tasks.train.model import count_parameters

    law = loss_law_from_dict(plan["loss_law"])
    n, d = count_parameters(model, plan["family"]["vocab_size"]), run.steps * run.batch_size * run.seq_len
    low, high = law.prediction_interval(n, d)
    return {"predicted_val_loss": float(law.predict(n, d)), "predicted_interval": [low, high],
            "prediction_seq_len": plan["family"]["seq_len"]}


def trained_model_config(ctx: StageContext) -> ModelConfig:
    """The shape the train stage trained (its config's, or the plan's under `train.model: plan`)."""
    return ModelConfig(**ctx.read_json("train", TRAINED_MODEL_CONFIG)["model"])


# version 2: DCP checkpoints (version 1's torch.save checkpoints in a partial folder are not resumable)
# version 3: the key hashes train.lr instead of the unused train.optim.lr
# version 4: train.parallel no longer holds activation_checkpointing (train.run does)
# version 5: train.run.batch_size is the global batch; the layout and grad_accum left the key
# version 6: train.model may be `plan`; a failed validation gate stops it unless overridden
STAGE = Stage(
    name="train", description="production training", body=run, inputs=("mix", "fit", "validate"),
    config=TrainConfig, version=6, resumable=True, headline=train_headline,
)
