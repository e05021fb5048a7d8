"""Training and validation batches drawn from a mixture manifest's memory-mapped token shards.

A shard is a raw little-endian array of token ids (documents concatenated, each followed by
`eos_id`). A domain's shards are read as one concatenated stream. Training batches are a pure
function of (seed, step, row): each global row gets its own numpy Generator, so a resumed run
sees exactly the data it would have seen, and the same global batch is produced whatever the
world size (rank r of w owns rows r*B .. r*B+B-1).

A data schedule is a `Mixture` with `phases`: each phase trains steps up to its `last_step` on its
own sources (weights, shards) at its own sequence length. A phase's source may be `ordered` (a
curriculum: its train stream is written in the order it should be read, e.g. ascending quality
score): step k of an n-step phase then draws its windows from the k-th of n equal slices of that
stream, so the phase walks through it once, in order. Everything stays a pure function of (seed,
step, row): a run resumed inside a phase draws exactly what the uninterrupted run drew. What a
run has drawn so far (tokens per source per phase, `SourceTokens`) is kept in its checkpoints.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from kiln.tasks.errors import ConfigError, InputError

MANIFEST_FORMAT = 1
WEIGHT_TOLERANCE = 1e-6


@dataclass(frozen=True)
class DomainSource:
    """One domain's sampling weight and its train / validation shard files. `ordered`: the train
    stream is a curriculum, read slice by slice through its phase (see the module docstring)."""

    weight: float
    train: tuple[Path, ...]
    val: tuple[Path, ...]
    ordered: bool = False


@dataclass(frozen=True)
class Phase:
    """One phase of a data schedule: steps up to and including `last_step` (1-based) draw from
    `domains` by weight, windows of `seq_len` tokens."""

    name: str
    first_step: int
    last_step: int
    seq_len: int
    domains: dict[str, DomainSource]
    # the rotary settings in force from this phase on, when a phase (this one or an earlier one) changed
    # them: {"rope_theta": ..., "rope_scaling": RopeScaling's fields or None}; None: the model's own
    rope: dict | None = None
    # a length-aware selection: {"min_tokens", "upweight", "by_domain": {domain: {"long_documents",
    # "long_tokens", "other_tokens"}}} (see `tasks.train.data_schedule.length_weighted`)
    long_documents: dict | None = None

    @property
    def num_steps(self) -> int:
        return self.last_step - self.first_step + 1

    def summary(self) -> dict:
        """What a manifest, the stage stats and `mixture_history` record of the phase."""
        summary = {"name": self.name, "first_step": self.first_step, "last_step": self.last_step,
                   "seq_len": self.seq_len, "weights": {n: d.weight for n, d in self.domains.items() if d.weight > 0},
                   "ordered": sorted(n for n, d in self.domains.items() if d.ordered and d.weight > 0)}
        return summary | {k: v for k, v in (("rope", self.rope), ("long_documents", self.long_documents)) if v}


@dataclass(frozen=True)
class Mixture:
    """Domains to sample from, with the token dtype and vocabulary they were written with."""

    domains: dict[str, DomainSource]
    dtype: str
    vocab_size: int
    eos_id: int
    phases: tuple[Phase, ...] = ()  # a data schedule; empty: `domains` for every step

    def phase_at(self, step: int) -> Phase | None:
        """The phase that trains 1-based `step` (the last one past its end); None without a schedule."""
        for phase in self.phases:
            if step <= phase.last_step:
                return phase
        return self.phases[-1] if self.phases else None

    def for_phase(self, phase: Phase | None) -> Mixture:
        """The mixture one phase's steps draw from (this one itself without a schedule)."""
        if phase is None:
            return self
        return Mixture(domains=phase.domains, dtype=self.dtype, vocab_size=self.vocab_size, eos_id=self.eos_id)

    @classmethod
    def from_manifest(cls, manifest_path: Path, root: Path) -> Mixture:
        """Read a mix manifest; shard paths in it are relative to `root`."""
        try:
            raw = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise InputError(f"{manifest_path}: mixture manifest not found; run the mix stage first") from None
        except json.JSONDecodeError as e:
            raise InputError(f"{manifest_path}: not valid JSON ({e}); re-run the mix stage") from None

        def need(obj: dict, key: str, where: str) -> object:
            if key not in obj:
                raise InputError(f"{manifest_path}: missing key {where}{key!r}; re-run the mix stage")
            return obj[key]

        if need(raw, "format", "") != MANIFEST_FORMAT:
            raise InputError(
                f"{manifest_path}: manifest format {raw['format']!r} is not {MANIFEST_FORMAT}; "
                "re-run the mix stage with this version of Kiln"
            )
        dtype = str(need(raw, "dtype", ""))
        try:
            np.dtype(dtype)
        except TypeError:
            raise InputError(f"{manifest_path}: 'dtype' {dtype!r} is not a numpy dtype") from None
        domains_raw = need(raw, "domains", "")
        if not isinstance(domains_raw, dict) or not domains_raw:
            raise InputError(f"{manifest_path}: 'domains' must be a non-empty mapping of domain -> shards")

        def source(d: dict, where: str, splits: tuple[str, ...]) -> DomainSource:
            weight = float(need(d, "weight", where))
            if weight < 0:
                raise InputError(f"{manifest_path}: {where}weight is {weight}; weights must be >= 0")
            shards: dict[str, tuple[Path, ...]] = {"val": ()}
            for split in splits:
                paths = tuple(root / p for p in need(d, split, where))
                for p in paths:
                    if not p.is_file():
                        raise InputError(
                            f"{manifest_path}: {where}{split} shard {p} does not exist "
                            f"(paths are relative to {root}); re-run the tokenize stage or fix the root"
                        )
                shards[split] = paths
            if weight > 0 and not shards["train"]:
                raise InputError(f"{manifest_path}: {where}train is empty but the domain has weight {weight}")
            return DomainSource(weight=weight, train=shards["train"], val=shards["val"], ordered=bool(d.get("ordered")))

        def checked(domains: dict[str, DomainSource], where: str) -> dict[str, DomainSource]:
            total = sum(d.weight for d in domains.values())
            if abs(total - 1.0) > WEIGHT_TOLERANCE:
                weights = ", ".join(f"{n}={d.weight}" for n, d in domains.items())
                raise InputError(f"{manifest_path}: {where}weights sum to {total:.6g}, not 1 ({weights}); fix the mix")
            return domains

        domains = checked({name: source(d, f"domains.{name}.", ("train", "val"))
                           for name, d in domains_raw.items()}, "domain ")
        phases = []
        for i, p in enumerate(raw.get("phases", [])):
            where = f"phases[{i}]."
            phases.append(Phase(
                name=str(need(p, "name", where)), first_step=int(need(p, "first_step", where)),
                last_step=int(need(p, "last_step", where)), seq_len=int(need(p, "seq_len", where)),
                domains=checked({name: source(d, f"{where}domains.{name}.", ("train",))
                                 for name, d in need(p, "domains", where).items()}, f"{where}domain "),
                rope=p.get("rope"), long_documents=p.get("long_documents")))
        return cls(
            domains=domains,
            dtype=dtype,
            vocab_size=int(need(raw, "vocab_size", "")),
            eos_id=int(need(raw, "eos_id", "")),
            phases=tuple(phases),
        )


def write_manifest(mixture: Mixture, path: Path, root: Path) -> Path:
    """`mixture` as a manifest `Mixture.from_manifest(path, root)` reads back (shard paths relative to `root`)."""
    def relative(paths: tuple[Path, ...]) -> list[str]:
        return [str(p.resolve().relative_to(root.resolve())) for p in paths]

    def sources(domains: dict[str, DomainSource]) -> dict:
        return {name: {"weight": d.weight, "train": relative(d.train), "val": relative(d.val), "ordered": d.ordered}
                for name, d in domains.items()}

    manifest = {"format": MANIFEST_FORMAT, "dtype": mixture.dtype, "vocab_size": mixture.vocab_size,
                "eos_id": mixture.eos_id, "domains": sources(mixture.domains)}
    if mixture.phases:
        manifest["phases"] = [{"name": p.name, "first_step": p.first_step, "last_step": p.last_step,
                               "seq_len": p.seq_len, "domains": sources(p.domains),
                               **({"rope": p.rope} if p.rope else {}),
                               **({"long_documents": p.long_documents} if p.long_documents else {})}
                              for p in mixture.phases]
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def mixture_with_weights(shards: dict, shards_root: Path, weights: dict[str, float], where: str,
                         selections: dict[str, tuple[float, Path]] | None = None) -> Mixture:
    """A `Mixture` over the tokenize stage's shards (its `shards.json`, paths relative to `shards_root`)
    with the given unnormalised domain weights; a domain left out gets weight 0. `selections` adds
    components of (weight, train shard) without validation (the anneal's quality selections), all
    weights normalised together. `where` names the config key the weights came from, for errors."""
    unknown = sorted(set(weights) - set(shards["domains"]))
    if unknown:
        raise ConfigError(f"{where}: domains {unknown} are not in the corpus; known: {sorted(shards['domains'])}")
    selections = selections or {}
    total = sum(weights.values()) + sum(weight for weight, _ in selections.values())
    if total <= 0:
        raise ConfigError(f"{where}: weights must sum to more than 0")
    domains = {
        name: DomainSource(
            weight=weights.get(name, 0.0) / total,
            train=tuple(shards_root / shard["path"] for shard in split["train"]["shards"]),
            val=tuple(shards_root / shard["path"] for shard in split["val"]["shards"]),
        )
        for name, split in shards["domains"].items()
    }
    domains |= {name: DomainSource(weight=weight / total, train=(path,), val=())
                for name, (weight, path) in selections.items()}
    return Mixture(domains=domains, dtype=shards["dtype"], vocab_size=shards["vocab_size"], eos_id=shards["eos_id"])


@lru_cache(maxsize=512)
def _memmap(path: str, dtype: str, size: int, mtime_ns: int) -> np.ndarray:
    # size and mtime are part of the cache key so a rewritten file is never served stale
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


class _Stream:
    """A domain's shards read as one concatenated token array, without copying."""

    def __init__(self, paths: tuple[Path, ...], dtype: str) -> None:
        self.parts = []
        for p in paths:
            st = os.stat(p)
            if st.st_size % np.dtype(dtype).itemsize:
                raise InputError(f"{p}: size {st.st_size} bytes is not a whole number of {dtype} tokens")
            self.parts.append(_memmap(str(p), dtype, st.st_size, st.st_mtime_ns))
        self.ends = np.cumsum([len(a) for a in self.parts], dtype=np.int64)
        self.num_tokens = int(self.ends[-1]) if self.parts else 0

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, as int64."""
        i = int(np.searchsorted(self.ends, start, side="right"))
        begin = start - (int(self.ends[i - 1]) if i else 0)
        first = self.parts[i][begin : begin + length]
        if len(first) == length:
            return first.astype(np.int64)
        pieces, have = [first], len(first)
        while have < length:  # the window runs across a shard boundary
            i += 1
            piece = self.parts[i][: length - have]
            pieces.append(piece)
            have += len(piece)
        return np.concatenate(pieces).astype(np.int64)


def _train_streams(mixture: Mixture) -> tuple[list[str], np.ndarray, list[_Stream], list[bool]]:
    names = [n for n, d in mixture.domains.items() if d.weight > 0]
    weights = np.array([mixture.domains[n].weight for n in names], dtype=np.float64)
    cdf = np.cumsum(weights) / weights.sum()
    return (names, cdf, [_Stream(mixture.domains[n].train, mixture.dtype) for n in names],
            [mixture.domains[n].ordered for n in names])


def _row_draws(mixture: Mixture, seed: int, step: int, first_row: int, num_rows: int, seq_len: int,
               slot: tuple[int, int]) -> tuple[list[str], list[_Stream], list[tuple[int, int]]]:
    """The domain names, their streams, and (domain, window start) of each row: the random numbers
    `batch_for_step` and `batch_sources` share. An ordered domain's window lies in slice `slot[0]`
    of `slot[1]` of its stream; at slot (0, 1) that is the whole stream, drawn as an unordered one."""
    names, cdf, streams, ordered = _train_streams(mixture)
    for name, stream in zip(names, streams):
        if stream.num_tokens < seq_len + 1:
            raise InputError(
                f"domain {name!r} has {stream.num_tokens} train tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1}; give it weight 0 or more data"
            )
    k, n = slot
    out = []
    for r in range(first_row, first_row + num_rows):
        rng = np.random.default_rng((seed, step, r))
        d = min(int(np.searchsorted(cdf, rng.random(), side="right")), len(streams) - 1)
        span = streams[d].num_tokens - seq_len
        if ordered[d]:
            lo, hi = k * span // n, (k + 1) * span // n
            out.append((d, lo + int(rng.integers(0, max(1, hi - lo)))))
        else:
            out.append((d, int(rng.integers(0, span))))
    return names, streams, out


def draw_batch(
    mixture: Mixture, seed: int, step: int, rank: int, world_size: int, batch_size: int, seq_len: int,
    slot: tuple[int, int] = (0, 1),
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Inputs and next-token targets, each LongTensor [batch_size, seq_len], for one rank at one step,
    and the domain each row came from.

    Pure: depends only on the arguments and the shard contents. Each row picks a domain by weight
    (zero-weight domains never), then a uniformly random window of seq_len + 1 tokens in it (in an
    ordered domain, in the slice `slot` = (k, n): the k-th of n, for step k of an n-step phase).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    names, streams, draws = _row_draws(mixture, seed, step, rank * batch_size, batch_size, seq_len, slot)
    rows = np.empty((batch_size, seq_len + 1), dtype=np.int64)
    for r, (d, start) in enumerate(draws):
        rows[r] = streams[d].window(start, seq_len + 1)
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous(), [names[d] for d, _ in draws]


def batch_for_step(
    mixture: Mixture, seed: int, step: int, rank: int, world_size: int, batch_size: int, seq_len: int,
    slot: tuple[int, int] = (0, 1),
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw_batch` without the rows' domains."""
    x, y, _ = draw_batch(mixture, seed, step, rank, world_size, batch_size, seq_len, slot)
    return x, y


def batch_sources(
    mixture: Mixture, seed: int, step: int, rank: int, world_size: int, batch_size: int, seq_len: int,
    slot: tuple[int, int] = (0, 1),
) -> list[tuple[str, int]]:
    """(domain, first token offset in its train stream) of each row `batch_for_step` returns.

    Draws the same random numbers as `batch_for_step`, without reading tokens: it tells which
    data a step saw (the training loop records this for the batches it skips after a loss spike).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    names, _, draws = _row_draws(mixture, seed, step, rank * batch_size, batch_size, seq_len, slot)
    return [(names[d], start) for d, start in draws]


def validation_batches(
    mixture: Mixture, seq_len: int, eval_batches: int, batch_size: int
) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Fixed, evenly spaced windows of every domain's val shards, as `eval_batches` batches each.

    Every domain is included whatever its weight; one too short for a single window is skipped
    with a warning, one without validation shards (an anneal's quality selection) silently.
    """
    out: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    num_windows = eval_batches * batch_size
    for name, domain in mixture.domains.items():
        if not domain.val:
            continue
        stream = _Stream(domain.val, mixture.dtype)
        if stream.num_tokens < seq_len + 1:
            warnings.warn(
                f"domain {name!r}: validation has {stream.num_tokens} tokens, fewer than one window "
                f"of {seq_len + 1}; it is left out of validation loss",
                stacklevel=2,
            )
            continue
        starts = np.linspace(0, stream.num_tokens - seq_len - 1, num_windows).round().astype(np.int64)
        rows = torch.from_numpy(np.stack([stream.window(int(s), seq_len + 1) for s in starts]))
        out[name] = [
            (rows[i : i + batch_size, :-1].contiguous(), rows[i : i + batch_size, 1:].contiguous())
            for i in range(0, num_windows, batch_size)
        ]
    return out
