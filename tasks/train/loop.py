"""The single-process training loop shared by proxy sweeps, validation, production train and anneal.

`train_model` builds (or loads) the model, trains it with AdamW on batches from a `Mixture`,
checkpoints, resumes from the newest intact checkpoint left by a crashed attempt, and finishes
with per-domain validation loss, the saved model, `metrics.json` and `loss_curve.png`. Steps in
curves, metrics and checkpoint names count completed optimizer updates (1 .. steps).

Self-healing: every step's loss goes through `tasks.train.health.check_loss`; a non-finite loss
or a spike rolls the run back to the newest checkpoint before it, and the steps up to the bad
one are re-run on other batches (see `tasks.train.health`). Each rollback is appended to
`health_events.jsonl` and reported through `on_event`; after `max_rollbacks` the run stops with
`TrainingDivergedError`. A run without anomalies is bit-identical with or without the monitor.

Determinism: on CPU the loop runs under `torch.use_deterministic_algorithms(True)`, so the same
config and data give a bit-identical loss curve (resume included) for a fixed thread count; a
different thread count may change float summation order, hence the last bits of the losses.
The first run in a process pays a one-off ~2-4 s for torch's optimizer machinery importing
torch._dynamo; later runs in the same process do not.
"""

from __future__ import annotations

import copy
import json
import resource
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
from tqdm import tqdm

from tasks.errors import InputError
from tasks.train.checkpoint import delete_checkpoints_after, load_latest_checkpoint, save_checkpoint
from tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig, revalidated
from tasks.train.data_loader import Mixture, batch_for_step, batch_sources, validation_batches
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
from tasks.train.model import Transformer, build_model, flops_per_token, load_model, save_model
from tasks.train.plots import plot_loss_curve
from tasks.train.schedule import lr_at

FINAL_LOSS_WINDOW = 10
LOSS_PLOT = "loss_curve.png"
# test-only faults `train_model(fault_injection=...)` understands
FAULT_KEYS = {"poison_data_index", "lr_multiplier"}


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int
    num_params: int
    final_train_loss: float  # mean of the last min(10, steps) steps
    val_loss: float  # unweighted mean over domains of val_loss_by_domain
    val_loss_by_domain: dict[str, float]
    loss_curve: list[tuple[int, float]]
    lr_curve: list[tuple[int, float]]
    wall_s: float  # this attempt only (a resumed run does not count the crashed one)
    tokens_per_s: float  # tokens trained in this attempt / its training time
    model_dir: Path
    resumed_from_step: int | None
    num_rollbacks: int  # over every attempt in this out_dir
    health_events: list[dict[str, Any]]  # every line of health_events.jsonl


def make_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matmul weights only (not norms, embeddings or biases)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # tied weights appear once
        (decay if p.dim() >= 2 and id(p) not in embedding_ids else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # the fused kernel exists for CPU and CUDA in torch >= 2.4 and is the fastest option on both
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=device.type in ("cpu", "cuda")
    )


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
    return {
        "model": model_cfg.identity(),
        "optim": optim_cfg.identity(),
        "run": run_cfg.identity(),
        "vocab_size": vocab_size,
    }


def _initial_model(
    model_cfg: ModelConfig, vocab_size: int, seed: int, init_model_dir: Path | None
) -> Transformer:
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


def _train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    run_cfg: TrainRunConfig,
    max_norm: float,
    z_loss: float,
) -> tuple[float, float]:
    """One optimizer update over grad_accum micro-batches of x/y; returns (mean loss, grad norm).

    The loss reported is the cross-entropy alone; the z-loss term only shapes the gradients.
    """
    device = x.device
    loss_sum = torch.zeros((), device=device)
    for m in range(run_cfg.grad_accum):
        rows = slice(m * run_cfg.batch_size, (m + 1) * run_cfg.batch_size)
        # bf16 autocast on GPU only: CPU runs stay fp32 and bit-reproducible
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[rows])
        logits = logits.flatten(0, 1).float()
        loss = F.cross_entropy(logits, y[rows].flatten())
        objective = loss
        if z_loss > 0:
            objective = loss + z_loss * torch.logsumexp(logits, dim=-1).square().mean()
        (objective / run_cfg.grad_accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.item() / run_cfg.grad_accum, grad_norm.item()


def _prepare_model(model: Transformer, run_cfg: TrainRunConfig) -> None:
    """Activation checkpointing, then compilation, in place: parameter names stay unchanged."""
    if run_cfg.activation_checkpointing:
        # imported here: tasks.train.parallel pulls in torch's tensor-parallel stack (~1 s)
        from tasks.train.parallel import apply_activation_checkpointing

        apply_activation_checkpointing(model)
    if run_cfg.compile:
        model.compile()


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
    return x, y, lr * faults.get("lr_multiplier", {}).get(step, 1.0)


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


def _snapshot(
    identity: dict, model: nn.Module, optimizer: torch.optim.Optimizer, loss_curve: list, lr_curve: list
) -> dict[str, Any]:
    return {
        "identity": identity,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "loss_curve": loss_curve,
        "lr_curve": lr_curve,
    }


def _restore(
    state: dict[str, Any], identity: dict, ckpt_root: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Load a snapshot into model and optimizer; returns its (loss_curve, lr_curve)."""
    if state["identity"] != identity:
        raise ValueError(
            f"checkpoints in {ckpt_root} were written by a run with a different config; "
            "use a fresh out_dir or delete that folder"
        )
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return [tuple(p) for p in state["loss_curve"]], [tuple(p) for p in state["lr_curve"]]


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


def train_model(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    run_cfg: TrainRunConfig,
    mixture: Mixture,
    out_dir: Path,
    *,
    init_model_dir: Path | None = None,
    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    fault_injection: dict[str, Any] | None = None,
) -> TrainResult:
    """Train for `run_cfg.steps` steps into out_dir (resuming a crashed attempt found there).

    `on_metrics(step, metrics)` gets train metrics every `log_every` steps and validation loss at
    the end; `on_event(event)` gets each health event (a rollback, or giving up) as it is written
    to `health_events.jsonl`. `fault_injection` exists for tests only (see `_inject_faults`).
    """
    model_cfg, optim_cfg, run_cfg = revalidated(model_cfg), revalidated(optim_cfg), revalidated(run_cfg)
    run_cfg.check_fits(model_cfg)
    faults = fault_injection or {}
    _check_faults(faults)
    t_start = time.perf_counter()
    device = torch.device(run_cfg.device)
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

    with _torch_settings(run_cfg, device):
        model = _initial_model(model_cfg, mixture.vocab_size, run_cfg.seed, init_model_dir).to(device)
        optimizer = make_optimizer(model, optim_cfg, device)
        # what a rollback to before the first checkpoint restores
        fresh_optimizer = copy.deepcopy(optimizer.state_dict())
        fresh_rng = torch.get_rng_state()
        start_step, loss_curve, lr_curve = 0, [], []
        resumed = load_latest_checkpoint(ckpt_root)
        if resumed is not None:
            start_step, state = resumed
            loss_curve, lr_curve = _restore(state, identity, ckpt_root, model, optimizer)
        _prepare_model(model, run_cfg)
        # the record of earlier attempts too: their skip windows must apply to this one
        events = read_events(events_path)
        windows = windows_from_events(events)

        def record(event: dict[str, Any]) -> None:
            events.append(event)
            append_event(events_path, event)
            if on_event is not None:
                on_event(event)

        def roll_back(anomaly: Anomaly) -> int:
            """Restore the newest checkpoint before the bad step; returns the step to resume at."""
            t_detect = time.perf_counter()
            if len(windows) >= health.max_rollbacks:
                record({**_anomaly_record(anomaly), "action": "abort", "rollbacks": len(windows)})
                plot_loss_curve(loss_curve, [], events, out_dir / LOSS_PLOT)
                raise TrainingDivergedError(_diverged_message(events, events_path), list(events))
            found = load_latest_checkpoint(ckpt_root, before=rollback_bound(anomaly.step, windows))
            target = found[0] if found is not None else 0
            deleted = delete_checkpoints_after(ckpt_root, target)
            if found is not None:
                curves = _restore(found[1], identity, ckpt_root, model, optimizer)
            else:
                initial = _initial_model(model_cfg, mixture.vocab_size, run_cfg.seed, init_model_dir)
                model.load_state_dict(initial.state_dict())
                optimizer.load_state_dict(fresh_optimizer)
                torch.set_rng_state(fresh_rng)
                curves = ([], [])
            loss_curve[:], lr_curve[:] = curves
            optimizer.zero_grad(set_to_none=True)
            time_to_resume = time.perf_counter() - t_detect
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
                "time_to_resume_s": time_to_resume,
            })
            return target

        max_norm = optim_cfg.grad_clip if optim_cfg.grad_clip > 0 else float("inf")
        model.train()
        t_train = time.perf_counter()
        t_log, tokens_since_log, steps_run = t_train, 0, 0
        bar = tqdm(total=run_cfg.steps, initial=start_step, desc="train", unit="step", disable=None)
        i = start_step
        while i < run_cfg.steps:
            step = i + 1
            lr = lr_at(i, optim_cfg, run_cfg.steps)
            factor = lr_factor(step, windows)
            if factor != 1.0:
                lr *= factor
            index = data_index(step, windows)
            x, y = batch_for_step(mixture, run_cfg.seed, index, 0, 1, rows_per_step, run_cfg.seq_len)
            applied_lr = lr
            if faults:
                x, y, applied_lr = _inject_faults(faults, step, index, x, y, lr, mixture.vocab_size)
            for group in optimizer.param_groups:
                group["lr"] = applied_lr
            step_loss, grad_norm = _train_step(
                model, optimizer, x.to(device), y.to(device), run_cfg, max_norm, optim_cfg.z_loss
            )
            steps_run += 1
            tokens_since_log += tokens_per_step
            history = [loss for _, loss in loss_curve[-health.spike_window :]]
            anomaly = check_loss(step, step_loss, history, health)
            if anomaly is not None:
                i = roll_back(anomaly)
                bar.n = i
                bar.refresh()
                continue
            loss_curve.append((step, step_loss))
            lr_curve.append((step, lr))
            bar.update(1)
            if step % run_cfg.log_every == 0 or step == run_cfg.steps:
                now = time.perf_counter()
                tokens_per_s = tokens_since_log / max(now - t_log, 1e-9)
                if on_metrics is not None:
                    metrics = {
                        "loss": step_loss,
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens_per_s": tokens_per_s,
                        "peak_memory_mb": _peak_memory_mb(device),
                    }
                    if run_cfg.peak_tflops is not None:
                        steps_per_s = tokens_per_s / tokens_per_step
                        metrics["mfu"] = flops_per_step * steps_per_s / (run_cfg.peak_tflops * 1e12)
                    on_metrics(step, metrics)
                bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}")
                t_log, tokens_since_log = now, 0
            if step % run_cfg.checkpoint_every == 0:
                state = _snapshot(identity, model, optimizer, loss_curve, lr_curve)
                save_checkpoint(ckpt_root, step, state, keep=run_cfg.keep_checkpoints, keep_every=run_cfg.keep_every)
            i += 1
        bar.close()
        train_s = time.perf_counter() - t_train

        val_by_domain = evaluate(model, val_batches, device)
        model_dir = out_dir / "model"
        save_model(model, model_cfg, mixture.vocab_size, model_dir)

    tail = [loss for _, loss in loss_curve[-FINAL_LOSS_WINDOW:]]
    val_loss = sum(val_by_domain.values()) / len(val_by_domain)
    result = TrainResult(
        steps=run_cfg.steps,
        tokens_seen=run_cfg.steps * tokens_per_step,
        num_params=sum(p.numel() for p in model.parameters()),
        final_train_loss=sum(tail) / len(tail),
        val_loss=val_loss,
        val_loss_by_domain=val_by_domain,
        loss_curve=loss_curve,
        lr_curve=lr_curve,
        wall_s=time.perf_counter() - t_start,
        tokens_per_s=steps_run * tokens_per_step / train_s if train_s > 0 else 0.0,
        model_dir=model_dir,
        resumed_from_step=resumed[0] if resumed is not None else None,
        num_rollbacks=len(windows),
        health_events=events,
    )
    if on_metrics is not None:
        on_metrics(run_cfg.steps, {"val_loss": val_loss, **{f"val_loss/{d}": v for d, v in val_by_domain.items()}})
    plot_loss_curve(loss_curve, [(run_cfg.steps, val_loss)], events, out_dir / LOSS_PLOT)
    metrics = asdict(result)
    del metrics["model_dir"]
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return result
