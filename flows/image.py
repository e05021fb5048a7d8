"""`kiln image check`: whether an installed Kiln holds what it needs, here or inside a container image.

Without an image it checks this installation (`installation_problems`): the `kiln` entry point
resolves, the distribution claims no top-level name but `kiln`, every file its RECORD lists is
present with its hash (an editable install lists none), Kiln's shipped files are there (`REQUIRED`),
and every file the packaged default config names is found from an empty folder (`tasks.bundled`).
The image recipe (`infra/container/Dockerfile`) runs it as its last build step.

With an image it runs `kiln --version` and that same check inside the image, through the first
container runtime that answers here (docker, podman, or apptainer for a `.sif` or `docker://`
image). On a Slurm cluster with pyxis, `srun --container-image=IMAGE kiln image check` does the same
on a node.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from base64 import urlsafe_b64decode
from contextlib import chdir
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from kiln import __version__
from kiln.tasks.bundled import PACKAGES, locate, shipped, shipped_file
from kiln.tasks.config import PACKAGED_DEFAULT, load_config
from kiln.tasks.data.source_files import local_path
from kiln.tasks.errors import KilnError

DISTRIBUTION = "kiln"
ENTRY_POINT = "kiln"
# Kiln's own files a run, a launch or a deployment reads by name (the default config's data is checked from it)
REQUIRED = (
    "configs/default.yaml", "configs/tiny.yaml", "configs/models/7b.yaml", "configs/clusters/h100-8nodes.yaml",
    "configs/project/kiln.yaml", "configs/project/README.md", "configs/project/gitignore",
    "configs/project/data/README.md", "infra/prefect.yaml", "infra/work-pools/kubernetes.json",
    "infra/slurm/train.sbatch.j2", "infra/k8s/train-job.yaml.j2", "infra/k8s/trials-job.yaml.j2",
    "data/models/quality_classifier.ftz", "data/evals/heldout.jsonl", "data/evals/heldout_code.jsonl",
)
RUNTIMES = ("docker", "podman", "apptainer")
RUNTIME_TIMEOUT_S = 600.0  # a first `docker run` may pull the image


@dataclass
class InstallationReport:
    """What `installation_problems` looked at, and what it found wrong."""

    problems: list[str] = field(default_factory=list)
    num_recorded: int = 0  # files of the distribution's RECORD checked against their hashes
    num_shipped: int = 0  # REQUIRED files found
    num_config_paths: int = 0  # local paths of the packaged default config found from an empty folder
    entry_point: str = ""

    def summary(self) -> str:
        return (f"kiln {__version__}: entry point {ENTRY_POINT} -> {self.entry_point or '?'}; "
                f"{self.num_recorded} installed files match their RECORD hashes; {self.num_shipped} of Kiln's "
                f"required files and the {self.num_config_paths} files {PACKAGED_DEFAULT} names were found")


def installation_problems() -> InstallationReport:
    """Check this installation of Kiln (module docstring); every problem found, not only the first."""
    report = InstallationReport()
    # pip's record of what it installed; a checkout's kiln.egg-info (build metadata an editable install leaves
    # in the repository, seen first from there) has no RECORD
    dist = next((d for d in metadata.distributions(name=DISTRIBUTION) if d.read_text("RECORD") is not None), None)
    if dist is None:
        report.problems.append(f"no installed distribution named {DISTRIBUTION!r}: install Kiln (pip install ...)")
        return report
    if dist.version != __version__:
        report.problems.append(f"the distribution is {dist.version}, the imported kiln package {__version__}: two "
                               "installations are mixed")
    _check_entry_point(dist, report)
    _check_record(dist, report)
    for name in REQUIRED:
        if shipped_file(name) is None:
            report.problems.append(f"{name} is missing from the installed package data (kiln.{name.split('/')[0]})")
        else:
            report.num_shipped += 1
    _check_default_config(report)
    return report


def _check_entry_point(dist: metadata.Distribution, report: InstallationReport) -> None:
    found = [ep for ep in dist.entry_points if ep.group == "console_scripts" and ep.name == ENTRY_POINT]
    if not found:
        report.problems.append(f"the distribution declares no console script {ENTRY_POINT!r}")
        return
    report.entry_point = found[0].value
    try:
        target = found[0].load()
    except (ImportError, AttributeError) as error:
        report.problems.append(f"console script {ENTRY_POINT} = {found[0].value} does not load: {error}")
        return
    if not callable(target):
        report.problems.append(f"console script {ENTRY_POINT} = {found[0].value} is not callable")


def _check_record(dist: metadata.Distribution, report: InstallationReport) -> None:
    """Every RECORD file present with its hash; none outside `kiln/` and the metadata (no top-level
    `tasks` or `flows` to shadow a user's own)."""
    top_level = set()
    for entry in dist.files or []:
        parts = entry.parts
        if parts[0].endswith((".dist-info", ".data")) or parts[0] == "..":  # metadata; console scripts in bin/
            continue
        top_level.add(parts[0].removesuffix(".py"))
        if entry.hash is None:  # RECORD itself, and files written at install time (bytecode)
            continue
        path = Path(entry.locate())
        if not path.is_file():
            report.problems.append(f"{entry} is listed in the distribution's RECORD but missing ({path})")
            continue
        digest = hashlib.new(entry.hash.mode, path.read_bytes()).digest()
        if digest != urlsafe_b64decode(entry.hash.value + "=" * (-len(entry.hash.value) % 4)):
            report.problems.append(f"{entry} differs from the file the wheel installed ({path})")
        report.num_recorded += 1
    foreign = sorted(name for name in top_level if not name.startswith(("kiln", "__editable__", "_")))
    if foreign:
        report.problems.append(f"the distribution installs top-level names besides kiln: {', '.join(foreign)} "
                               "(a user's own module of that name would be shadowed)")


def _check_default_config(report: InstallationReport) -> None:
    """Every local file the packaged default config names (sources, references, the classifier, eval
    sets) is found from a folder that has none of them: Kiln's own files, through `tasks.bundled`."""
    cfg = load_config(PACKAGED_DEFAULT)
    clean = cfg.clean
    named = [source.path for source in cfg.collect.sources]
    named += [source.path for source in clean.quality_training.references] if clean.quality_training else []
    named += [clean.quality_model] if clean.quality_model else []
    named += list(cfg.evaluate.eval_files)
    with tempfile.TemporaryDirectory() as empty, chdir(empty):
        for name in named:
            found = local_path(name) if "://" not in name else None
            if found is None or not found.exists() or not _is_shipped(found):
                report.problems.append(f"{PACKAGED_DEFAULT} names {name}, which is not found from an empty folder "
                                       f"(looked for {locate(name)})")
            else:
                report.num_config_paths += 1


def _is_shipped(path: Path) -> bool:
    return any(path.resolve().is_relative_to(shipped(folder).resolve()) for folder in PACKAGES)


@dataclass(frozen=True)
class Runtime:
    """A container runtime that answers here, and how it runs a command in an image."""

    name: str
    executable: str

    def command(self, image: str, argv: list[str]) -> list[str]:
        if self.name == "apptainer":  # no entry point: name the command
            return [self.executable, "exec", image, *argv]
        return [self.executable, "run", "--rm", "--entrypoint", argv[0], image, *argv[1:]]


def find_runtime(wanted: str | None = None) -> Runtime:
    """The first of `RUNTIMES` (or `wanted`) that is installed and answers; KilnError saying what each lacks."""
    why = []
    for name in (wanted,) if wanted else RUNTIMES:
        executable = shutil.which(name)
        if executable is None:
            why.append(f"{name} is not installed")
            continue
        probe = [executable, "--version"] if name == "apptainer" else [executable, "info"]
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60, check=False)
        if done.returncode == 0:
            return Runtime(name, executable)
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        why.append(f"{name} is installed but does not answer (`{name} {probe[1]}`: "
                   f"{said[-1] if said else f'exit {done.returncode}'})")
    raise KilnError("no container runtime runs here: " + "; ".join(why) + ". Run `kiln image check IMAGE` where one "
                    "runs (a build machine with docker or podman, a node with apptainer), or on a pyxis cluster "
                    "`srun --container-image=IMAGE kiln image check`")


def check_image(image: str, runtime: Runtime) -> list[tuple[str, subprocess.CompletedProcess]]:
    """`kiln --version` and `kiln image check` run inside `image`: (what ran, how it ended) of each."""
    ran = []
    for argv in (["kiln", "--version"], ["kiln", "image", "check"]):
        command = runtime.command(image, argv)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=RUNTIME_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise KilnError(f"{' '.join(command)} ran past {RUNTIME_TIMEOUT_S:.0f} s") from None
        ran.append((" ".join(command), done))
    return ran
