"""Whether a task's score can be trusted at its level: its signal, its noise and how it behaves over training.

Pure functions over score series (Heineman et al. 2025, "Signal and Noise"; HF FineTasks; DataDecide):

- noise: the spread (standard deviation) of a task's score over the last `k` checkpoints of one run,
  over runs that differ only in their seed, and the standard error of one score over its items; the
  largest is the task's noise (a short run's last checkpoints still improve: that trend counts as noise);
- signal: the spread (max − min) of the score across different models (the sweep's proxies, or runs on
  different data): how far apart the models a decision must tell apart are;
- SNR: signal / noise;
- monotonicity: Spearman's rank correlation of score against training step (sign-adjusted, so 1 means
  "improves steadily" whether higher or lower is better);
- margin above random: how far the score is above chance (choice tasks: 1 / number of choices), in the
  direction that is better; None where chance is undefined (bits per byte);
- decision accuracy: of the pairs of runs compared at the small (sweep) size, the share whose order
  holds at the larger (validate) size.

`judge` holds the measures against the thresholds of the task's level (`TrustConfig`). A task below
them is `trusted: false` with the reasons: it stays in the report, and leaves the gate and the
regression alerts. A measure that could not be taken (too few checkpoints or models) is not held
against the task, and the report says it was not measured.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from itertools import combinations
from typing import Any

from pydantic import Field

from kiln.tasks.configbase import Section


TRUST_FILE = "trust.json"  # the evaluate stage's output: each task's trust measures and verdict


class LevelThresholds(Section):
    min_snr: float | None = Field(None, ge=0)
    min_monotonicity: float | None = Field(None, ge=-1, le=1)
    min_margin: float | None = None  # above random, in the score's own units


class TrustConfig(Section):
    """Thresholds per level (FineTasks used a Spearman of 0.5 and an SNR of 20 at 1B-scale; Kiln's default
    run is far smaller, so the defaults ask less) and how many last checkpoints measure the noise."""

    last_k: int = Field(3, ge=2)
    proxy: LevelThresholds = LevelThresholds(min_snr=2.0, min_monotonicity=0.5)
    mid: LevelThresholds = LevelThresholds(min_snr=2.0, min_monotonicity=0.5, min_margin=0.02)
    production: LevelThresholds = LevelThresholds(min_snr=1.0, min_monotonicity=0.0, min_margin=0.02)


@dataclass(frozen=True)
class Measures:
    noise: float | None = None
    signal: float | None = None
    snr: float | None = None
    monotonicity: float | None = None
    margin: float | None = None
    decision_accuracy: float | None = None
    constant: bool = False  # the same score on every checkpoint: it cannot tell models apart


@dataclass(frozen=True)
class Verdict:
    trusted: bool
    reasons: list[str] = field(default_factory=list)
    measures: Measures = Measures()

    def to_json(self) -> dict[str, Any]:
        return {"trusted": self.trusted, "reasons": self.reasons, **asdict(self.measures)}


def _std(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def checkpoint_noise(series: Sequence[tuple[int, float]], k: int) -> float | None:
    """Standard deviation of the scores of the last `k` checkpoints (by step); None with fewer than 2."""
    return _std([v for _, v in sorted(series)[-k:]])


def seed_noise(scores: Sequence[float]) -> float | None:
    """Standard deviation of one task's score over runs that differ only in their seed."""
    return _std(list(scores))


def signal(scores: Sequence[float]) -> float | None:
    """The spread of the score across different models (the sweep's proxies): max − min."""
    return max(scores) - min(scores) if len(scores) >= 2 else None


def snr(signal_value: float | None, noise_value: float | None) -> float | None:
    if signal_value is None or noise_value is None:
        return None
    if noise_value == 0:
        return math.inf if signal_value > 0 else None
    return signal_value / noise_value


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for m in range(i, j + 1):
            ranks[order[m]] = (i + j) / 2 + 1  # ties share their mean rank
        i = j + 1
    return ranks


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation; None with fewer than 3 points or a constant side."""
    if len(xs) < 3:
        return None
    rx, ry = _ranks(xs), _ranks(ys)
    sx, sy = _std(rx), _std(ry)
    if not sx or not sy:
        return None
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    return sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True)) / ((len(rx) - 1) * sx * sy)


def monotonicity(series: Sequence[tuple[int, float]], higher_is_better: bool) -> float | None:
    """Spearman of score against step, signed so that 1 is steady improvement."""
    steps, values = zip(*sorted(series), strict=True) if series else ((), ())
    rho = spearman(steps, values)
    return None if rho is None else (rho if higher_is_better else -rho)


def margin_above_random(score: float, chance: float | None, higher_is_better: bool) -> float | None:
    if chance is None:
        return None
    return score - chance if higher_is_better else chance - score


def decision_accuracy(small: Mapping[str, float], large: Mapping[str, float]) -> float | None:
    """Of the pairs of runs scored at both sizes, the share ordered the same at the small size as at the
    large one (pairs tied at the large size are left out; the direction of "better" does not matter: the
    same order is the same decision); None without such a pair."""
    names = sorted(set(small) & set(large))
    agree = total = 0
    for a, b in combinations(names, 2):
        if large[a] == large[b]:
            continue
        total += 1
        agree += (small[a] > small[b]) == (large[a] > large[b])
    if total == 0:
        return None
    return agree / total


def decision_accuracy_by_key(small: Mapping[str, Mapping[str, float]], large: Mapping[str, Mapping[str, float]]
                             ) -> dict[str, float | None]:
    """`decision_accuracy` of every score key (`"task/metric"`) that the runs scored at both sizes report:
    `small` and `large` map a run (a data choice: a mixture) to its scores at the small and the large size."""
    runs = sorted(set(small) & set(large))
    keys = dict.fromkeys(k for r in runs for k in small[r] if all(k in small[o] and k in large[o] for o in runs))
    return {key: decision_accuracy({r: small[r][key] for r in runs}, {r: large[r][key] for r in runs}) for key in keys}


def measure(checkpoints: Sequence[tuple[int, float]], higher_is_better: bool, k: int, *,
            seeds: Sequence[float] = (), models: Sequence[float] = (), chance: float | None = None,
            final: float | None = None, decision: float | None = None, item_stderr: float | None = None) -> Measures:
    """Every measure of one task from what the run has: its score over checkpoints, over seeds, across
    different models (proxies, or other data choices), its chance level, its final score and the standard
    error of that score over its items. The noise is the largest of the spreads measured."""
    noises = [n for n in (checkpoint_noise(checkpoints, k), seed_noise(seeds), item_stderr) if n is not None]
    noise_value = max(noises) if noises else None
    signal_value = signal(models)
    score = final if final is not None else (sorted(checkpoints)[-1][1] if checkpoints else None)
    values = [v for _, v in checkpoints]
    return Measures(noise=noise_value, signal=signal_value, snr=snr(signal_value, noise_value),
                    monotonicity=monotonicity(checkpoints, higher_is_better),
                    margin=None if score is None else margin_above_random(score, chance, higher_is_better),
                    decision_accuracy=decision, constant=len(values) >= 2 and len(set(values)) == 1)


def judge(measures: Measures, thresholds: LevelThresholds) -> Verdict:
    """Trusted unless a measure falls below its level's threshold; the reasons name each one."""
    reasons = []
    if measures.constant:
        reasons.append("the same score at every checkpoint: it cannot tell models apart")
    if thresholds.min_snr is not None and measures.snr is not None and measures.snr < thresholds.min_snr:
        reasons.append(f"SNR {measures.snr:.2f} < {thresholds.min_snr}")
    if (thresholds.min_monotonicity is not None and measures.monotonicity is not None
            and measures.monotonicity < thresholds.min_monotonicity):
        reasons.append(f"monotonicity (Spearman vs step) {measures.monotonicity:.2f} < {thresholds.min_monotonicity}")
    if thresholds.min_margin is not None and measures.margin is not None and measures.margin < thresholds.min_margin:
        reasons.append(f"margin above random {measures.margin:+.3f} < {thresholds.min_margin}")
    return Verdict(not reasons, reasons, measures)


def task_verdicts(series: Mapping[str, Sequence[tuple[int, float]]], infos: Mapping[str, Mapping[str, Any]],
                  cfg: TrustConfig) -> dict[str, Verdict]:
    """Each task's verdict from its score over training (`series`: (step, score), the checkpoints and the
    final models) and what its results say of it (`infos`: level, higher_is_better, chance, final score,
    the scores of different models, the standard error over items).
    A task with fewer than 3 scores over training is not measured, and so not trusted."""
    verdicts = {}
    for task, info in infos.items():
        points = sorted(series.get(task, ()))
        m = measure(points, info["higher_is_better"], cfg.last_k, chance=info.get("chance"), final=info.get("score"),
                    models=info.get("models", ()), item_stderr=info.get("item_stderr"), decision=info.get("decision"))
        verdict = judge(m, getattr(cfg, info["level"]))
        if len(points) < 3:
            verdict = Verdict(False, [*verdict.reasons, f"not measured: {len(points)} scores over training (needs 3)"], m)
        verdicts[task] = verdict
    return verdicts
