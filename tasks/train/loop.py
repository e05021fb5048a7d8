"""The one training loop: proxy sweeps, validation, production train and anneal, on one process or many.

`train_model` builds (or loads) the model, splits it over the parallel layout (`dims`, see
`tasks.train.distributed`; one process by default, any pp x dp x tp under torchrun), trains it
with AdamW on batches from a `Mixture`, writes sharded DCP checkpoints (`tasks.train.dcp`),
resumes from the newest intact one left by a crashed attempt — whatever layout wrote it — and
finishes with the gathered model, per-domain validation loss, `metrics.json`,
`train_metrics.jsonl` and `loss_curve.png`. Steps in curves, metrics and checkpoint names count
completed optimizer updates (1 .. steps). Only rank 0 writes files and calls the callbacks;
every rank returns the same `TrainResult`.

Self-healing: every step's loss (the global batch's mean, the same on every rank) goes through
`tasks.train.health.check_loss`; a non-finite loss or a spike rolls the run back to the newest
checkpoint before it, and the steps up to the bad one are re-run on other batches (see
`tasks.train.health`). Each rollback is appended to `health_events.jsonl` and reported through
`on_event`; after `max_rollbacks` the run stops with `TrainingDivergedError`. A run without
anomalies is bit-identical with or without the monitor.

Determinism: on CPU the loop runs under `torch.use_deterministic_algorithms(True)`, so the same
config and data give a bit-identical loss curve (resume included) for a fixed thread count and
layout; another layout or thread count changes float summation order, hence the last bits.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from tqdm import tqdm

from tasks.errors import InputError
from tasks.train.checkpoint import delete_checkpoints_after
from tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig, revalidated
from tasks.train.data_loader import Mixture, batch_sources, validation_batches
from tasks.train.dcp import latest_intact_dcp, load_dcp, read_train_state, save_dcp
from tasks.train.distributed import Layout, clip_grad_norm, make_optimizer
from tasks.train.health import (
    EVENTS_FILE,
    Anomaly,
    SkipWindow,
    TrainingDivergedError,
    append_event,
    check_loss,
    data_index,
    data_offset,
    json_float,
    lr_factor,
    read_events,
    rollback_bound,
    windows_from_events,
)
from tasks.train.model import Transformer, build_model, count_parameters, flops_per_token, load_model, save_model
from tasks.train.plots import plot_loss_curve
from tasks.train.schedule import lr_at

FINAL_LOSS_WINDOW = 10
LOSS_PLOT = "loss_curve.png"
METRICS_LOG = "train_metrics.jsonl"  # every on_metrics call, for runs whose caller is another process
# test-only faults `train_model(fault_injection=...)` understands
FAULT_KEYS = {"poison_data_index", "lr_multiplier", "kill_rank_at_step"}


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    num_params: int
    final_train_loss: float  # mean of the last min(10, steps) steps
    val_loss: float | None  # unweighted mean over domains of val_loss_by_domain; None if stopped early
    val_loss_by_domain: dict[str, float]
    loss_curve: list[tuple[int, float]]  # the global batch's mean cross-entropy per step
    lr_curve: list[tuple[int, float]]
    grad_norm_curve: list[tuple[int, float]]  # before clipping
    batch_checksum_curve: list[tuple[int, int]]  # `batch_checksum` of each step's global batch
    mixture_history: list[tuple[int, dict]]  # (steps completed before it applied, mixture summary)
    wall_s: float  # this attempt only (a resumed run does not count the crashed one)
    tokens_per_s: float  # tokens trained in this attempt / its training time
    model_dir: Path | None  # None when the run stopped before its last step
    resumed_from_step: int | None
    num_rollbacks: int  # over every attempt in this out_dir
    health_events: list[dict[str, Any]]  # every line of health_events.jsonl
    world_size: int
    parallel: dict[str, Any]
    rank0_local_numel: int  # parameter elements rank 0 holds: shows how far the model is sharded
    started_unix: float  # when this attempt began (before building the model and loading checkpoints)
    first_step_unix: float | None  # when this attempt's first optimizer step finished: "training resumed"


def mixture_summary(mixture: Mixture) -> dict:
    """Each domain's weight and train shard file names: what `mixture_history` compares."""
    return {
        name: {"weight": d.weight, "train": [p.name for p in d.train]} for name, d in sorted(mixture.domains.items())
    }


@contextmanager
def _torch_settings(run_cfg: TrainRunConfig, device: torch.device) -> Iterator[None]:
    """Deterministic kernels on CPU and the requested thread count, both restored on exit."""
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    if run_cfg.num_threads is not None:
        torch.set_num_threads(run_cfg.num_threads)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)


def _identity(model_cfg: ModelConfig, optim_cfg: OptimConfig, run_cfg: TrainRunConfig, vocab_size: int) -> dict:
    identity = {
        "model": model_cfg.identity(),
        "optim": optim_cfg.identity(),
        "run": run_cfg.identity(),
        "vocab_size": vocab_size,
    }
    return json.loads(json.dumps(identity))  # as it reads back from a checkpoint


def _initial_model(
    model_cfg: ModelConfig, vocab_size: int, seed: int, init_model_dir: Path | None
) -> Transformer:
    """The step-0 weights: seeded (the same on every rank, before any sharding) or a saved model."""
    if init_model_dir is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return build_model(model_cfg, vocab_size)
    model, saved_cfg = load_model(init_model_dir)
    if saved_cfg != model_cfg or model.vocab_size != vocab_size:
        raise ValueError(
            f"init model in {init_model_dir} has config {saved_cfg.model_dump()} and vocab_size "
            f"{model.vocab_size}, but this run asks for {model_cfg.model_dump()} and vocab_size "
            f"{vocab_size}: use the same model section and tokenizer as the run that produced it"
        )
    return model.train()


@torch.inference_mode()
def evaluate(
    model: nn.Module, batches: dict[str, list[tuple[torch.Tensor, torch.Tensor]]], device: torch.device
) -> dict[str, float]:
    """Mean next-token cross-entropy per domain over fixed validation batches."""
    was_training = model.training
    model.eval()
    out = {}
    for name, pairs in batches.items():
        total = 0.0
        for x, y in pairs:
            logits = model(x.to(device))
            total += F.cross_entropy(logits.flatten(0, 1).float(), y.to(device).flatten()).item()
        out[name] = total / len(pairs)
    model.train(was_training)
    return out


def train_step(layout: Layout, model: nn.Module, schedule: Any, optimizer: torch.optim.Optimizer,
               x: torch.Tensor, y: torch.Tensor, grad_accum: int, max_norm: float, z_loss: float
               ) -> tuple[float, float]:
    """One optimizer update over this rank's rows of x/y; returns (mean loss, grad norm before clipping)."""
    loss = layout.forward_backward(model, schedule, x, y, grad_accum, z_loss)
    grad_norm = clip_grad_norm(list(model.parameters()), max_norm, layout.pp_mesh)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def _check_faults(faults: dict[str, Any]) -> None:
    unknown = set(faults) - FAULT_KEYS
    if unknown:
        raise ValueError(f"unknown fault_injection keys {sorted(unknown)}; known: {sorted(FAULT_KEYS)}")


def _inject_faults(
    faults: dict[str, Any], step: int, index: int, x: torch.Tensor, y: torch.Tensor, lr: float, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Test-only faults. `poison_data_index`: batch indices whose batch becomes one token id
    repeated (vocab_size - 1); a rollback's new indices miss it, as with bad data on disk.
    `lr_multiplier`: {step: factor} applied every time that step runs, a fault no rollback cures."""
    if index in faults.get("poison_data_index", ()):
        x, y = torch.full_like(x, vocab_size - 1), torch.full_like(y, vocab_size - 1)
    multipliers = {int(k): v for k, v in faults.get("lr_multiplier", {}).items()}  # JSON keys are strings
    return x, y, lr * multipliers.get(step, 1.0)


def _maybe_kill(faults: dict[str, Any], layout: Layout, out_dir: Path, step: int) -> None:
    """Test-only: `kill_rank_at_step: [rank, step]` SIGKILLs that rank once (a marker in out_dir makes
    the relaunched job run clean), as a crashed node would."""
    if "kill_rank_at_step" not in faults:
        return
    rank, at_step = faults["kill_rank_at_step"]
    marker = out_dir / ".fault_injected"
    if step == at_step and layout.rank == rank and not marker.exists():
        marker.write_text(f"rank {rank} killed at step {step}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def _ranges(values: list[int]) -> list[list[int]]:
    """Consecutive runs of `values` as [first, last] pairs."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return runs


def _skipped_data(
    mixture: Mixture, run_cfg: TrainRunConfig, windows: list[SkipWindow], first: int, last: int
) -> dict[str, Any]:
    """Which batches steps first..last used before a rollback replaced them: the bad step's rows
    (domain, token offset) in full and a count of rows per domain over all of them."""
    rows = run_cfg.batch_size * run_cfg.grad_accum
    indices = [data_index(step, windows) for step in range(first, last + 1)]
    sources = [batch_sources(mixture, run_cfg.seed, i, 0, 1, rows, run_cfg.seq_len) for i in indices]
    return {
        "data_indices": _ranges(indices),
        "bad_batch": [[domain, offset] for domain, offset in sources[-1]],
        "rows_by_domain": dict(sorted(Counter(domain for batch in sources for domain, _ in batch).items())),
    }


def _anomaly_record(anomaly: Anomaly) -> dict[str, Any]:
    return {
        "step": anomaly.step,
        "kind": anomaly.kind,
        "loss": json_float(anomaly.loss),
        "zscore": anomaly.zscore,
        "median": anomaly.median,
    }


def _diverged_message(events: list[dict[str, Any]], events_path: Path) -> str:
    history = "; ".join(
        f"step {e['step']} {e['kind']} loss={e['loss']}"
        + (f" -> rolled back to {e['rolled_back_to']}" if e["action"] == "rollback" else " -> gave up")
        for e in events
    )
    return (
        f"training diverged: the loss was still bad after {sum(e['action'] == 'rollback' for e in events)} "
        f"rollbacks ({history}). Details in {events_path}. Lower the learning rate, inspect the skipped "
        "data, or raise train.run.health.max_rollbacks"
    )


CURVES = ("loss", "lr", "grad_norm", "batch_checksum")


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
    fault_injection: dict[str, Any] | None = None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train for `run_cfg.steps` steps into out_dir (resuming a crashed attempt found there).

    `dims` is the parallel layout (default: one process); with a world size above 1 every rank
    of a torchrun job calls this together and out_dir must be on a filesystem they share.
    `on_metrics(step, metrics)` gets train metrics every `log_every` steps and validation loss at
    the end; `on_event(event)` gets each health event (a rollback, or giving up) as it is written
    to `health_events.jsonl`. `stop_after`: return once that many steps are done, as a stopped job
    would (no final model). `fault_injection` exists for tests only (see `_inject_faults`).
    """
    model_cfg, optim_cfg, run_cfg = revalidated(model_cfg), revalidated(optim_cfg), revalidated(run_cfg)
    dims = revalidated(dims) if dims is not None else ParallelDims()
    run_cfg.check_fits(model_cfg)
    faults = fault_injection or {}
    _check_faults(faults)
    t_start, started_unix = time.perf_counter(), time.time()
    ckpt_root = out_dir / "checkpoints"
    events_path = out_dir / EVENTS_FILE
    identity = _identity(model_cfg, optim_cfg, run_cfg, mixture.vocab_size)
    rows_per_step = run_cfg.batch_size * run_cfg.grad_accum
    tokens_per_step = rows_per_step * run_cfg.seq_len
    flops_per_step = flops_per_token(model_cfg, mixture.vocab_size, run_cfg.seq_len) * tokens_per_step
    health = run_cfg.health
    # built first so that a mixture without usable validation data fails before training
    val_batches = validation_batches(mixture, run_cfg.seq_len, run_cfg.eval_batches, run_cfg.batch_size)
    if not val_batches:
        raise InputError(
            f"no domain has a validation shard of at least seq_len + 1 = {run_cfg.seq_len + 1} "
            "tokens, so there is no validation loss: give the tokenize stage a larger val split"
        )

    with _torch_settings(run_cfg, torch.device(run_cfg.device)):
        layout = Layout.create(dims, torch.device(run_cfg.device))
        device, main = layout.device, layout.is_main
        if main:
            out_dir.mkdir(parents=True, exist_ok=True)
        model, schedule = layout.prepare(
            _initial_model(model_cfg, mixture.vocab_size, run_cfg.seed, init_model_dir).to(device),
            run_cfg, optim_cfg.z_loss)
        optimizer = make_optimizer(model, optim_cfg, device)
        # what a rollback to before the first checkpoint restores
        fresh_optimizer = optimizer.state_dict()
        fresh_rng = torch.get_rng_state()
        curves: dict[str, list] = {name: [] for name in CURVES}
        mixture_history: list = [[0, mixture_summary(mixture)]]
        resumed_from = None
        latest = latest_intact_dcp(ckpt_root)
        if latest is not None:
            if read_train_state(latest)["identity"] != identity:
                raise ValueError(
                    f"checkpoints in {ckpt_root} were written by a run with a different config (model, optim, "
                    "train run or vocabulary); use a fresh out_dir or delete that folder"
                )
            state = load_dcp(latest, model, optimizer)
            resumed_from = state["step"]
            curves = {name: [tuple(p) for p in state["curves"][name]] for name in CURVES}
            mixture_history = state["mixture_history"]
            if mixture_history[-1][1] != mixture_summary(mixture):
                mixture_history.append([resumed_from, mixture_summary(mixture)])
        # the record of earlier attempts too: their skip windows must apply to this one
        events = read_events(events_path)
        windows = windows_from_events(events)

        def record(event: dict[str, Any]) -> None:
            events.append(event)
            if main:
                append_event(events_path, event)
                if on_event is not None:
                    on_event(event)

        def save(step: int) -> None:
            train_state = {"identity": identity, "curves": curves, "mixture_history": mixture_history}
            save_dcp(ckpt_root, step, model, optimizer, train_state, run_cfg.keep_checkpoints, run_cfg.keep_every)

        def roll_back(anomaly: Anomaly) -> int:
            """Restore the newest checkpoint before the bad step; returns the step to resume at."""
            t_detect = time.perf_counter()
            if len(windows) >= health.max_rollbacks:
                record({**_anomaly_record(anomaly), "action": "abort", "rollbacks": len(windows)})
                if main:
                    plot_loss_curve(curves["loss"], [], events, out_dir / LOSS_PLOT)
                raise TrainingDivergedError(_diverged_message(events, events_path), list(events))
            found = latest_intact_dcp(ckpt_root, before=rollback_bound(anomaly.step, windows))
            target = read_train_state(found)["step"] if found is not None else 0
            deleted = delete_checkpoints_after(ckpt_root, target) if main else []
            layout.barrier()
            if found is not None:
                restored = load_dcp(found, model, optimizer)["curves"]
                curves.update({name: [tuple(p) for p in restored[name]] for name in CURVES})
            else:
                initial = _initial_model(model_cfg, mixture.vocab_size, run_cfg.seed, init_model_dir)
                set_model_state_dict(model, initial.state_dict(),
                                     options=StateDictOptions(full_state_dict=True, strict=dims.pp == 1))
                optimizer.load_state_dict(fresh_optimizer)
                torch.set_rng_state(fresh_rng)
                curves.update({name: [] for name in CURVES})
            optimizer.zero_grad(set_to_none=True)
            skipped = _skipped_data(mixture, run_cfg, windows, target + 1, anomaly.step)
            window = SkipWindow(
                first_step=target + 1,
                last_step=anomaly.step,
                data_offset=data_offset(len(windows) + 1, run_cfg.steps),
                lr_factor=health.rollback_lr_factor,
                lr_last_step=target + health.rollback_lr_steps,
            )
            windows.append(window)
            record({
                **_anomaly_record(anomaly),
                "action": "rollback",
                "rollback": len(windows),
                "rolled_back_to": target,
                "deleted_checkpoints": deleted,
                "window": asdict(window),
                "skipped_data": skipped,
                "time_to_resume_s": time.perf_counter() - t_detect,
            })
            return target

        max_norm = optim_cfg.grad_clip if optim_cfg.grad_clip > 0 else float("inf")
        model.train()
        start_step = resumed_from or 0
        t_train = time.perf_counter()
        t_log, tokens_since_log, steps_run, first_step_unix = t_train, 0, 0, None
        bar = tqdm(total=run_cfg.steps, initial=start_step, desc="train", unit="step", disable=None if main else True)
        i = start_step
        while i < run_cfg.steps:
            step = i + 1
            lr = lr_at(i, optim_cfg, run_cfg.steps) * lr_factor(step, windows)
            index = data_index(step, windows)
            x, y, checksum = layout.batch(mixture, run_cfg.seed, index, rows_per_step, run_cfg.seq_len)
            applied_lr = lr
            if faults:
                x, y, applied_lr = _inject_faults(faults, step, index, x, y, lr, mixture.vocab_size)
            for group in optimizer.param_groups:
                group["lr"] = applied_lr
            step_loss, grad_norm = train_step(layout, model, schedule, optimizer, x, y, run_cfg.grad_accum,
                                              max_norm, optim_cfg.z_loss)
            steps_run += 1
            tokens_since_log += tokens_per_step
            if first_step_unix is None:
                first_step_unix = time.time()
            anomaly = check_loss(step, step_loss, curves["loss"][-health.spike_window:], health)
            if anomaly is not None:
                i = roll_back(anomaly)
                bar.n = i
                bar.refresh()
                continue
            for name, value in zip(CURVES, (step_loss, lr, grad_norm, checksum)):
                curves[name].append((step, value))
            bar.update(1)
            _maybe_kill(faults, layout, out_dir, step)
            if step % run_cfg.log_every == 0 or step == run_cfg.steps:
                now = time.perf_counter()
                tokens_per_s = tokens_since_log / max(now - t_log, 1e-9)
                metrics = {"loss": step_loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s,
                           "peak_memory_mb": _peak_memory_mb(device)}
                if run_cfg.peak_tflops is not None:
                    # per device: the whole job's FLOPs over all its devices' peak
                    steps_per_s = tokens_per_s / tokens_per_step
                    metrics["mfu"] = flops_per_step * steps_per_s / (run_cfg.peak_tflops * 1e12 * dims.world_size)
                if main:
                    with (out_dir / METRICS_LOG).open("a") as log:
                        log.write(json.dumps({"step": step, **metrics}) + "\n")
                    if on_metrics is not None:
                        on_metrics(step, metrics)
                bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}")
                t_log, tokens_since_log = now, 0
            if step % run_cfg.checkpoint_every == 0:
                save(step)
            i += 1
            if stop_after is not None and step >= stop_after:
                break
        bar.close()
        train_s = time.perf_counter() - t_train

        finished = i == run_cfg.steps
        val_by_domain: dict[str, float] = {}
        model_dir = out_dir / "model" if finished else None
        if finished:
            full = layout.full_model(model, model_cfg, mixture.vocab_size)
            if full is not None:
                val_by_domain = evaluate(full, val_batches, device)
                save_model(full, model_cfg, mixture.vocab_size, model_dir)
            val_by_domain = layout.broadcast(val_by_domain)

    loss_curve = curves["loss"]
    tail = [loss for _, loss in loss_curve[-FINAL_LOSS_WINDOW:]]
    val_loss = sum(val_by_domain.values()) / len(val_by_domain) if val_by_domain else None
    result = TrainResult(
        steps=run_cfg.steps,
        tokens_seen=run_cfg.steps * tokens_per_step,
        num_params=count_parameters(model_cfg, mixture.vocab_size),
        final_train_loss=sum(tail) / len(tail),
        val_loss=val_loss,
        val_loss_by_domain=val_by_domain,
        loss_curve=loss_curve,
        lr_curve=curves["lr"],
        grad_norm_curve=curves["grad_norm"],
        batch_checksum_curve=curves["batch_checksum"],
        mixture_history=[tuple(entry) for entry in mixture_history],
        wall_s=time.perf_counter() - t_start,
        tokens_per_s=steps_run * tokens_per_step / train_s if train_s > 0 else 0.0,
        model_dir=model_dir,
        resumed_from_step=resumed_from,
        num_rollbacks=len(windows),
        health_events=events,
        world_size=dims.world_size,
        parallel=dims.model_dump(mode="json"),
        rank0_local_numel=layout.broadcast(layout.local_numel(model)),
        started_unix=started_unix,
        first_step_unix=first_step_unix,
    )
    if main and finished:
        if on_metrics is not None:
            on_metrics(run_cfg.steps, {"val_loss": val_loss, **{f"val_loss/{d}": v for d, v in val_by_domain.items()}})
        plot_loss_curve(loss_curve, [(run_cfg.steps, val_loss)], events, out_dir / LOSS_PLOT)
        write_metrics(result, out_dir)
    return result


def write_metrics(result: TrainResult, out_dir: Path) -> None:
    """`metrics.json` in the run's folder: the result without machine paths, so the store stays relocatable."""
    metrics = asdict(result)
    del metrics["model_dir"]
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def write_result(result: TrainResult, path: Path) -> None:
    """The whole result as JSON, for the process that launched this one (see `read_result`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**asdict(result), "model_dir": str(result.model_dir) if result.model_dir else None},
                               indent=2) + "\n")


def read_result(path: Path) -> TrainResult:
    """A `TrainResult` written by `write_result` (curves as tuples again)."""
    raw = json.loads(path.read_text())
    for name in ("loss_curve", "lr_curve", "grad_norm_curve", "batch_checksum_curve", "mixture_history"):
        raw[name] = [tuple(point) for point in raw[name]]
    raw["model_dir"] = Path(raw["model_dir"]) if raw["model_dir"] else None
    return TrainResult(**raw)
