"""Kiln installed as a wheel, outside its clone, and the container recipe that installs that wheel.

The wheel is built from the files git sees in this checkout (what a fresh clone builds) and
installed without `-e` into a fresh venv whose only other packages are this test environment's
installed ones, named by a .pth file: no download, no `--system-site-packages` (the test
environment is itself a venv), and neither this checkout nor its `tasks`/`flows` folders on the
path. From a folder outside the clone, `kiln init` and `kiln run` then run the tiny pipeline on
the wheel's own files (slow: about 3-4 minutes on 2 busy cores).

No container runtime runs here, so the recipe (`infra/container/Dockerfile`) is checked, not built:
the build context docker would send (this checkout less `.dockerignore`) holds exactly the files
git sees, the wheel its first stage builds from it equals the checkout's wheel file for file, and
its last stage's Kiln steps (install the wheel, `kiln image check`, `kiln init /opt/kiln`, the entry
point `kiln`) are run here in that venv. The base images, apt, kubectl and torch's index are not
exercised: `kiln image check IMAGE` does that where a runtime runs.
"""

from __future__ import annotations

import csv
import fnmatch
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "infra" / "container" / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
PIP_TIMEOUT_S = 300


def git_files() -> list[str]:
    """The files git sees in this checkout: tracked, and untracked but not ignored (work in progress)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    return sorted(name for name in listed.split("\0") if name and (REPO / name).is_file())


def copy_files(names: list[str], target: Path) -> Path:
    for name in names:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target / name)
    return target


def build_wheel(source: Path, out: Path, command: list[str] | None = None) -> tuple[Path, str]:
    """The wheel built from `source` by `command` (default: pip's, as `pip wheel .` builds it), offline; and
    what the build printed (verbose: setuptools' own warnings included)."""
    command = command or [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), str(source)]
    done = subprocess.run([*command, "--no-build-isolation", "--no-index", "-v"], capture_output=True, text=True,
                          timeout=PIP_TIMEOUT_S, env=_clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("kiln-*.whl")
    return wheel, done.stdout + done.stderr


def record(wheel: Path) -> dict[str, str]:
    """Every file of `wheel` (its RECORD but the RECORD itself) -> its hash."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.StringIO(archive.read(name).decode()))
        return {row[0]: row[1] for row in rows if row and row[0] != name}


def _clean_env(**extra: str) -> dict[str, str]:
    """This environment without anything that would put the checkout on a path or reuse its Kiln state."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME") and not k.startswith(("PREFECT_", "MLFLOW_", "KILN_"))}
    return env | extra


# --- the Dockerfile, as docker reads it (the subset this recipe uses) --------------------------------------

def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), " ".join(rest.split())))
    return found


def stages(text: str) -> tuple[dict[str, str], dict[str, tuple[str, list[tuple[str, str]]]]]:
    """(the global ARGs' defaults, stage name -> (its FROM image, its instructions))."""
    global_args: dict[str, str] = {}
    named: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in instructions(text):
        if word == "FROM":
            image, _, name = rest.partition(" AS ")
            current = []
            named[name.strip()] = (image.strip(), current)
        elif current is None:
            assert word == "ARG", f"only ARG may come before the first FROM, not {word}"
            key, _, value = rest.partition("=")
            global_args[key] = value
        else:
            current.append((word, rest))
    return global_args, named


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Whether docker leaves `path` (relative to the context) out: it, or a folder above it, matches a
    pattern; patterns are anchored at the context's root, `*` stays inside one name, `**` spans folders."""
    parts = path.split("/")
    return any(_matches(pattern.strip("/").split("/"), parts[:end])
               for pattern in patterns for end in range(1, len(parts) + 1))


def _matches(pattern: list[str], parts: list[str]) -> bool:
    if not pattern:
        return not parts
    if pattern[0] == "**":
        return any(_matches(pattern[1:], parts[skip:]) for skip in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], pattern[0]) and _matches(pattern[1:], parts[1:])


def ignore_patterns() -> list[str]:
    lines = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert not any(p.startswith("!") for p in patterns), "exceptions are beyond this test's matcher: extend it"
    return patterns


def build_context() -> list[str]:
    """Every file docker would send from this checkout: all on disk, less what .dockerignore names."""
    patterns = ignore_patterns()
    sent = []
    for folder, subfolders, names in os.walk(REPO):
        rel = Path(folder).relative_to(REPO)
        subfolders[:] = [d for d in subfolders if not dockerignored(str(rel / d), patterns)]
        sent += [str(rel / name) for name in names if not dockerignored(str(rel / name), patterns)]
    return sorted(sent)


# --- fixtures: the checkout's wheel, and a fresh venv with it installed ------------------------------------

@pytest.fixture(scope="module")
def checkout_wheel(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("checkout")
    return build_wheel(copy_files(git_files(), root / "src"), root / "dist")


@pytest.fixture(scope="module")
def venv(checkout_wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel installed (not editable) and the test environment's packages beside it."""
    root = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    site = next((root / "lib").glob("python3*/site-packages"))
    dependencies = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (site / "test-environment.pth").write_text("\n".join(dependencies) + "\n")
    done = subprocess.run([root / "bin" / "python", "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                           str(checkout_wheel[0])], capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                          env=_clean_env(), cwd=root.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def kiln(venv: Path, *args: str, cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([str(venv / "bin" / "kiln"), *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout_s, env=_clean_env(KILN_CACHE_DIR=str(cwd / ".kiln-cache")))
    assert done.returncode == 0, f"kiln {' '.join(args)}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


def test_the_wheel_carries_kiln_under_one_name_and_builds_without_deprecation_notices(checkout_wheel):
    wheel, output = checkout_wheel
    files = record(wheel)
    tops = {name.split("/")[0] for name in files}
    assert tops == {"kiln", wheel.name.split("-py3")[0] + ".dist-info"}  # no top-level tasks, flows, configs...
    for shipped in ("kiln/configs/default.yaml", "kiln/configs/project/kiln.yaml", "kiln/infra/slurm/train.sbatch.j2",
                    "kiln/infra/container/Dockerfile", "kiln/data/models/quality_classifier.ftz",
                    "kiln/data/evals/heldout.jsonl", "kiln/data/sample/SOURCES.json", "kiln/flows/cli.py",
                    "kiln/tasks/bundled.py"):
        assert shipped in files, shipped
    assert not [name for name in files if "__pycache__" in name]  # bytecode caches are no data (setup.py)
    assert "deprecat" not in output.lower(), [line for line in output.splitlines() if "eprecat" in line]


def test_the_container_recipe_installs_the_wheel_and_its_entry_point_resolves(checkout_wheel, venv, tmp_path):
    global_args, named = stages(DOCKERFILE.read_text())
    # a CPU base and a CUDA base, chosen by a build argument
    assert global_args["FLAVOR"] == "cpu" and {"base-cpu", "base-cuda"} <= set(named)
    assert named["kiln"][0] == "base-${FLAVOR}" and list(named)[-1] == "kiln"
    # the wheel stage: the whole context, built into /dist by a command this test can run here
    wheel_stage = named["wheel"][1]
    assert ("COPY", ". /src") in wheel_stage
    (build,) = [shlex.split(rest) for word, rest in wheel_stage if word == "RUN"]
    assert build[:3] == ["python", "-m", "pip"] and build[-1] == "/src" and "--no-deps" in build

    # the context docker sends is what git sees, less what .dockerignore drops (nothing the wheel ships)
    context = build_context()
    assert set(context) <= set(git_files()), sorted(set(context) - set(git_files()))[:10]
    source = copy_files(context, tmp_path / "context")
    command = [sys.executable, *build[1:-1], str(source)]
    command[command.index("/dist")] = str(tmp_path / "dist")
    image_wheel, _ = build_wheel(source, tmp_path / "dist", command)
    assert image_wheel.name == checkout_wheel[0].name
    assert record(image_wheel) == record(checkout_wheel[0])  # every file the wheel ships, byte for byte

    # the last stage installs that wheel (not editable), torch at pyproject's pin first, then runs Kiln's steps
    final = named["kiln"][1]
    assert ("COPY", "--from=wheel /dist/ /tmp/dist/") in final
    runs = " && ".join(rest for word, rest in final if word == "RUN")
    torch_pin = next(d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
                     if d.startswith("torch=="))
    assert f"--index-url \"$KILN_TORCH_INDEX\" {torch_pin} " in runs
    assert "pip install --no-cache-dir /tmp/dist/kiln-*.whl" in runs and " -e " not in runs
    assert ("RUN", "kiln image check") in final and ("RUN", "kiln init /opt/kiln") in final
    prefect = yaml.safe_load((REPO / "infra" / "prefect.yaml").read_text())
    project_dir = prefect["definitions"]["work_pools"]["kubernetes"]["job_variables"]["env"]["KILN_PROJECT_DIR"]
    assert ("WORKDIR", project_dir) in final  # Prefect's flow-run pods start in the image's project folder
    assert ("ENTRYPOINT", '["kiln"]') in final
    with zipfile.ZipFile(checkout_wheel[0]) as archive:
        scripts = archive.read(next(n for n in archive.namelist() if n.endswith("entry_points.txt"))).decode()
    assert "kiln = kiln.flows.cli:main" in scripts

    # its Kiln steps, run here on the installed wheel: the entry point resolves, the packaged-files check passes
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    version = kiln(venv, "--version", cwd=elsewhere).stdout
    assert version.startswith("kiln 0.1.0 from ") and str(venv) in version
    checked = kiln(venv, "image", "check", cwd=elsewhere).stdout
    assert re.search(r"entry point kiln -> kiln.flows.cli:main; (\d+) installed files match", checked)
    package_files = [name for name in record(checkout_wheel[0]) if name.startswith("kiln/")]
    assert int(re.search(r"(\d+) installed files match", checked).group(1)) == len(package_files)
    kiln(venv, "init", str(tmp_path / "opt" / "kiln"), cwd=elsewhere)
    assert (tmp_path / "opt" / "kiln" / "kiln.yaml").read_text().count("extends: kiln:configs/default.yaml") == 1


def test_the_venv_holds_kiln_alone_and_imports_nothing_from_the_clone(venv, tmp_path):
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert sorted(p.name for p in site.iterdir()) == ["kiln", "kiln-0.1.0.dist-info", "test-environment.pth"]
    probe = ("import importlib.util, kiln, kiln.tasks.bundled as b;"
             "print(kiln.__file__); print(b.shipped('data'));"
             "print(importlib.util.find_spec('tasks'), importlib.util.find_spec('flows'))")
    done = subprocess.run([venv / "bin" / "python", "-c", probe], capture_output=True, text=True, cwd=tmp_path,
                          env=_clean_env(), timeout=120, check=True)
    kiln_file, data, specs = done.stdout.splitlines()
    assert Path(kiln_file).is_relative_to(site) and Path(data) == site / "kiln" / "data"
    assert specs == "None None"  # no top-level tasks or flows anywhere on its path


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kiln_init_then_run_works_from_an_empty_folder_on_the_wheel(venv, tmp_path):
    """The tiny pipeline from a project `kiln init` wrote, outside the clone: every stage runs on the wheel's
    own sample, classifier and eval sets, and gets the keys the checkout's configs/tiny.yaml gives (the same
    config and the same bytes of data)."""
    from kiln.tasks.config import load_config
    from kiln.tasks.graph import stage_keys

    kiln(venv, "init", "project", "--extends", "kiln:configs/tiny.yaml", cwd=tmp_path)
    project = tmp_path / "project"
    shown = kiln(venv, "config", "--keys", cwd=project).stdout
    assert shown.startswith("# resolved from: kiln.yaml\n#          over: kiln:configs/tiny.yaml  (")
    keys = yaml.safe_load(shown.split("# stage keys\n")[1])
    assert keys == stage_keys(load_config(str(REPO / "configs" / "tiny.yaml")))
    ran = kiln(venv, "run", cwd=project, timeout_s=840)
    summary = [line for line in ran.stderr.splitlines() if re.match(r"\[\s*\d+/\d+\]", line) and "running" not in line]
    # every stage but those run on demand (dedup-batch, batch, research)
    assert len(summary) == len(keys) - 3 and all(" ran " in line for line in summary), ran.stderr[-3000:]
    status = kiln(venv, "status", cwd=project).stdout
    complete = re.findall(r"^  (\S+) +([0-9a-f]{12})  complete ", status, re.MULTILINE)
    on_demand = ("dedup-batch", "batch", "research")
    assert {stage: key for stage, key in complete} == {stage: key for stage, key in keys.items() if stage not in on_demand}
    assert (project / "kiln-work" / "store" / "evaluate" / keys["evaluate"] / "report.md").is_file()
