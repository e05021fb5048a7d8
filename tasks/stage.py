"""What a stage is: one declaration (`Stage`) of everything Kiln needs to know about a step.

A stage module (`tasks/stages/<name>.py`) declares its name, its inputs, its own config section,
the config sections and external files its key hashes, its format version, whether a crashed
attempt is resumed, its body, and its headline and reports for humans. The graph and keys
(`tasks.graph`), the config tree (`tasks.config`), the runner (`tasks.runner`), the Prefect flows,
the CLI's stage list and the deployments in `infra/prefect.yaml` all derive from these
declarations; adding a stage is one module plus one line in `tasks/stages/__init__.py`.

A stage that fans out declares each run it fans out to as a `SubRun` (a proxy trial, a transfer
run, an ablation branch, the quality model) and runs it through `ctx.subruns()`: the runner's
contract one level down (its own key, manifest, MLflow child run, resume). Stage modules import
this module, never the runner.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kiln.tasks.configbase import Section
from kiln.tasks.ledger import StageRecorder, SubRuns
from kiln.tasks.store import Store

if TYPE_CHECKING:
    from kiln.tasks.settings import KilnConfig

Stats = dict[str, Any]
STATS_FILE = "stats.json"  # a committed stage's stats (headline included), beside its outputs


@dataclass(frozen=True)
class Stage:
    name: str
    description: str  # one line, shown by the CLI, in Prefect and in MLflow
    body: Callable[[StageContext], Stats]  # writes into ctx.out_dir, returns its stats
    inputs: tuple[str, ...] = ()  # stages whose outputs it reads
    config: type[Section] | None = None  # its own section of the config tree, named `config_name`
    # config sections (dotted, e.g. "train.run") its key hashes besides its own; runtime fields never count
    reads: tuple[str, ...] = ()
    external_files: Callable[[KilnConfig], Iterable[Path]] | None = None  # files from outside the store it reads
    version: int = 1  # bump when the output format or meaning changes: old outputs then stop matching
    resumable: bool = False  # a crashed attempt's partial folder is kept (training checkpoints)
    headline: Callable[[Stats], dict[str, Any]] = lambda stats: {}  # the few numbers a person looks at
    reports: tuple[str, ...] = ()  # markdown files in the output, published as Prefect artifacts
    in_pipeline: bool = True  # False: run on demand (`kiln stage NAME`), not by `kiln run`

    @property
    def config_name(self) -> str:
        """The config tree's key for this stage's section: the name, as a Python identifier."""
        return self.name.replace("-", "_")

    @property
    def config_field(self) -> str:
        """The attribute holding the section (`validate` would shadow pydantic's own method)."""
        name = self.config_name
        return f"{name}_" if hasattr(BaseModel, name) else name

    @property
    def sections(self) -> tuple[str, ...]:
        """Every config section its key hashes: its own first."""
        own = (self.config_name,) if self.config is not None else ()
        return own + self.reads


@dataclass
class StageContext:
    """Where a stage body writes, what it reads, and where it reports progress."""

    cfg: KilnConfig
    out_dir: Path
    inputs: dict[str, Path]  # input stage name -> its committed folder
    store: Store
    recorder: StageRecorder

    def read_json(self, stage: str, filename: str) -> Any:
        return json.loads((self.inputs[stage] / filename).read_text())

    @property
    def committed_dir(self) -> Path:
        """The folder `out_dir` (the partial folder) becomes once the stage commits: where a path the
        stage records (a job's log) lies for whoever reads the record."""
        return self.store.path(self.recorder.stage, self.recorder.key)

    def subruns(self, root: Path | None = None) -> SubRuns:
        """The stage's sub-runs, in its folder (or in `root`: the store, for one that several keys share)."""
        return self.recorder.subruns(root or self.out_dir)


@dataclass
class Registry:
    """The stages Kiln knows, in pipeline order (inputs before the stages that read them)."""

    stages: list[Stage] = field(default_factory=list)

    def __post_init__(self) -> None:
        stages, self.stages = self.stages, []
        for stage in stages:
            self.register(stage)

    def register(self, stage: Stage) -> None:
        if stage.name in self.names():
            raise ValueError(f"stage {stage.name!r} is registered twice")
        missing = [i for i in stage.inputs if i not in self.names()]
        if missing:
            raise ValueError(f"stage {stage.name!r} reads {missing}: register those stages before it")
        self.stages.append(stage)

    def unregister(self, name: str) -> None:
        self.stages = [s for s in self.stages if s.name != name]

    def __iter__(self) -> Iterator[Stage]:
        return iter(list(self.stages))

    def __getitem__(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"unknown stage {name!r}; stages are: {', '.join(self.names())}")

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def pipeline(self) -> tuple[str, ...]:
        """The stages `kiln run` runs, in order."""
        return tuple(s.name for s in self.stages if s.in_pipeline)
