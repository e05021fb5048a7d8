"""Config loading: composition, overrides, and errors that name the file, key and fix."""

from pathlib import Path

import pytest

from tasks.config import load_config
from tasks.errors import ConfigError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_default_config_loads():
    cfg = load_config("configs/default.yaml")
    assert cfg.train.run.steps > 0
    assert {s.domain for s in cfg.collect.sources} >= {"web", "code", "prose", "multilingual"}


def test_extends_and_override_precedence(tmp_path):
    write(tmp_path / "base.yaml", "dedup: {threshold: 0.7, num_perm: 64}\ntrain: {run: {steps: 10}}\n")
    child = write(tmp_path / "child.yaml", "extends: base.yaml\ndedup: {threshold: 0.9}\n")
    cfg = load_config(child, ["train.run.steps=42"])
    assert cfg.dedup.threshold == 0.9  # child file beats base
    assert cfg.dedup.num_perm == 64  # base kept where the child is silent
    assert cfg.train.run.steps == 42  # CLI beats files


def test_unknown_key_names_file_and_key(tmp_path):
    path = write(tmp_path / "bad.yaml", "dedup: {treshold: 0.7}\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(path) in str(error.value) and "dedup.treshold" in str(error.value)
    assert "unknown key" in str(error.value)


def test_wrong_type_from_override_names_the_override():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["train.run.steps=lots"])
    message = str(error.value)
    assert "train.run.steps" in message and "command line (train.run.steps=lots)" in message
    assert "'lots'" in message


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path / "broken.yaml", "dedup:\n  threshold: 0.7\n bad: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: not valid YAML"):
        load_config(path)


def test_missing_file_and_bad_override_form():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["train.run.steps"])


def test_extends_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_model_shape_error_is_explained():
    with pytest.raises(ConfigError, match="not divisible by model.n_heads"):
        load_config(None, ["train.model.d_model=100", "train.model.n_heads=3"])


def test_cluster_launchers_and_executors_are_choices():
    cfg = load_config("configs/tiny.yaml", ["cluster.launcher=slurm", "cluster.executor=ray", "cluster.partition=gpu"])
    assert (cfg.cluster.launcher, cfg.cluster.executor, cfg.cluster.partition) == ("slurm", "ray", "gpu")
    with pytest.raises(ConfigError, match="cluster.launcher"):
        load_config("configs/tiny.yaml", ["cluster.launcher=mpirun"])
