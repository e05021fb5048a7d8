"""A context extension measured: a model before a long-context phase and the model after it, side by side
on the two long-context measures of the suite (`tasks.evals.categories`): loss by position bucket past the
old context, and passkey retrieval at several lengths.

- Loss by position: the mean next-token cross-entropy (nats) of the tokens at positions [a, b) of fixed
  windows of the new context (validation tokens, every window read whole from position 0), for the span
  inside the old context and for `buckets` equal spans past it. The done-when check of a context
  extension: past the old length, the extended model's loss is the lower.
- Passkey retrieval: the suite's own items (`categories.passkey_items`, the key hidden at evenly spread
  depths in filler, with `num_choices` candidate keys) at prompt lengths in tokens; a prompt is right when
  the true key's log-likelihood is the highest of the choices (the suite's `kiln_passkey` at the mid level).

Scored here in torch, not through lm-eval: both models are scored on the same items in a few forward
passes, a second or two for a tiny model on a CPU, so a train run's report can hold it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.tasks.evals.categories import PasskeyConfig, TokenView, passkey_items
from kiln.tasks.train.data_loader import mixture_with_weights, validation_batches
from kiln.tasks.train.model import load_model


def bucket_spans(old_len: int, new_len: int, buckets: int) -> list[tuple[int, int]]:
    """[0, old_len) and `buckets` equal spans of [old_len, new_len) (the last takes the remainder)."""
    if not 0 < old_len < new_len:
        raise ValueError(f"an extension goes from a shorter context to a longer one, got {old_len} -> {new_len}")
    width = max(1, (new_len - old_len) // buckets)
    edges = [old_len + k * width for k in range(buckets)] + [new_len]
    return [(0, old_len)] + [(a, b) for a, b in zip(edges, edges[1:]) if a < b]


@torch.inference_mode()
def position_losses(model: nn.Module, windows: torch.Tensor, spans: list[tuple[int, int]]) -> dict[str, float]:
    """Mean next-token cross-entropy of `windows` [N, L + 1] (inputs [:, :-1], targets [:, 1:]) over the
    positions of each span, keyed "tokens a-b"."""
    model.eval()
    losses = torch.cat([F.cross_entropy(model(w[None, :-1]).float()[0], w[1:], reduction="none")[None]
                        for w in windows])
    return {f"tokens {a}-{b}": float(losses[:, a:b].mean()) for a, b in spans}


@torch.inference_mode()
def passkey_accuracy(model: nn.Module, view: TokenView, lengths: list[int], cfg: PasskeyConfig) -> dict[str, float]:
    """The share of passkey prompts of at most each length (tokens) whose true key is the likeliest choice;
    a length too short for the key and the question is left out."""
    model.eval()
    out = {}
    for length in lengths:
        items = passkey_items(replace(view, max_len=length), 1.0, cfg)
        right = 0
        for item in items:
            context = view.encode(item["context"])
            scores = []
            for choice in item["choices"]:
                ids = torch.tensor(context + view.encode(choice))
                logits = model(ids[None, :-1]).float()[0, len(context) - 1:]
                scores.append(float(F.log_softmax(logits, -1).gather(1, ids[len(context):, None]).sum()))
            right += max(range(len(scores)), key=scores.__getitem__) == item["label"]
        if items:
            out[f"{length} tokens"] = right / len(items)
    return out


def measure(model_dir: Path, windows: torch.Tensor, spans: list[tuple[int, int]], view: TokenView | None,
            lengths: list[int], passkey: PasskeyConfig) -> dict[str, Any]:
    """Both measures of the saved model in `model_dir`."""
    model, cfg = load_model(model_dir)
    out: dict[str, Any] = {"rope_theta": cfg.rope_theta,
                           "rope_scaling": cfg.rope_scaling.model_dump() if cfg.rope_scaling else None,
                           "loss_by_position": position_losses(model, windows, spans)}
    if view is not None:
        out["passkey_accuracy"] = passkey_accuracy(model, view, lengths, passkey)
    return out


def extension_report(before: Path, after: Path, windows: torch.Tensor, old_len: int, *, buckets: int = 3,
                     view: TokenView | None = None, lengths: list[int] | None = None,
                     passkey: PasskeyConfig | None = None) -> dict[str, Any]:
    """The model saved in `before` (the last step before the extension) beside the one in `after`, on
    windows [N, new_len + 1] and passkeys at `lengths` tokens (default: the old length, halfway, the new
    one); `past_old_len_falls` says whether the loss past `old_len` (every bucket after the first) fell."""
    new_len = windows.shape[1] - 1
    spans = bucket_spans(old_len, new_len, buckets)
    lengths = lengths or sorted({old_len, (old_len + new_len) // 2, new_len})
    passkey = passkey or PasskeyConfig()
    report = {"old_seq_len": old_len, "seq_len": new_len, "windows": int(windows.shape[0]),
              "before": measure(before, windows, spans, view, lengths, passkey),
              "after": measure(after, windows, spans, view, lengths, passkey)}
    past = [f"tokens {a}-{b}" for a, b in spans[1:]]
    report["past_old_len_falls"] = all(report["after"]["loss_by_position"][k] < report["before"]["loss_by_position"][k]
                                       for k in past)
    return report


def validation_windows(shards: dict, shards_root: Path, seq_len: int, per_domain: int) -> torch.Tensor:
    """`per_domain` evenly spaced windows of `seq_len + 1` validation tokens of every domain of the tokenize
    stage's shards (`shards.json`) long enough to hold one, as one tensor [N, seq_len + 1]."""
    mixture = mixture_with_weights(shards, shards_root, dict.fromkeys(shards["domains"], 1.0), "evaluate")
    batches = validation_batches(mixture, seq_len, 1, per_domain)
    if not batches:
        raise ValueError(f"no domain has {seq_len + 1} validation tokens: the extension's loss by position needs "
                         "one window of the new context; give the tokenize stage a larger val split")
    return torch.cat([torch.cat([pairs[0][0], pairs[0][1][:, -1:]], 1) for pairs in batches.values()])


def extension_reports(train_dir: Path, phases: list[dict[str, Any]], snapshots: Path, view: TokenView | None,
                      shards: dict, shards_root: Path, per_domain: int = 8, buckets: int = 3) -> dict[str, Any]:
    """A report (`extension_report`) for each phase of a train run's data schedule (`phases`: the phase
    summaries of its stats) that lengthened the context and left a pre-extension model in `snapshots/<phase>`;
    the model after it is the run's final one (`train_dir/model`), and passkeys are at the old length, halfway
    and the new length."""
    out = {}
    for prev, phase in zip(phases, phases[1:]):
        before = snapshots / phase["name"]
        if not before.is_dir() or phase["seq_len"] <= prev["seq_len"]:
            continue
        windows = validation_windows(shards, shards_root, phase["seq_len"], per_domain)
        out[phase["name"]] = extension_report(before, train_dir / "model", windows, prev["seq_len"], buckets=buckets,
                                              view=view)
    return out


def tokenizer_view(tokenizer_path: Path, max_len: int) -> TokenView:
    """The run's tokenizer (tokenize's `tokenizer.json`) as the generated tasks see it."""
    from tokenizers import Tokenizer  # defers tokenizers

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    return TokenView(lambda text: tokenizer.encode(text, add_special_tokens=False).ids, tokenizer.decode, max_len)
