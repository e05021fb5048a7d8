"""Loss monitoring and self-healing: the pure policy, then real faults injected into real runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from kiln.tasks.errors import ConfigError, TrainingDivergedError
from kiln.tasks.train.callbacks import CallbackSpec
from kiln.tasks.train.config import HealthConfig, TrainRunConfig
from kiln.tasks.train.data_loader import Mixture, batch_for_step, batch_sources
from kiln.tasks.train.health import (
    EVENTS_FILE,
    Anomaly,
    SkipWindow,
    append_event,
    check_loss,
    data_index,
    lr_factor,
    read_events,
    rollback_bound,
    windows_from_events,
)
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.testing_faults import FaultInjection
from tests.tasks.train.test_train_loop import MODEL, OPTIM, RUN, write_mixture

CFG = HealthConfig(spike_zscore=6.0, spike_window=5, min_steps_before_check=3)
# checks from step 11 against the last 8 losses (a short window: this run's loss still falls fast);
# the clean run never trips it
# a short window, to judge steps early in a 30-step run; with it, clean steps score up to z = 6.4
# (step 23 after the rollback, measured) and the poisoned one 64: the threshold sits between
WATCHED = RUN.model_copy(update={"health": HealthConfig(spike_window=8, min_steps_before_check=10, spike_zscore=10.0)})
BAD_STEP = 22  # poisoned: its batch (index 21) becomes one token id the data never holds


# --- the monitor -------------------------------------------------------------------------------


def test_nonfinite_loss_is_an_anomaly_at_any_step() -> None:
    for loss in (float("nan"), float("inf")):
        a = check_loss(1, loss, [], CFG)
        assert a is not None and a.kind == "nonfinite" and a.step == 1 and a.zscore is None


def _power_law(seed: int, noise: float = 0.03, steps: int = 300) -> list[tuple[int, float]]:
    """loss = 2 + 8 / sqrt(step) plus Gaussian noise: steep at first, flattening later."""
    s = np.arange(1, steps + 1)
    loss = 2 + 8 * s**-0.5 + np.random.default_rng(seed).normal(0, noise, steps)
    return list(zip(s.tolist(), loss.tolist()))


def _anomalies(curve: list[tuple[int, float]], cfg: HealthConfig = HealthConfig()) -> list[Anomaly]:
    """Walk a curve as the loop does: each loss against the accepted ones before it; a rejected
    loss is not accepted (the loop would roll back and replace it)."""
    accepted: list[tuple[int, float]] = []
    found = []
    for step, loss in curve:
        anomaly = check_loss(step, loss, accepted[-cfg.spike_window :], cfg)
        if anomaly is None:
            accepted.append((step, loss))
        else:
            found.append(anomaly)
    return found


def _old_zscore(loss: float, window: list[float]) -> float:
    """The median/MAD z-score the trend baseline replaced."""
    median = float(np.median(window))
    scale = max(1.4826 * float(np.median(np.abs(np.asarray(window) - median))), 0.01 * median)
    return (loss - median) / scale


def test_spike_zscore_is_measured_against_the_trend_in_log_step() -> None:
    # loss = 4 - 0.25 * log2(step) at steps 2, 4, ..., 64, off the line by +0.05, -0.05, ... in turn:
    # the Theil-Sen line is exactly that line and the residuals' MAD is 0.05
    history = [(2**k, 4 - 0.25 * k + 0.05 * (-1) ** (k + 1)) for k in range(1, 7)]
    cfg = HealthConfig(spike_window=6, min_steps_before_check=3)
    stale = [(1, 100.0)]  # older than the window: ignored
    prediction = 4 - 0.25 * 7  # at step 128
    # widened by the line's own uncertainty there: 1/n + (x_new - mean x)^2 / sum (x - mean x)^2
    scale = 1.4826 * 0.05 * math.sqrt(1 + 1 / 6 + 3.5**2 / 17.5)
    a = check_loss(128, prediction + 6.5 * scale, stale + history, cfg)
    assert a is not None and a.kind == "spike" and a.step == 128
    assert a.zscore == pytest.approx(6.5) and a.median == pytest.approx(prediction)
    assert check_loss(128, prediction + 5.9 * scale, stale + history, cfg) is None
    assert check_loss(128, 0.1, history, cfg) is None  # far below: progress, not a fault


def test_trend_check_waits_for_min_steps_and_history() -> None:
    history = [(1, 2.0), (2, 2.1), (3, 1.9)]
    assert check_loss(3, 50.0, history, CFG) is None  # step 3 <= min_steps_before_check
    assert check_loss(4, 50.0, history, CFG).kind == "spike"
    assert check_loss(4, 50.0, history[:2], CFG) is None  # too little history for a trend


def test_flat_noise_free_trend_has_a_noise_floor() -> None:
    flat = [(s, 1.0) for s in range(5, 10)]  # slope 0, residuals 0: the scale is 1% of the prediction
    assert check_loss(10, 1.05, flat, CFG) is None  # z = 5
    assert check_loss(10, 1.07, flat, CFG).zscore == pytest.approx(7.0)


def test_nonfinite_is_caught_after_history_and_nothing_when_disabled() -> None:
    history = _power_law(0)[:100]
    for loss in (float("nan"), float("inf"), float("-inf")):
        a = check_loss(101, loss, history, HealthConfig())
        assert a is not None and a.kind == "nonfinite" and a.zscore is None and a.median is None
        assert check_loss(101, loss, history, HealthConfig(enabled=False)) is None
    assert check_loss(101, 100.0, history, HealthConfig(enabled=False)) is None


def test_no_false_positives_on_a_steeply_falling_power_law() -> None:
    for seed in range(5):
        assert _anomalies(_power_law(seed)) == []


@pytest.mark.parametrize("bad_step", [30, 45, 60])
def test_spike_during_the_steep_fall_is_caught_where_the_median_missed_it(bad_step: int) -> None:
    curve = _power_law(seed=1)
    step, loss = curve[bad_step - 1]
    spike = 1.5 * loss  # the loss jumps by half
    window = [v for _, v in curve[: bad_step - 1][-HealthConfig().spike_window :]]
    # the window's median is far above the still-falling loss, so the old detector saw nothing
    assert _old_zscore(spike, window) < HealthConfig().spike_zscore
    curve[bad_step - 1] = (step, spike)
    (anomaly,) = _anomalies(curve)
    assert anomaly.step == bad_step and anomaly.kind == "spike" and anomaly.zscore > 6
    # the trend's prediction is close to the loss the step should have had (the window's median is not)
    assert anomaly.median == pytest.approx(2 + 8 / math.sqrt(bad_step), rel=0.05)


def test_no_false_positives_on_plateaus_noise_and_a_warmup_bump() -> None:
    s = np.arange(1, 301)
    bump_up = np.clip((s - 150) / 20, 0, 1) * 0.15  # an LR re-warmup at step 150: +0.15 over 20 steps
    rewarmup = np.where(s <= 170, bump_up, 0.15 * np.exp(-(s - 170) / 20))  # then it decays back
    for seed in range(3):
        noise = np.random.default_rng(seed).normal(0, 0.02, len(s))
        curves = {
            "falls then plateaus": 2 + 8 * np.exp(-s / 15) + noise,
            "flat noise": 3 + 2.5 * noise,
            "flat, almost noise-free": 3 + 0.05 * noise,
            "sudden 2% jump that fades": 2 + 8 * s**-0.5 + np.where(s >= 150, 0.05 * np.exp(-(s - 150) / 10), 0)
            + noise,
            "LR re-warmup bump": 2 + 8 * s**-0.5 + rewarmup + noise,
        }
        for name, loss in curves.items():
            assert _anomalies(list(zip(s.tolist(), loss.tolist()))) == [], (name, seed)


# --- the rollback policy -----------------------------------------------------------------------


def test_skip_windows_remap_data_and_lr() -> None:
    first = SkipWindow(first_step=11, last_step=15, data_offset=30, lr_factor=0.5, lr_last_step=12)
    second = SkipWindow(first_step=11, last_step=13, data_offset=60, lr_factor=0.25, lr_last_step=11)
    assert [data_index(s, [first]) for s in (10, 11, 15, 16)] == [9, 40, 44, 15]
    # the later window wins where both cover a step
    assert [data_index(s, [first, second]) for s in (11, 13, 14)] == [70, 72, 43]
    assert [lr_factor(s, [first, second]) for s in (10, 11, 12, 13)] == [1.0, 0.25, 0.5, 1.0]


def test_rollback_bound_moves_below_a_checkpoint_that_fails_at_once() -> None:
    assert rollback_bound(25, []) == 25
    window = SkipWindow(first_step=21, last_step=25, data_offset=30, lr_factor=1.0, lr_last_step=20)
    assert rollback_bound(23, [window]) == 23  # the restored checkpoint ran fine for a while
    assert rollback_bound(21, [window]) == 20  # its very first step failed: it is suspect too


def test_events_round_trip_and_give_back_windows(tmp_path) -> None:
    path = tmp_path / EVENTS_FILE
    assert read_events(path) == []
    window = {"first_step": 3, "last_step": 4, "data_offset": 9, "lr_factor": 1.0, "lr_last_step": 2}
    append_event(path, {"action": "rollback", "step": 4, "loss": "nan", "window": window})
    append_event(path, {"action": "abort", "step": 5, "loss": 9.0})
    events = read_events(path)
    assert [e["action"] for e in events] == ["rollback", "abort"]
    assert windows_from_events(events) == [SkipWindow(**window)]
    with pytest.raises(ValueError):  # strict JSON: callers turn non-finite floats into strings
        append_event(path, {"loss": float("nan")})


def test_health_settings_are_runtime_only() -> None:
    noisy = TrainRunConfig(health=HealthConfig(spike_zscore=3.0, max_rollbacks=0, enabled=False))
    assert noisy.identity() == TrainRunConfig().identity()


# --- real runs ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Mixture:
    return write_mixture(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def clean(mixture, tmp_path_factory):
    return train_model(MODEL, OPTIM, WATCHED, mixture, tmp_path_factory.mktemp("clean"))


@pytest.fixture(scope="module")
def healed(mixture, tmp_path_factory):
    out = tmp_path_factory.mktemp("healed")
    seen: list[dict] = []
    result = train_model(MODEL, OPTIM, WATCHED, mixture, out, on_event=seen.append,
                         callbacks=[FaultInjection(poison_data_index=[BAD_STEP - 1])])
    return out, result, seen


def test_batch_sources_name_the_rows_batch_for_step_returns(mixture) -> None:
    x, y = batch_for_step(mixture, 3, 7, 1, 2, 4, 16)
    sources = batch_sources(mixture, 3, 7, 1, 2, 4, 16)
    assert len(sources) == 4
    for row, (domain, offset) in enumerate(sources):
        tokens = np.fromfile(mixture.domains[domain].train[0], dtype="<u2").astype(np.int64)
        assert torch.equal(x[row], torch.from_numpy(tokens[offset : offset + 16]))
        assert torch.equal(y[row], torch.from_numpy(tokens[offset + 1 : offset + 17]))


def test_monitor_leaves_a_clean_run_bit_identical(clean, mixture, tmp_path) -> None:
    unwatched = RUN.model_copy(update={"health": HealthConfig(enabled=False)})
    plain = train_model(MODEL, OPTIM, unwatched, mixture, tmp_path)
    # bit for bit: the monitor only reads the run, and a fresh run on one machine repeats exactly
    assert clean.loss_curve == plain.loss_curve and clean.val_loss_by_domain == plain.val_loss_by_domain
    assert clean.num_rollbacks == 0 and clean.health_events == []
    assert not (tmp_path / EVENTS_FILE).exists()


def test_poisoned_batch_is_detected_rolled_back_and_skipped(healed, clean, mixture) -> None:
    out, result, seen = healed
    assert result.num_rollbacks == 1
    (event,) = result.health_events
    assert seen == [event] == read_events(out / EVENTS_FILE)
    assert event["action"] == "rollback" and event["kind"] == "spike" and event["step"] == BAD_STEP
    # the model has never seen token 63: measured 3.68 against 0.81 for the step's clean batch
    assert event["loss"] > 4 * clean.loss_curve[BAD_STEP - 1][1] and event["zscore"] > 10.0
    assert event["rolled_back_to"] == 20 and event["deleted_checkpoints"] == []
    # steps 21-22 re-ran on batches 51-52 (offset 30 = the run's length: indices it never uses)
    assert event["window"] == {"first_step": 21, "last_step": 22, "data_offset": 30, "lr_factor": 1.0,
                               "lr_last_step": 20}
    skipped = event["skipped_data"]
    assert skipped["data_indices"] == [[20, 21]]
    assert skipped["bad_batch"] == [list(r) for r in batch_sources(mixture, 0, 21, 0, 1, 4, 16)]
    assert sum(skipped["rows_by_domain"].values()) == 8 and set(skipped["rows_by_domain"]) <= {"web", "code"}
    assert 0 <= event["time_to_resume_s"] < 5
    # identical up to the checkpoint, different (fresh data) after it, and as good at the end
    assert [s for s, _ in result.loss_curve] == list(range(1, 31))
    assert result.loss_curve[:20] == clean.loss_curve[:20]
    assert result.loss_curve[20] != clean.loss_curve[20]
    assert all(math.isfinite(loss) and loss < 2.0 for _, loss in result.loss_curve[20:])
    assert result.final_train_loss == pytest.approx(clean.final_train_loss, rel=0.15)
    assert result.val_loss == pytest.approx(clean.val_loss, rel=0.15)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000020", "step_0000030"]
    assert json.loads((out / "metrics.json").read_text())["health_events"] == [event]
    assert (out / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"


class Crash(Exception):
    """Stands in for the process dying mid-run."""


def test_crash_after_a_rollback_resumes_with_the_same_skipped_data(healed, mixture, tmp_path) -> None:
    _, full, _ = healed

    def crash_at_25(step: int, metrics: dict[str, float]) -> None:
        if step == 25:
            raise Crash

    faults = [FaultInjection(poison_data_index=[BAD_STEP - 1])]
    with pytest.raises(Crash):
        train_model(MODEL, OPTIM, WATCHED.model_copy(update={"log_every": 5}), mixture, tmp_path,
                    on_metrics=crash_at_25, callbacks=faults)
    # the restarted process still meets the bad data (the fault is "on disk"); the recorded
    # window sends it around that data, so nothing is detected again
    resumed = train_model(MODEL, OPTIM, WATCHED, mixture, tmp_path, callbacks=faults)
    assert resumed.resumed_from_step == 20
    assert resumed.loss_curve == full.loss_curve
    # the event is the one the crashed attempt wrote (only its timing differs from the full run's)
    timeless = [{k: v for k, v in e.items() if k != "time_to_resume_s"}
                for e in (*resumed.health_events, *full.health_events)]
    assert timeless[0] == timeless[1] and resumed.num_rollbacks == 1


def test_lowered_lr_after_rollback(clean, mixture, tmp_path) -> None:
    health = WATCHED.health.model_copy(update={"rollback_lr_factor": 0.5, "rollback_lr_steps": 3})
    run = WATCHED.model_copy(update={"health": health})
    result = train_model(MODEL, OPTIM, run, mixture, tmp_path, callbacks=[FaultInjection(poison_data_index=[BAD_STEP - 1])])
    (event,) = result.health_events
    assert event["window"]["lr_last_step"] == 23
    clean_lr, lr = dict(clean.lr_curve), dict(result.lr_curve)
    # the 3 steps after the checkpoint at 20 run at half the scheduled rate, then it resumes
    assert [lr[s] for s in (20, 21, 23, 24)] == [clean_lr[20], clean_lr[21] * 0.5, clean_lr[23] * 0.5, clean_lr[24]]


def test_persistent_fault_exhausts_rollbacks_and_raises(mixture, tmp_path) -> None:
    run = WATCHED.model_copy(update={"health": WATCHED.health.model_copy(update={"max_rollbacks": 2})})
    seen: list[dict] = []
    # a 1e4x learning rate at step 22 wrecks the weights every time step 22 runs
    with pytest.raises(TrainingDivergedError, match="still bad after 2 rollbacks") as err:
        train_model(MODEL, OPTIM, run, mixture, tmp_path, on_event=seen.append,
                    callbacks=[FaultInjection(lr_multiplier={22: 1e4})])
    assert [e["action"] for e in err.value.events] == ["rollback", "rollback", "abort"]
    assert seen == err.value.events == read_events(tmp_path / EVENTS_FILE)
    assert [e["step"] for e in seen] == [23, 23, 23]  # the loss after the wrecking update
    assert [e["rolled_back_to"] for e in seen[:2]] == [20, 20]
    assert [e["window"]["data_offset"] for e in seen[:2]] == [30, 60]
    assert (tmp_path / "loss_curve.png").exists() and not (tmp_path / "metrics.json").exists()


def test_no_checkpoint_before_the_bad_step_restarts_from_initialisation(mixture, tmp_path) -> None:
    health = HealthConfig(max_rollbacks=1)
    run = RUN.model_copy(update={"steps": 12, "checkpoint_every": 100, "health": health})
    with pytest.raises(TrainingDivergedError) as err:
        train_model(MODEL, OPTIM, run, mixture, tmp_path, callbacks=[FaultInjection(lr_multiplier={3: float("nan")})])
    rollback, abort = err.value.events
    # the NaN update at step 3 shows in step 4's loss; no checkpoint yet, so back to the start
    assert rollback["kind"] == "nonfinite" and rollback["step"] == 4 and rollback["loss"] == "nan"
    assert rollback["zscore"] is None and rollback["rolled_back_to"] == 0
    assert rollback["window"]["first_step"] == 1 and rollback["skipped_data"]["data_indices"] == [[0, 3]]
    assert abort["action"] == "abort" and abort["step"] == 4


def test_unknown_fault_is_rejected() -> None:
    with pytest.raises(ConfigError, match="flip_bits"):
        CallbackSpec.of(FaultInjection, flip_bits=1).build()


def test_compile_with_activation_checkpointing_is_refused_clearly():
    import pytest

    from kiln.tasks.train.config import TrainRunConfig

    with pytest.raises(ValueError, match="activation_checkpointing='selective' cannot be combined with run.compile"):
        TrainRunConfig(activation_checkpointing="selective", compile=True)
