"""The single-process training loop shared by proxy sweeps, validation, production train and anneal.

`train_model` builds (or loads) the model, trains it with AdamW on batches from a `Mixture`,
checkpoints, resumes from the newest intact checkpoint left by a crashed attempt, and finishes
with per-domain validation loss, the saved model and `metrics.json`. Steps in curves, metrics and
checkpoint names count completed optimizer updates (1 .. steps).

Determinism: on CPU the loop runs under `torch.use_deterministic_algorithms(True)`, so the same
config and data give a bit-identical loss curve (resume included) for a fixed thread count; a
different thread count may change float summation order, hence the last bits of the losses.
The first run in a process pays a one-off ~2-4 s for torch's optimizer machinery importing
torch._dynamo; later runs in the same process do not.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from tasks.errors import InputError
from tasks.train.checkpoint import load_latest_checkpoint, save_checkpoint
from tasks.train.config import ModelConfig, OptimConfig, TrainRunConfig, revalidated
from tasks.train.data_loader import Mixture, batch_for_step, validation_batches
from tasks.train.model import Transformer, build_model, load_model, save_model
from tasks.train.schedule import lr_at

FINAL_LOSS_WINDOW = 10


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
) -> tuple[float, float]:
    """One optimizer update over grad_accum micro-batches of x/y; returns (mean loss, grad norm)."""
    device = x.device
    loss_sum = torch.zeros((), device=device)
    for m in range(run_cfg.grad_accum):
        rows = slice(m * run_cfg.batch_size, (m + 1) * run_cfg.batch_size)
        # bf16 autocast on GPU only: CPU runs stay fp32 and bit-reproducible
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(x[rows])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y[rows].flatten())
        (loss / run_cfg.grad_accum).backward()
        loss_sum += loss.detach()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum.item() / run_cfg.grad_accum, grad_norm.item()


def train_model(
    model_cfg: ModelConfig,
    optim_cfg: OptimConfig,
    run_cfg: TrainRunConfig,
    mixture: Mixture,
    out_dir: Path,
    *,
    init_model_dir: Path | None = None,
    on_metrics: Callable[[int, dict[str, float]], None] | None = None,
) -> TrainResult:
    """Train for `run_cfg.steps` steps into out_dir (resuming a crashed attempt found there)."""
    model_cfg, optim_cfg, run_cfg = revalidated(model_cfg), revalidated(optim_cfg), revalidated(run_cfg)
    run_cfg.check_fits(model_cfg)
    t_start = time.perf_counter()
    device = torch.device(run_cfg.device)
    ckpt_root = out_dir / "checkpoints"
    identity = _identity(model_cfg, optim_cfg, run_cfg, mixture.vocab_size)
    rows_per_step = run_cfg.batch_size * run_cfg.grad_accum
    tokens_per_step = rows_per_step * run_cfg.seq_len
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
        start_step, loss_curve, lr_curve = 0, [], []
        resumed = load_latest_checkpoint(ckpt_root)
        if resumed is not None:
            start_step, state = resumed
            if state["identity"] != identity:
                raise ValueError(
                    f"checkpoints in {ckpt_root} were written by a run with a different config; "
                    "use a fresh out_dir or delete that folder"
                )
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["torch_rng"])
            loss_curve = [tuple(p) for p in state["loss_curve"]]
            lr_curve = [tuple(p) for p in state["lr_curve"]]

        max_norm = optim_cfg.grad_clip if optim_cfg.grad_clip > 0 else float("inf")
        model.train()
        t_train = time.perf_counter()
        t_log, tokens_since_log = t_train, 0
        bar = tqdm(total=run_cfg.steps, initial=start_step, desc="train", unit="step", disable=None)
        for i in range(start_step, run_cfg.steps):
            lr = lr_at(i, optim_cfg, run_cfg.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = batch_for_step(mixture, run_cfg.seed, i, 0, 1, rows_per_step, run_cfg.seq_len)
            step_loss, grad_norm = _train_step(model, optimizer, x.to(device), y.to(device), run_cfg, max_norm)
            step = i + 1
            loss_curve.append((step, step_loss))
            lr_curve.append((step, lr))
            tokens_since_log += tokens_per_step
            bar.update(1)
            if step % run_cfg.log_every == 0 or step == run_cfg.steps:
                now = time.perf_counter()
                if on_metrics is not None:
                    on_metrics(
                        step,
                        {
                            "loss": step_loss,
                            "lr": lr,
                            "grad_norm": grad_norm,
                            "tokens_per_s": tokens_since_log / max(now - t_log, 1e-9),
                        },
                    )
                bar.set_postfix(loss=f"{step_loss:.4f}", lr=f"{lr:.2e}")
                t_log, tokens_since_log = now, 0
            if step % run_cfg.checkpoint_every == 0:
                state = {
                    "identity": identity,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                    "loss_curve": loss_curve,
                    "lr_curve": lr_curve,
                }
                save_checkpoint(ckpt_root, step, state, keep=run_cfg.keep_checkpoints)
        bar.close()
        train_s = time.perf_counter() - t_train

        val_by_domain = evaluate(model, val_batches, device)
        model_dir = out_dir / "model"
        save_model(model, model_cfg, mixture.vocab_size, model_dir)

    tail = [loss for _, loss in loss_curve[-FINAL_LOSS_WINDOW:]]
    val_loss = sum(val_by_domain.values()) / len(val_by_domain)
    trained_steps = run_cfg.steps - start_step
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
        tokens_per_s=trained_steps * tokens_per_step / train_s if train_s > 0 else 0.0,
        model_dir=model_dir,
        resumed_from_step=resumed[0] if resumed is not None else None,
    )
    if on_metrics is not None:
        on_metrics(run_cfg.steps, {"val_loss": val_loss, **{f"val_loss/{d}": v for d, v in val_by_domain.items()}})
    metrics = asdict(result)
    del metrics["model_dir"]
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return result
