"""The train stage's data schedule: `train.phases` (`DataPhase`s) made into the `Phase`s of a `Mixture`.

Each phase's step range comes from its bound (`until_step`, or `until_tokens`: the share of the
run's token budget, counting each earlier phase at its own sequence length), its sources from its
mixture over the mix stage's domains (their train shards), and, for `order: quality`, from a
curriculum shard per domain written under the run's folder: the domain's train documents sorted by
the clean stage's quality score, ascending (unscored ones first, as the least known), which the
loader walks through once over the phase (`tasks.train.data_loader`).

New data batches (`train.batches`, each the batch stage's decontaminated, tokenized output) join the
same mixture (`with_batches`): in every phase, each batch's documents of a domain are a source of their
own, `batch/<name>/<domain>`, beside the domain's corpus, and the domain's weight is split between
them by train tokens, so a batch token is drawn as often as a corpus token of its domain and the
domain weights stay as configured. A source of its own is what the loader already counts: the
tokens each batch gave in each phase are in the checkpoint and the stats (`tokens_by_phase`).

A long-context phase (`DataPhase.rope_theta` / `rope_scaling`, `long_documents`) carries its rotary
settings on its `Phase` (`Phase.rope`: what every phase from the first that set them trains with; the
trainer gives them to the model when the phase starts) and, with `long_documents`, draws from a
length-weighted shard per domain under the run's folder (`length_weighted`: each long document
`upweight` times), so windows of long documents are drawn that many times as often.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kiln.tasks.constants import BATCH_PREFIX, DOC_INDEX_SUFFIX
from kiln.tasks.errors import ConfigError, InputError
from kiln.tasks.train.config import DataPhase, LongDocuments, TrainRunConfig, check_phases
from kiln.tasks.train.data_loader import DomainSource, Mixture, Phase

SCHEDULE_DIR = "data_schedule"  # the curriculum shards, under the run's folder


def phase_bounds(phases: list[DataPhase], run: TrainRunConfig, where: str) -> list[tuple[int, int, int]]:
    """(first step, last step, seq_len) of each phase; the last ends at run.steps. A phase bounded by a
    token share keeps at least one step (and leaves one to each later phase) where the run is long
    enough; a ConfigError when a phase would be empty or end past the run."""
    budget = run.steps * run.batch_size * run.seq_len
    out, done, tokens = [], 0, 0
    for i, phase in enumerate(phases):
        seq_len = phase.seq_len or run.seq_len
        if phase.until_step is not None:
            last = phase.until_step
        elif phase.until_tokens is not None:
            last = done + math.ceil(round((phase.until_tokens * budget - tokens) / (run.batch_size * seq_len), 9))
        else:
            last = run.steps
        later = len(phases) - 1 - i
        if phase.until_tokens is not None:  # a share rounds: every phase keeps at least one step where it can
            last = min(max(last, done + 1), run.steps - later)
        if last <= done or last > run.steps - later:
            raise ConfigError(f"{where}[{i}] ({phase.name!r}) would train steps {done + 1}..{last} of a "
                              f"{run.steps}-step run, before {later} more phase(s): move its bound so that every "
                              "phase holds at least one step")
        tokens += (last - done) * run.batch_size * seq_len
        out.append((done + 1, last, seq_len))
        done = last
    return out


def quality_ordered(train: tuple[Path, ...], dtype: str, out: Path, where: str) -> Path:
    """Write the documents of the train shards `train` to `out`, ascending by quality score (unscored
    first, ties in corpus order)."""
    missing = [str(p.with_suffix(DOC_INDEX_SUFFIX)) for p in train if not p.with_suffix(DOC_INDEX_SUFFIX).is_file()]
    if missing:
        raise InputError(f"{where}: order quality reads each shard's document index, and {missing} do not exist "
                         "(the tokenize stage writes them): re-run tokenize, or use order: random")
    indexes = [np.load(p.with_suffix(DOC_INDEX_SUFFIX)) for p in train]
    quality = np.concatenate([ix["quality"] for ix in indexes] or [np.zeros(0)])
    if not len(quality) or np.isnan(quality).all():
        raise ConfigError(f"{where}: order quality, but no train document of the domain has a quality_score "
                          "(set clean.quality_model or clean.quality_training), or use order: random")
    order = np.argsort(np.where(np.isnan(quality), -np.inf, quality), kind="stable")
    token_dtype = np.dtype(dtype).newbyteorder("<")
    docs = []  # (shard tokens, start, end) in corpus order
    for path, ix in zip(train, indexes):
        tokens = np.memmap(path, dtype=token_dtype, mode="r") if path.stat().st_size else np.zeros(0, token_dtype)
        ends = ix["end"]
        starts = np.concatenate([[0], ends[:-1]])
        docs += [(tokens, int(s), int(e)) for s, e in zip(starts, ends)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as handle:
        handle.writelines(docs[i][0][docs[i][1]:docs[i][2]].tobytes() for i in order)
    return out


def _documents(train: tuple[Path, ...], dtype: str, where: str, why: str) -> list[tuple[np.ndarray, int, int]]:
    """(shard tokens, start, end) of every document of the train shards `train`, in corpus order."""
    missing = [str(p.with_suffix(DOC_INDEX_SUFFIX)) for p in train if not p.with_suffix(DOC_INDEX_SUFFIX).is_file()]
    if missing:
        raise InputError(f"{where}: {why} reads each shard's document index, and {missing} do not exist "
                         "(the tokenize stage writes them): re-run tokenize")
    token_dtype = np.dtype(dtype).newbyteorder("<")
    docs = []
    for path in train:
        tokens = np.memmap(path, dtype=token_dtype, mode="r") if path.stat().st_size else np.zeros(0, token_dtype)
        ends = np.load(path.with_suffix(DOC_INDEX_SUFFIX))["end"]
        starts = np.concatenate([[0], ends[:-1]])
        docs += [(tokens, int(s), int(e)) for s, e in zip(starts, ends)]
    return docs


def length_weighted(train: tuple[Path, ...], dtype: str, long: LongDocuments, out: Path, where: str) -> tuple[Path, dict]:
    """Write the train shards' documents to `out` once in corpus order, then each document of at least
    `long.min_tokens` tokens `long.upweight - 1` more times, a pass per repeat (so copies of one document are
    a whole pass apart, never adjacent: a window spanning a document and its copy would teach copying).
    Returns `out` and its counts: long documents, their tokens and the other documents' tokens (each once)."""
    docs = _documents(train, dtype, where, "long_documents")
    long_docs = [d for d in docs if d[2] - d[1] >= long.min_tokens]
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as handle:
        handle.writelines(t[s:e].tobytes() for t, s, e in docs)
        for _ in range(long.upweight - 1):
            handle.writelines(t[s:e].tobytes() for t, s, e in long_docs)
    long_tokens = sum(e - s for _, s, e in long_docs)
    return out, {"long_documents": len(long_docs), "long_tokens": long_tokens,
                 "other_tokens": sum(e - s for _, s, e in docs) - long_tokens}


def scheduled_mixture(base: Mixture, phases: list[DataPhase], run: TrainRunConfig, out_dir: Path,
                      where: str = "train.phases") -> Mixture:
    """`base` (the mix stage's mixture: its domains, their shards and validation) with the phases of
    `phases`; `out_dir` holds the curriculum shards. No phases: `base` itself."""
    if not phases:
        return base
    try:
        check_phases(phases)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    built, rope = [], {}
    for i, (phase, (first, last, seq_len)) in enumerate(zip(phases, phase_bounds(phases, run, where))):
        if phase.rope_theta is not None:
            rope["rope_theta"] = phase.rope_theta
        if phase.rope_scaling is not None:
            rope["rope_scaling"] = phase.rope_scaling.model_dump(mode="json")
        long, by_domain = phase.long_documents, {}
        weights = phase.mixture or {name: d.weight for name, d in base.domains.items()}
        unknown = sorted(set(weights) - set(base.domains))
        if unknown:
            raise ConfigError(f"{where}[{i}].mixture: domains {unknown} are not in the mixture; known: "
                              f"{sorted(base.domains)}")
        total = sum(weights.values())
        domains = {}
        for name, weight in weights.items():
            train, ordered = base.domains[name].train, phase.order == "quality" and weight > 0
            if ordered:
                train = (quality_ordered(train, base.dtype, out_dir / SCHEDULE_DIR / phase.name / f"{name}.bin",
                                         f"{where}[{i}] ({phase.name!r}), domain {name!r}"),)
            elif long is not None and weight > 0:
                train, by_domain[name] = length_weighted(
                    train, base.dtype, long, out_dir / SCHEDULE_DIR / phase.name / f"{name}.bin",
                    f"{where}[{i}] ({phase.name!r}), domain {name!r}")
                train = (train,)
            domains[name] = DomainSource(weight=weight / total, train=train, val=(), ordered=ordered)
        built.append(Phase(name=phase.name, first_step=first, last_step=last, seq_len=seq_len, domains=domains,
                           rope=dict(rope) or None,
                           long_documents=None if long is None else long.model_dump() | {"by_domain": by_domain}))
    return Mixture(domains=base.domains, dtype=base.dtype, vocab_size=base.vocab_size, eos_id=base.eos_id,
                   phases=tuple(built))


@dataclass(frozen=True)
class NewBatch:
    """A delivered batch a run may draw from: its name and its train token shards per domain."""

    name: str
    train: dict[str, tuple[Path, ...]]


def batch_source(batch: str, domain: str) -> str:
    """The loader's name of a batch's documents of one domain (a source of the mixture)."""
    return f"{BATCH_PREFIX}{batch}/{domain}"


def _tokens(paths: tuple[Path, ...], dtype: str) -> int:
    return sum(p.stat().st_size for p in paths) // np.dtype(dtype).itemsize


def with_batches(mixture: Mixture, batches: Sequence[NewBatch], where: str = "train.batches") -> Mixture:
    """`mixture` with each batch's documents beside their domain's in every phase (and in the mixture of a
    run without phases), the domain's weight split by train tokens; a ConfigError for a batch of a
    domain the mixture lacks (its weight would be a new mixture's decision, not a batch's)."""
    if not batches:
        return mixture
    names = [b.name for b in batches]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: batch names {names} repeat; each batch joins once")
    for i, batch in enumerate(batches):
        unknown = sorted(set(batch.train) - set(mixture.domains))
        if unknown:
            raise ConfigError(f"{where}[{i}] (batch {batch.name!r}) holds domains {unknown} that the mixture lacks "
                              f"(it has {sorted(mixture.domains)}): a new domain needs a mixture that weighs it "
                              "(collect it into the corpus and run mix), not a batch")

    def joined(domains: dict[str, DomainSource]) -> dict[str, DomainSource]:
        out: dict[str, DomainSource] = {}
        for name, source in domains.items():
            parts = [(batch_source(b.name, name), b.train[name]) for b in batches if b.train.get(name)]
            counts = [_tokens(source.train, mixture.dtype)] + [_tokens(paths, mixture.dtype) for _, paths in parts]
            total = sum(counts) or 1
            out[name] = replace(source, weight=source.weight * counts[0] / total)
            out |= {part: DomainSource(weight=source.weight * count / total, train=paths, val=())
                    for (part, paths), count in zip(parts, counts[1:])}
        return out

    return Mixture(domains=joined(mixture.domains), dtype=mixture.dtype, vocab_size=mixture.vocab_size,
                   eos_id=mixture.eos_id, phases=tuple(replace(p, domains=joined(p.domains)) for p in mixture.phases))


def tokens_by_batch(tokens_by_phase: dict[str, dict[str, int]], batches: Sequence[str]) -> dict[str, dict[str, int]]:
    """The tokens each batch gave in each phase (over every domain), from the loader's per-source count."""
    out: dict[str, dict[str, int]] = {}
    for batch in batches:
        prefix = batch_source(batch, "")
        out[batch] = {phase: sum(t for source, t in by_source.items() if source.startswith(prefix))
                      for phase, by_source in tokens_by_phase.items()}
    return out


def _domain_weights(weights: dict[str, float]) -> dict[str, float]:
    """Weights by domain, each new batch's share (`batch/<name>/<domain>`) folded into its domain's."""
    out: dict[str, float] = {}
    for name, weight in weights.items():
        domain = name.split("/")[2] if name.startswith(BATCH_PREFIX) else name
        out[domain] = out.get(domain, 0.0) + weight
    return out


def upweighted_phases(phases: list[DataPhase], schedule: list[dict], from_step: int, weights: dict[str, float],
                      domain: str, factor: float = 2.0) -> list[dict]:
    """`train.phases` for an adjustment from `from_step` that trains the rest of the run on the mixture of
    the phase holding `from_step`, with `domain` weighted `factor` times (a domain at weight 0 gets the
    mean weight of the others): the phases before it as they ran, each ending at its last step, the one
    holding `from_step` ending there, then the new phase `more-<domain>` to the end.

    `schedule` is the running schedule's phases (`Phase.summary`: steps and weights), [] for a run
    without one; `weights` the mixture's domain weights (a run without phases trains on them)."""
    out: list[dict] = []
    current = dict(weights)
    for phase, ran in zip(phases, schedule):
        if ran["first_step"] > from_step:
            break
        entry = phase.model_dump(exclude_none=True, exclude_defaults=True, exclude={"name", "until_tokens"})
        out.append({"name": phase.name, **entry, "until_step": min(ran["last_step"], from_step)})
        current = ran["weights"]
    if not out:
        out = [{"name": "main", "until_step": from_step}]
    current = _domain_weights(current)
    others = [w for d, w in current.items() if d != domain and w > 0]
    boosted = current.get(domain, 0.0) * factor or (sum(others) / len(others) if others else 1.0)
    mixture = {d: round(boosted if d == domain else w, 4) for d, w in {**current, domain: 0.0}.items()}
    name, names = f"more-{domain}", {p["name"] for p in out}
    while name in names:
        name += "-2"
    new = {"name": name, "mixture": {d: w for d, w in mixture.items() if w > 0}}
    seq_len = out[-1].get("seq_len")
    return out + [new | ({"seq_len": seq_len} if seq_len else {})]
