"""`kiln init`, `kiln --version` and `kiln image check` (this installation; an image where no runtime runs).

`kiln init` plus `kiln run` from an empty folder, on a wheel: tests/test_install.py (slow)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

import kiln
from kiln.flows.cli import main
from kiln.flows.image import find_runtime, installation_problems
from kiln.tasks.config import config_chain, load_config
from kiln.tasks.errors import KilnError

OWN_DATA_BLOCK = "# collect:"  # where kiln.yaml's commented settings for the user's own data begin


def _uncommented(config: str) -> str:
    """kiln.yaml with its own-data block switched on, as its comment tells the user to."""
    lines = config.splitlines()
    start = lines.index(OWN_DATA_BLOCK)
    return "\n".join(lines[:start] + [line.removeprefix("# ") for line in lines[start:]]) + "\n"


def test_init_writes_a_project_that_runs_kilns_default_and_shows_how_to_name_ones_own_data(tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["init", "my-project"]) == 0
    out = capsys.readouterr().out
    assert "next: cd my-project && kiln run" in out
    project = tmp_path / "my-project"
    written = sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())
    assert written == [".gitignore", "README.md", "data/README.md", "data/evals/.gitkeep", "data/lists/.gitkeep",
                       "data/raw/.gitkeep", "kiln.yaml"]
    assert (project / "README.md").read_text().startswith(f"# my-project\n\nA language-model pretraining project run "
                                                          f"with Kiln {kiln.__version__}")
    assert "kiln-work*/" in (project / ".gitignore").read_text().splitlines()
    monkeypatch.chdir(project)
    # as written: Kiln's default run, this project's work_dir
    assert [name for name, _ in config_chain("kiln.yaml")] == ["kiln.yaml", "kiln:configs/default.yaml"]
    assert load_config("kiln.yaml") == load_config("kiln:configs/default.yaml")
    # its own-data block, switched on, is a whole config for a corpus in data/raw/ (no domain left unnamed)
    (project / "data" / "raw" / "my-corpus").mkdir()
    (project / "data" / "raw" / "my-corpus" / "part-0.jsonl").write_text('{"text": "words", "licence": "MIT"}\n')
    (project / "mine.yaml").write_text(_uncommented((project / "kiln.yaml").read_text()))
    cfg = load_config("mine.yaml")
    assert [s.name for s in cfg.collect.sources] == ["my-corpus"] and cfg.collect.domains() == ["web"]
    assert cfg.sweep.mixtures == {"uniform": {"web": 1.0}} and cfg.clean.quality_training is None


def test_init_keeps_what_the_folder_has_and_refuses_a_second_project(tmp_path, capsys):
    project = tmp_path / "repo"
    project.mkdir()
    (project / "README.md").write_text("# mine\n")
    (project / ".gitignore").write_text("*.log\nmlruns/")  # no newline at the end
    assert main(["init", str(project), "--extends", "kiln:configs/tiny.yaml"]) == 0
    assert "kept  README.md (the folder had it)" in capsys.readouterr().out
    assert (project / "README.md").read_text() == "# mine\n"
    lines = (project / ".gitignore").read_text().splitlines()
    assert lines[:2] == ["*.log", "mlruns/"] and "kiln-work*/" in lines and lines.count("mlruns/") == 1
    assert "extends: kiln:configs/tiny.yaml\n" in (project / "kiln.yaml").read_text()
    before = sorted(project.rglob("*"))
    assert main(["init", str(project)]) == 2
    assert "kiln.yaml exists: this folder is a Kiln project already" in capsys.readouterr().err
    assert sorted(project.rglob("*")) == before


def test_init_extends_a_config_by_its_absolute_path_and_refuses_one_that_does_not_load(tmp_path, capsys):
    base = tmp_path / "team.yaml"
    base.write_text("extends: kiln:configs/tiny.yaml\ndedup: {threshold: 0.8}\n")
    assert main(["init", str(tmp_path / "a"), "--extends", os.path.relpath(base)]) == 0
    assert f"extends: {base}\n" in (tmp_path / "a" / "kiln.yaml").read_text()
    assert load_config(str(tmp_path / "a" / "kiln.yaml")).dedup.threshold == 0.8
    assert main(["init", str(tmp_path / "b"), "--extends", "kiln:configs/tinny.yaml"]) == 2
    assert "Kiln ships no such file" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_version_names_the_installation(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == (f"kiln {kiln.__version__} from {Path(kiln.__file__).resolve().parent} "
                                       f"(python {sys.version.split()[0]})\n")


def test_this_installation_passes_the_packaged_files_check(capsys):
    report = installation_problems()
    assert report.problems == [] and report.entry_point == "kiln.flows.cli:main"
    assert report.num_shipped == 16 and report.num_config_paths == 24  # every source, reference, model, eval set
    assert main(["image", "check"]) == 0
    assert capsys.readouterr().out.startswith(f"kiln {kiln.__version__}: entry point kiln -> kiln.flows.cli:main; ")


def test_checking_an_image_without_a_container_runtime_says_what_each_lacks(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # none installed
    with pytest.raises(KilnError, match="no container runtime runs here: docker is not installed; podman is not "
                                        "installed; apptainer is not installed"):
        find_runtime()
    assert main(["image", "check", "kiln:0.1.0-cpu"]) == 2
    assert "srun --container-image=IMAGE kiln image check" in capsys.readouterr().err


def test_a_docker_without_its_engine_is_no_runtime(monkeypatch):
    """This machine's case: docker's client is installed, no engine runs (no image was built here)."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client here")
    monkeypatch.setenv("PATH", str(Path(docker).parent))
    try:
        runtime = find_runtime("docker")
    except KilnError as error:
        assert "docker is installed but does not answer (`docker info`: " in str(error)
    else:
        pytest.skip(f"{runtime.executable}'s engine answers here: `kiln image check IMAGE` can run for real")
