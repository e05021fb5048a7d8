"""The torchrun path refuses settings its worker would otherwise silently ignore."""

from pathlib import Path

import pytest

from tasks.errors import ConfigError
from tasks.train.config import ModelConfig, OptimConfig, ParallelDims, TrainRunConfig
from tasks.train.planner import ClusterSpec
from tasks.train.torchrun_stage import train_with_torchrun


@pytest.mark.parametrize("optim,run,named", [
    (OptimConfig(z_loss=1e-4), TrainRunConfig(), "optim.z_loss"),
    (OptimConfig(), TrainRunConfig(compile=True), "run.compile"),
    (OptimConfig(), TrainRunConfig(activation_checkpointing=True), "parallel.activation_checkpointing"),
])
def test_unsupported_settings_are_refused_before_launch(tmp_path, optim, run, named):
    with pytest.raises(ConfigError, match=named):
        train_with_torchrun(ModelConfig(), optim, run, ParallelDims(dp=2), ClusterSpec(), Path("m.json"), tmp_path,
                            tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing was launched or written
