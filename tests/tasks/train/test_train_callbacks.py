"""The loop's hooks: when each is called, how a callback travels to another process, what is refused."""

from __future__ import annotations

import pytest

import kiln.tasks.progress
from kiln.tasks.errors import ConfigError
from kiln.tasks.train.callbacks import CallbackSpec
from kiln.tasks.train.data_loader import Mixture
from kiln.tasks.train.loop import train_model
from kiln.tasks.train.testing_faults import FaultInjection
from kiln.tasks.train.trainer import Hooks, TrainCallback
from tests.tasks.train.test_train_loop import MODEL, OPTIM, RUN, write_mixture


class Recorder(TrainCallback):
    """Writes down every hook call as (hook, step)."""

    def __init__(self, calls: list | None = None) -> None:
        self.calls = calls if calls is not None else []

    def on_start(self, trainer) -> None:
        self.calls.append(("on_start", trainer.step))

    def pre_step(self, trainer, batch) -> None:
        self.calls.append(("pre_step", batch.step))

    def check_step(self, trainer, out) -> bool:
        self.calls.append(("check_step", out.step))
        return True

    def post_step(self, trainer, out) -> None:
        assert trainer.curves["loss"][-1] == (out.step, out.loss)  # recorded before post_step
        self.calls.append(("post_step", out.step))

    def on_checkpoint(self, trainer, step) -> None:
        self.calls.append(("on_checkpoint", step))

    def on_end(self, trainer, result) -> None:
        self.calls.append(("on_end", result.steps))

    def on_error(self, trainer, error) -> None:
        self.calls.append(("on_error", type(error).__name__))


@pytest.fixture(scope="module")
def mixture(tmp_path_factory) -> Mixture:
    return write_mixture(tmp_path_factory.mktemp("data"))


def test_hooks_are_called_at_fixed_points(mixture, tmp_path) -> None:
    recorder = Recorder()
    run = RUN.model_copy(update={"steps": 4, "checkpoint_every": 2})
    train_model(MODEL, OPTIM, run, mixture, tmp_path, callbacks=[recorder])
    step_calls = [[("pre_step", s), ("check_step", s), ("post_step", s)] for s in range(1, 5)]
    expected = [("on_start", 0), *step_calls[0], *step_calls[1], ("on_checkpoint", 2), *step_calls[2],
                *step_calls[3], ("on_checkpoint", 4), ("on_end", 4)]
    assert recorder.calls == expected


def test_training_reports_its_steps_as_plain_lines_in_a_log(mixture, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(kiln.tasks.progress, "LOG_EVERY_S", 0.0)  # a line per step, as every 30 s in a long run
    run = RUN.model_copy(update={"steps": 4, "log_every": 2})
    train_model(MODEL, OPTIM, run, mixture, tmp_path)
    lines = [line.split(", ") for line in capsys.readouterr().err.splitlines() if line.startswith("train: ")]
    assert [parts[0] for parts in lines] == [f"train: {s}/4 steps ({25 * s}%)" for s in (1, 2, 3, 4, 4)]
    assert lines[1][-1].startswith("loss ") and lines[-1][2].startswith("in ")  # the loss at log steps; the total time


def test_on_error_sees_the_exception_leaving_the_loop(mixture, tmp_path) -> None:
    class Boom(Exception):
        pass

    class Explode(Recorder):
        def post_step(self, trainer, out) -> None:
            if out.step == 2:
                raise Boom

    recorder = Explode()
    with pytest.raises(Boom):
        train_model(MODEL, OPTIM, RUN.model_copy(update={"steps": 4}), mixture, tmp_path, callbacks=[recorder])
    assert recorder.calls[-1] == ("on_error", "Boom") and ("on_end", 4) not in recorder.calls


def test_hooks_dispatch_only_to_overriding_callbacks() -> None:
    class OnlyPost(TrainCallback):
        def post_step(self, trainer, out) -> None:
            pass

    hooks = Hooks([OnlyPost(), TrainCallback()])
    assert len(hooks._calls["post_step"]) == 1 and hooks._calls["pre_step"] == []
    with pytest.raises(TypeError, match="not a TrainCallback"):
        Hooks([object()])


def test_callback_spec_round_trips_through_json() -> None:
    spec = CallbackSpec.of(FaultInjection, lr_multiplier={"3": 2.0}, kill_rank_at_step=[1, 6])
    assert spec.target == "kiln.tasks.train.testing_faults.FaultInjection"
    built = CallbackSpec.from_json(spec.to_json()).build()
    assert isinstance(built, FaultInjection)
    assert built.lr_multiplier == {3: 2.0} and built.kill_rank_at_step == (1, 6)


@pytest.mark.parametrize("raw, error", [
    ({"target": "kiln.tasks.train.nowhere.Callback"}, "not found"),
    ({"target": "kiln.tasks.train.loop.train_model"}, "not a TrainCallback"),
    ({"target": "kiln.tasks.train.testing_faults.FaultInjection", "kwargs": {"flip_bits": 1}}, "flip_bits"),
    ({"class": "x"}, "a callback spec is"),
])
def test_bad_callback_specs_are_config_errors(raw, error) -> None:
    with pytest.raises(ConfigError, match=error):
        CallbackSpec.from_json(raw).build()
