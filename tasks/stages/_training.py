"""What the training stages (validate, train, anneal) share: the planned learning rate, the plan's
mixture, where training runs (this process or the configured launcher, in the resolved layout), and
how a `TrainResult` becomes stage stats."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.tasks.launch.cluster import launch_record
from kiln.tasks.scaling.fit import PLAN_FILE
from kiln.tasks.scaling.mix import MIXTURE_FILE
from kiln.tasks.stage import StageContext
from kiln.tasks.train.checkpoint import MARKER, checkpoint_dir, steps_on_disk

if TYPE_CHECKING:  # torch-backed: stage modules import training code in their bodies, so that the
    # config tree, keys and cached reruns never load torch
    from kiln.tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig
    from kiln.tasks.train.data_loader import Mixture
    from kiln.tasks.train.trainer import TrainResult

LAUNCHED_MIXTURE_FILE = "launched_mixture.json"  # what a launched job's workers read (paths relative to the store)


def planned_lr(ctx: StageContext) -> float:
    """`train.lr`: the fit stage's LR when it says `plan`, else the number it gives."""
    lr = ctx.cfg.train.lr
    return ctx.read_json("fit", PLAN_FILE)["lr"] if lr == "plan" else float(lr)


def plan_mixture(ctx: StageContext) -> Mixture:
    from kiln.tasks.train.data_loader import Mixture  # defers torch

    return Mixture.from_manifest(ctx.inputs["mix"] / MIXTURE_FILE, ctx.store.root)


def run_training(ctx: StageContext, model_cfg: ModelConfig, optim: OptimConfig, run_cfg: TrainRunConfig,
                 mixture: Mixture, *, init_model_dir: Path | None = None, branch_from: Path | None = None
                 ) -> TrainResult:
    """Train into `ctx.out_dir` (the stage's folder, or a sub-run's, whose recorder is then the sub-run's):
    in this process when the layout is one process and `cluster.launcher` is `local`, else through
    the launcher. Layout and launcher are runtime: a run stopped under one resumes under another,
    from its DCP checkpoints, with the same global batches. The planner's forecast of the run on
    `cluster` goes to the recorder (a sub-run's joins its stage's, under the sub-run's name): the
    stage's forecast, set beside its cost, is the sum over the training runs it records. So do the
    settings it trains with (`used.*` params of the recorder's run: the plan's LR and shape where the
    config says `plan`, the resolved layout). `init_model_dir` (a model's weights: an anneal) or
    `branch_from` (a train checkpoint to go on from: an adjustment) start it, as in `train_model`."""
    from kiln.tasks.train.planner import checked_layout, forecast_record  # defers torch

    ctx.recorder.record_forecast(forecast_record(model_cfg, mixture.vocab_size, run_cfg, ctx.cfg.train.parallel,
                                                 ctx.cfg.cluster))
    dims, run_cfg = checked_layout(ctx.cfg.train.parallel, model_cfg, run_cfg, mixture.vocab_size, ctx.cfg.cluster)
    ctx.recorder.used({"model": model_cfg.model_dump(mode="json"), "optim": optim.model_dump(mode="json"),
                       "run": run_cfg.model_dump(mode="json"), "parallel": dims.model_dump(mode="json")})
    out_dir, on_metrics = ctx.out_dir, ctx.recorder.metrics
    launcher = ctx.cfg.cluster.launcher
    if dims.world_size == 1 and launcher == "local":
        from kiln.tasks.train.loop import train_model  # defers torch

        # the steps go on while MLflow takes (or its spool keeps) their metrics
        with ctx.recorder.metrics_behind() as on_metrics:
            result = train_model(model_cfg, optim, run_cfg, mixture, out_dir, init_model_dir=init_model_dir,
                                 on_metrics=on_metrics, on_event=ctx.recorder.event, branch_from=branch_from)
        ctx.recorder.launched(launch_record("in-process", None, [{"attempt": 1, "job_id": None,
                                                                  "nodes": [socket.gethostname()]}], 0.0))
        return result
    from kiln.tasks.train.data_loader import write_manifest  # defers torch
    from kiln.tasks.train.launched_training import train_with_launcher  # defers torch

    manifest = write_manifest(mixture, out_dir / LAUNCHED_MIXTURE_FILE, ctx.store.root)
    return train_with_launcher(model_cfg, optim, run_cfg, dims, ctx.cfg.cluster, manifest, ctx.store.root,
                               out_dir, launcher="torchrun" if launcher == "local" else launcher,
                               init_model_dir=init_model_dir, branch_from=branch_from, on_metrics=on_metrics,
                               on_event=ctx.recorder.event,
                               job_name=job_name(ctx), on_launch=ctx.recorder.launched)


def kept_train_steps(train_dir: Path) -> list[int]:
    """The steps of the committed checkpoints a train run kept, oldest first."""
    root = train_dir / "checkpoints"
    return sorted(s for s in steps_on_disk(root) if (checkpoint_dir(root, s) / MARKER).is_file())


def job_name(ctx: StageContext) -> str:
    """`kiln-<stage>-<key>`, and the sub-run's name for one (an ablation branch): which run a job is, in
    `squeue`. Lowercase letters, digits and '-', at most 50 characters, as a Kubernetes Job name must be."""
    recorder = ctx.recorder
    name = f"kiln-{recorder.stage}-{recorder.key[:12]}" + (f"-{recorder.name.split('/')[-1]}" if recorder.name else "")
    return re.sub(r"[^a-z0-9-]+", "-", name.lower())[:50].rstrip("-")


def train_stats(result: TrainResult, *, device: str, world_size: int = 1, **extra: Any) -> dict[str, Any]:
    """The stage stats of a training run; `num_accelerators` (0 on CPU) prices its accelerator-seconds."""
    return {"num_accelerators": world_size if device != "cpu" else 0, "world_size": world_size, "steps": result.steps, "tokens_seen": result.tokens_seen, "num_params": result.num_params,
            "final_train_loss": result.final_train_loss, "val_loss": result.val_loss,
            "val_loss_by_domain": result.val_loss_by_domain, "tokens_per_s": result.tokens_per_s,
            "resumed_from_step": result.resumed_from_step, "num_rollbacks": result.num_rollbacks,
            "steps_trained": result.steps_trained,
            # a data schedule's phases (their steps, context and mixture) and the tokens each source gave in each
            **({"phases": result.phases, "tokens_by_phase": result.tokens_by_phase} if result.phases else {}), **extra}


def train_headline(stats: dict[str, Any]) -> dict[str, Any]:
    return {"steps": stats["steps"], "tokens": stats["tokens_seen"], "params": stats["num_params"],
            "train_loss": round(stats["final_train_loss"], 4), "val_loss": round(stats["val_loss"], 4)}
