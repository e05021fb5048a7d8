"""The sweep: each trial a sub-run; failed trials are results the fit leaves out, interrupted sweeps resume,
dead workers are named and their trials retried on their own, the design grows to the regression's minimum."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kiln.tasks.constants import SHARDS_FILE
from kiln.tasks.ledger import StageRecorder, SubRuns
from kiln.tasks.scaling.fit import excluded, law_points
from kiln.tasks.scaling.mixture_regression import minimum_trials
from kiln.tasks.scaling.sweep import (
    TRIALS_DIR,
    TRIALS_FILE,
    IsoFlopBudget,
    MixtureDesign,
    SweepConfig,
    SweepFailedError,
    TrialResult,
    design_trials,
    failed_result,
    failure_record,
    load_trials,
    run_sweep,
    sampled_mixtures,
    train_trial,
    trial_result,
    trial_subrun,
)
from kiln.tasks.scaling.trial_runs import PoolTrials
from kiln.tasks.stage import StageContext
from kiln.tasks.stages import sweep as sweep_stage
from kiln.tasks.store import Store
from kiln.tasks.tracker import NullTracker
from kiln.tasks.train.config import ModelConfig, TrainRunConfig
from tests.tasks.scaling.sweep_fakes import POISON_LR, fake_trial


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[dict, Path]:
    """The tokenize stage's `shards.json` and its root: two domains of random tokens."""
    root = tmp_path_factory.mktemp("tokenize")
    shards: dict = {"dtype": "uint16", "vocab_size": 64, "eos_id": 0, "domains": {}}
    for i, domain in enumerate(("web", "code")):
        rng = np.random.default_rng(i)
        (root / domain).mkdir()
        rng.integers(1, 64, 4000).astype("<u2").tofile(root / domain / "train.bin")
        rng.integers(1, 64, 200).astype("<u2").tofile(root / domain / "val.bin")
        shards["domains"][domain] = {"train": {"shards": [{"path": f"{domain}/train.bin"}], "num_tokens": 4000},
                                     "val": {"shards": [{"path": f"{domain}/val.bin"}]}}
    return shards, root


def subruns(out: Path, tracker=None) -> SubRuns:
    return SubRuns(StageRecorder(tracker or NullTracker(), "stage-run", "sweep", "k"), out)


def tiny(lr: float = 1e-3, multipliers: tuple[float, ...] = (1.0,), max_parallel: int = 1, **updates) -> SweepConfig:
    """One budget with one width, an LR grid of `multipliers` at it, and one named mixture (no samples).

    The IsoFLOP trial is the mixture trial too (same width, LR, batch and steps: one trial)."""
    return SweepConfig(**{
        "model": ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=16), "lr": lr, "lr_width_exponent": 0.0,
        "isoflop": [IsoFlopBudget(flops=6 * PARAMS_W16 * 12 * 4 * 16, widths=[16])],
        "lr_multipliers": list(multipliers), "mixtures": {"u": {"web": 1, "code": 1}},
        "mixture_design": MixtureDesign(num_samples=0), "max_parallel": max_parallel,
        "run": TrainRunConfig(steps=12, batch_size=4, seq_len=16, eval_batches=1, checkpoint_every=1000), **updates})


PARAMS_W16 = 1 * (4 * 16 * 16 + 3 * 16 * 64 + 2 * 16) + 16 + 64 * 16  # one layer, the final norm, the embedding


def test_a_diverging_trial_is_recorded_and_the_fit_uses_the_rest(shards, tmp_path):
    # two worker processes: the divergence (the x1e7 LR of the second phase) happens in one and comes back as data
    seen: list[str] = []
    results = run_sweep(tiny(1e-3, (1.0, 1e7), max_parallel=2), *shards, subruns(tmp_path), where=PoolTrials(2),
                        on_trial=lambda r, resumed: seen.append(r.name))
    ok, bad = results
    assert (ok.kind, bad.kind) == ("isoflop", "hyper") and ok.steps == 12 and ok.num_params == PARAMS_W16
    assert (ok.status, ok.reason) == ("ok", None) and len(ok.loss_curve) == 12
    assert bad.status == "diverged" and "TrainingDivergedError" in bad.reason and bad.val_loss is None
    assert bad.steps < 12  # where the loss went non-finite (the steps it reached before giving up)
    assert sorted(seen) == sorted(r.name for r in results)
    assert load_trials(tmp_path / TRIALS_FILE) == results  # every trial, failures included, in design order
    # both are committed sub-runs, each with its result as its manifest's stats: a divergence is final, not retried
    for result in results:
        manifest = Store(tmp_path).manifest(TRIALS_DIR, result.name)
        assert (manifest["subrun"], manifest["stats"]["status"]) == (f"trials/{result.name}", result.status)
        assert trial_result(manifest["stats"]) == result
    assert excluded(results) == {bad.name: {"status": "diverged", "reason": bad.reason, "steps": bad.steps}}
    assert [p["trial"] for p in law_points(results, "u")] == [ok.name]


def test_an_interrupted_sweep_reruns_only_unfinished_and_failed_trials(shards, tmp_path, capsys):
    cfg = tiny(1e-3, (1.0, 2.0, 3.0))
    first = design_trials(cfg, 64)
    assert len(first) == 1
    names = [first[0].name] + [f"w16-lr{lr:.3g}-bs4-s12-u" for lr in (2e-3, 3e-3)]

    def interrupt(result: TrialResult, resumed: bool) -> None:
        raise KeyboardInterrupt  # as Ctrl-C right after the first trial finished

    with pytest.raises(KeyboardInterrupt):
        run_sweep(cfg, *shards, subruns(tmp_path), where=PoolTrials(cfg.max_parallel), on_trial=interrupt)
    store = Store(tmp_path)
    assert store.is_complete(TRIALS_DIR, names[0]) and not store.is_complete(TRIALS_DIR, names[1])
    # the third trial failed in a previous attempt (say, killed): its partial folder says so; it is run again
    store.begin(TRIALS_DIR, names[2], resumable=True)
    store.record_failure(TRIALS_DIR, names[2], failure_record(TrialResult(
        names[2], 16, 3e-3, "u", 4, 1, 1, None, None, {}, 0, 0.0, status="failed", reason="its worker process died",
        kind="hyper")))
    calls: list[tuple[str, bool]] = []
    capsys.readouterr()
    results = run_sweep(cfg, *shards, subruns(tmp_path), where=PoolTrials(cfg.max_parallel),
                        on_trial=lambda r, resumed: calls.append((r.name, resumed)))
    assert calls == [(names[0], True), (names[1], False), (names[2], False)]
    # a progress line per phase (kept trials counted as done); the trials' training reports nothing of its own
    assert [line.split(", ")[0] for line in capsys.readouterr().err.splitlines()] == [
        "sweep (IsoFLOP and mixture trials): 1/1 trials (100%)", "sweep (LR x batch trials): 2/2 trials (100%)"]
    assert [r.status for r in results] == ["ok"] * 3
    assert all(store.is_complete(TRIALS_DIR, name) for name in names)


def test_every_trial_failing_fails_the_sweep_clearly(shards, tmp_path):
    with pytest.raises(SweepFailedError, match=r"every sweep trial failed \(1 diverged\).*smaller sweep.lr"):
        run_sweep(tiny(1e4), *shards, subruns(tmp_path), where=PoolTrials(1))


def test_a_trial_that_kills_its_worker_is_retried_alone_then_named_and_the_rest_finish(shards, tmp_path):
    cfg = tiny(1.0, (1.0, POISON_LR, 10.0), max_parallel=2)
    results = run_sweep(cfg, *shards, subruns(tmp_path), where=PoolTrials(2, max_restarts=1, trial_fn=fake_trial))
    assert [r.status for r in results] == ["ok", "failed", "ok"]
    assert "worker process died" in results[1].reason
    store = Store(tmp_path)
    # the failed trial is recorded in its partial folder, uncommitted: the stage's next attempt runs it again
    assert not store.is_complete(TRIALS_DIR, results[1].name)
    assert failed_result(store.failure(TRIALS_DIR, results[1].name)) == results[1]
    # the trials its dead pool took down with it were retried alone, and committed
    assert [len(store.manifest(TRIALS_DIR, results[i].name)["launch"]["attempts"]) for i in (0, 2)] in ([1, 1], [1, 2])


def test_the_mixture_design_grows_to_the_regressions_minimum():
    """Five domains need 25 mixture trials (5 a domain); the named `uniform` is the IsoFLOP trial already, so
    `heavy` and 24 samples (18 asked) make them."""
    domains = ("web", "code", "prose", "multilingual", "reference")
    cfg = tiny(mixtures={"uniform": dict.fromkeys(domains, 1), "heavy": {**dict.fromkeys(domains, 1), "prose": 3}},
               mixture_design=MixtureDesign(num_samples=18))
    mixture = [t for t in design_trials(cfg, 64, mixture_folds=5) if t.kind == "mixture"]
    assert len(mixture) == minimum_trials(5, 5) == 25
    assert [t.mixture for t in mixture[:2]] == ["heavy", "dirichlet00"] and mixture[-1].mixture == "dirichlet23"
    # a larger design keeps the smaller one's samples (one seeded sequence)
    assert list(sampled_mixtures(cfg, 24).values())[:18] == list(sampled_mixtures(cfg, 18).values())
    # more folds need more trials (4 a fold); num_samples: 0 wants no regression and gets none
    assert sum(t.kind == "mixture" for t in design_trials(cfg, 64, mixture_folds=8)) == 32 == minimum_trials(5, 8)
    none = cfg.model_copy(update={"mixture_design": MixtureDesign(num_samples=0)})
    assert [t.mixture for t in design_trials(none, 64) if t.kind == "mixture"] == ["heavy"]


class RecordingTracker(NullTracker):
    def __init__(self) -> None:
        self.runs: dict[str, dict] = {}

    def start_run(self, name, *, parent_id=None, tags=None, params=None) -> str:
        self.runs[name] = {"parent": parent_id, "tags": dict(tags or {}), "metrics": [], "failed": None}
        return name

    def log_metrics(self, run_id, metrics, step=None) -> None:
        self.runs[run_id]["metrics"].append((step, dict(metrics)))

    def end_run(self, run_id, *, failed=False) -> None:
        self.runs[run_id]["failed"] = failed

    def set_tags(self, run_id, tags) -> None:
        self.runs[run_id]["tags"].update(tags)


def test_the_stage_records_each_trial_as_a_child_run_and_a_diverged_one_as_failed(shards, tmp_path):
    shards_json, root = shards
    (root / SHARDS_FILE).write_text(json.dumps(shards_json))
    tracker = RecordingTracker()
    cfg = SimpleNamespace(sweep=tiny(1e-3, (1.0, 1e7), run=TrainRunConfig(
        steps=12, batch_size=4, seq_len=16, eval_batches=1, checkpoint_every=1000, log_every=5)),
        cluster=SimpleNamespace(launcher="local", max_restarts=2), fit=SimpleNamespace(mixture_folds=5))
    ctx = StageContext(cfg, tmp_path, {"tokenize": root}, Store(tmp_path / "store"),
                       StageRecorder(tracker, "stage-run", "sweep", "k"))
    stats = sweep_stage.run(ctx)
    assert sweep_stage.STAGE.resumable
    assert (stats["num_trials"], stats["num_ok"], stats["num_diverged"]) == (2, 1, 1)
    assert sweep_stage.headline(stats)["not_finished"] == 1
    ok, bad = (tracker.runs[n] for n in ("w16-lr0.001-bs4-s12-u", "w16-lr1e+04-bs4-s12-u"))
    assert ok["parent"] == bad["parent"] == "stage-run"
    assert (ok["failed"], ok["tags"]["kiln.trial.status"], ok["tags"]["kiln.subrun"]) == (False, "ok", "trials")
    assert [step for step, m in ok["metrics"] if "train.loss" in m] == [5, 10, 12]  # the curve, at log_every
    assert bad["failed"] is True and bad["tags"]["kiln.trial.status"] == "diverged"
    assert (ok["tags"]["kiln.trial.kind"], bad["tags"]["kiln.trial.kind"]) == ("isoflop", "hyper")
    assert "TrainingDivergedError" in bad["tags"]["kiln.trial.reason"]
    assert "val_loss" not in bad["metrics"][-1][1] and "steps" in bad["metrics"][-1][1]


def test_a_trial_its_worker_committed_is_never_trained_again(shards, tmp_path):
    """The committed sub-run is the one record of a finished trial: a worker that died after committing
    (before it could report) leaves nothing to redo, and the stage's next attempt reuses the trial from its
    manifest alone."""
    cfg = tiny(1e-3)
    trial = design_trials(cfg, 64)[0]
    runs = subruns(tmp_path)
    sub = trial_subrun(trial)
    _, recorder = runs.begin(sub)
    opened = runs.opened(sub, recorder)
    result = fake_trial(cfg, trial, None, opened.folder)
    assert train_trial(lambda *_: result, cfg, trial, None, opened, "local") == result
    manifest = opened.committed()
    assert trial_result(manifest["stats"]) == result and manifest["launch"]["launcher"] == "local"

    def must_not_train(*_):
        raise AssertionError("a committed trial was trained again")

    assert train_trial(must_not_train, cfg, trial, None, opened, "local") == result
    seen: list[tuple[str, bool]] = []
    again = run_sweep(cfg, *shards, subruns(tmp_path), where=PoolTrials(1, trial_fn=must_not_train),
                      on_trial=lambda r, resumed: seen.append((r.name, resumed)))
    assert again == [result] and seen == [(trial.name, True)]
    assert load_trials(tmp_path / TRIALS_FILE) == [result]


def test_failure_advice_tells_infrastructure_from_divergence():
    """A trial whose job died is no diverged trial (issue 37): no smaller sweep.lr for it."""
    from types import SimpleNamespace

    from kiln.tasks.scaling.sweep import failure_advice

    died = failure_advice([SimpleNamespace(status="failed")] * 3)
    assert "3 failed without a result" in died and "infrastructure, not divergence" in died and "sweep.lr" not in died
    both = failure_advice([SimpleNamespace(status="diverged"), SimpleNamespace(status="failed")])
    assert both.startswith("1 diverged: a diverging sweep wants a smaller sweep.lr") and "1 failed" in both
