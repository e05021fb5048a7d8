"""What `kiln config` prints loads back as it is: save it, edit it, run it."""

from pathlib import Path

import pytest

from kiln.flows.cli import main
from kiln.tasks.config import load_config

REPO = Path(__file__).resolve().parents[1]
BUNDLED = sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("configs/*.yaml"), *REPO.glob("configs/examples/*.yaml")])


@pytest.mark.parametrize("config", BUNDLED)
def test_the_resolved_config_loads_back_as_it_is(config, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["config", config]) == 0
    saved = tmp_path / "mine.yaml"
    saved.write_text(capsys.readouterr().out)
    assert load_config(saved) == load_config(config)
    text = saved.read_text()
    assert "extends" not in text and "optim:\n    weight_decay" in text  # no optim.lr: the sections refuse it


def test_an_edited_copy_runs_with_the_edit(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["config", "configs/tiny.yaml"]) == 0
    saved = tmp_path / "mine.yaml"
    saved.write_text(capsys.readouterr().out.replace("lr: plan", "lr: 0.01"))
    cfg = load_config(saved)
    assert cfg.train.lr == 0.01 and cfg.sweep.lr == load_config("configs/tiny.yaml").sweep.lr
