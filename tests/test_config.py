"""Config loading: composition, overrides, and errors that name the file, key and fix."""

from pathlib import Path

import pytest

from kiln.tasks.config import load_config
from kiln.tasks.errors import ConfigError


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


def test_a_step_the_keep_policy_will_not_leave_is_refused_when_the_config_loads(tmp_path):
    # the trial: anneal_ablation.from_step=20 failed after 5.5 minutes of training
    path = write(tmp_path / "mine.yaml", "extends: " + str(Path("configs/default.yaml").resolve()) + "\n"
                 "train: {run: {steps: 300, checkpoint_every: 100, keep_checkpoints: 2, keep_every: null}}\n"
                 "anneal_ablation: {from_step: 100}\n")
    with pytest.raises(ConfigError) as error:  # 300 steps, one every 100, the newest 2 kept: 200 and 300
        load_config(path, ["anneal.from_step=50"])
    message = str(error.value)
    assert f"{path}: anneal_ablation.from_step=100: the train run (300 steps, keep_checkpoints=2, keep_every=None) " \
           "will keep the checkpoints of steps [200, 300] only; set train.run.keep_every=100" in message
    assert "command line (anneal.from_step=50): anneal.from_step=50: the train run writes no checkpoint of step 50" \
           in message  # every mistake at once, each with where it was set
    assert load_config(path, ["anneal_ablation.from_step=200"]).anneal_ablation.from_step == 200
    with pytest.raises(ConfigError, match=r"configs/tiny.yaml: anneal_ablation.from_step=20: the train run stops at "
                                          r"train.run.steps=10, before step 20"):
        load_config("configs/tiny.yaml", ["train.run.steps=10", "train.run.checkpoint_every=5"])
    assert load_config("configs/default.yaml", ["anneal.from_step=1000"]).anneal.from_step == 1000  # keep_every: 1000
    # with `model: plan` and no steps of its own, the run's length comes from the fit: only keep_every can promise a step
    with pytest.raises(ConfigError, match=r"anneal.from_step=100: train.run.steps comes from the fit's plan"):
        load_config(None, ["train.model=plan", "anneal.from_step=100"])
    assert load_config(None, ["train.model=plan", "train.run.keep_every=100", "anneal.from_step=100"])


def test_continuous_eval_every_must_name_checkpoints_the_run_writes():
    run = ["train.run.steps=300", "train.run.checkpoint_every=100"]
    with pytest.raises(ConfigError, match=r"continuous_eval.every=150 is not a multiple of "
                                          r"train.run.checkpoint_every=100:"):
        load_config("configs/default.yaml", [*run, "continuous_eval.every=150"])
    with pytest.raises(ConfigError, match=r"continuous_eval.every=400: no checkpoint is due, the train run stops at "
                                          r"train.run.steps=300"):
        load_config("configs/default.yaml", [*run, "continuous_eval.every=400"])
    assert load_config("configs/default.yaml", [*run, "continuous_eval.every=200"]).continuous_eval.every == 200


@pytest.mark.parametrize("written,seconds", [(60, 60), ("60s", 60), ("10m", 600), ("1.5h", 5400), (" 90 s ", 90)])
def test_the_continuous_eval_interval_takes_seconds_or_a_unit(written, seconds):
    override = f"continuous_eval.interval={written!r}" if isinstance(written, str) else f"continuous_eval.interval={written}"
    assert load_config(None, [override]).continuous_eval.interval == seconds


def test_a_bad_interval_says_how_to_write_one():
    with pytest.raises(ConfigError, match=r"continuous_eval.interval: .*give seconds \(60\), or a number and s, m or h"):
        load_config(None, ["continuous_eval.interval=soon"])
    with pytest.raises(ConfigError, match=r"continuous_eval.interval: Input should be greater than 0"):
        load_config(None, ["continuous_eval.interval=0s"])
