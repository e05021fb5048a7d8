"""The anneal's data: its mixture's domains, and its quality selections cut out of the token shards.

A quality selection (`tasks.train.anneal.QualitySelection`) ranks the scored train documents of its
domains by the clean stage's `quality_score`, read from the tokenize stage's document index, and
copies the tokens of the best ones into a shard of its own in the anneal's folder: a mixture
component like a domain, sampled by its weight. It has no validation shard: its documents'
held-out counterparts are in their domains' validation, which the anneal's val loss already reads.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from kiln.tasks.errors import ConfigError
from kiln.tasks.train.anneal import AnnealMixture, QualitySelection
from kiln.tasks.train.data_loader import Mixture, mixture_with_weights

SELECTIONS_DIR = "quality_selections"


def top_quality_cutoff(quality: np.ndarray, top: float) -> float | None:
    """The lowest score taken when keeping the best `top` share of the scored (non-NaN) entries, at
    least one; every entry scoring at least this is in. None when nothing is scored."""
    scored = np.sort(quality[~np.isnan(quality)])[::-1]
    if not len(scored):
        return None
    # round first: 0.3 * 10 is 3.0000000000000004, whose ceiling would take a fourth
    keep = max(1, math.ceil(round(top * len(scored), 9)))
    return float(scored[keep - 1])


def _train_shards(shards_root: Path, split: dict[str, Any]) -> list[tuple[Path, np.ndarray]]:
    """A domain's train token shards, in order, each with its document index."""
    return [(shards_root / shard["path"], np.load(shards_root / shard["index"])) for shard in split["shards"]]


def select_by_quality(shards: dict, shards_root: Path, selection: QualitySelection, name: str, where: str,
                      out_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Write the train tokens of the documents `selection` takes (in domain, then document order) to
    `out_dir/<name>.bin`; returns the shard and what was taken, from how many, per domain."""
    known = sorted(shards["domains"])
    unknown = sorted(set(selection.domains or ()) - set(known))
    if unknown:
        raise ConfigError(f"{where}.{name}.domains: {unknown} are not in the corpus; known: {known}")
    parts = {d: _train_shards(shards_root, shards["domains"][d]["train"]) for d in selection.domains or known}
    quality = {d: np.concatenate([index["quality"] for _, index in part] or [np.zeros(0)]) for d, part in parts.items()}
    unscored = {d: int(np.isnan(scores).sum()) for d, scores in quality.items()}
    never_scored = [d for d, scores in quality.items() if unscored[d] == len(scores)]
    if selection.domains is not None and never_scored:
        raise ConfigError(
            f"{where}.{name}.domains: {never_scored} have no document with a quality_score (the clean stage scores "
            "documents only when clean.quality_model or clean.quality_training is set); choose scored domains")
    cutoff = top_quality_cutoff(np.concatenate(list(quality.values())), selection.quality_top)
    if cutoff is None:
        raise ConfigError(f"{where}.{name}: no train document has a quality_score; set clean.quality_model or "
                          "clean.quality_training, or draw on domains instead")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.bin"
    dtype = np.dtype(shards["dtype"]).newbyteorder("<")
    selected: dict[str, int] = {}
    num_tokens = 0
    with open(path, "wb") as handle:
        for domain, part in parts.items():
            selected[domain] = 0
            for shard, index in part:
                tokens = np.memmap(shard, dtype=dtype, mode="r") if shard.stat().st_size else np.zeros(0, dtype)
                ends = index["end"]
                starts = np.concatenate([[0], ends[:-1]])
                taken = np.flatnonzero(index["quality"] >= cutoff)  # NaN compares False: unscored never taken
                handle.writelines(tokens[starts[i]:ends[i]].tobytes() for i in taken)
                selected[domain] += len(taken)
                num_tokens += int((ends[taken] - starts[taken]).sum())
    stats = {"quality_top": selection.quality_top, "score_cutoff": cutoff, "num_tokens": num_tokens,
             "num_scored": sum(len(scores) - unscored[d] for d, scores in quality.items()),
             "num_selected": sum(selected.values()), "num_selected_by_domain": selected,
             "num_unscored_by_domain": unscored}
    return path, stats


def anneal_mixture(shards: dict, shards_root: Path, mixture: AnnealMixture, where: str, out_dir: Path
                   ) -> tuple[Mixture, dict[str, dict[str, Any]]]:
    """The `Mixture` an anneal trains on: the tokenize stage's domains by weight, plus one component per
    quality selection (its shard written under `out_dir`); and each selection's stats."""
    names = [n for n, entry in mixture.items() if isinstance(entry, QualitySelection)]
    clash = sorted(n for n in names if n in shards["domains"])
    if clash:
        raise ConfigError(f"{where}: {clash} name quality selections but are domains of the corpus; rename them")
    unsafe = sorted(n for n in names if not re.fullmatch(r"[A-Za-z0-9_.-]+", n) or n.startswith("."))
    if unsafe:  # each selection's tokens are written to <name>.bin
        raise ConfigError(f"{where}: quality selection names {unsafe} name files: use letters, digits, '_', '-' or '.'")
    selections, stats = {}, {}
    for name, entry in mixture.items():
        if isinstance(entry, QualitySelection):
            path, stats[name] = select_by_quality(shards, shards_root, entry, name, where, out_dir / SELECTIONS_DIR)
            selections[name] = (entry.weight, path)
    weights = {name: entry for name, entry in mixture.items() if not isinstance(entry, QualitySelection)}
    return mixture_with_weights(shards, shards_root, weights, where, selections=selections), stats
