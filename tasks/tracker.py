"""What the stage runner records through: the `Tracker` protocol, and a no-op one.

`tasks.tracking.MlflowTracker` is the real implementation (MLflow stays in that one module);
`NullTracker` serves notebooks, tests and jobs that want the store's manifest and commit
without an experiment database.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def start_run(self, name: str, *, parent_id: str | None = None, tags: Mapping[str, Any] | None = None,
                  params: Mapping[str, Any] | None = None) -> str: ...

    def end_run(self, run_id: str, *, failed: bool = False) -> None: ...

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None: ...

    def running_runs(self) -> list[tuple[str, dict[str, str]]]: ...

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None: ...

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None: ...

    def log_input(self, run_id: str, name: str, digest: str, uri: Path, context: str = "input") -> None: ...

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None: ...

    def log_dict(self, run_id: str, data: dict[str, Any], artifact_file: str) -> None: ...


class NullTracker:
    """Records nothing; run ids are fresh random strings so manifests stay well-formed."""

    def start_run(self, name: str, *, parent_id: str | None = None, tags: Mapping[str, Any] | None = None,
                  params: Mapping[str, Any] | None = None) -> str:
        return f"untracked-{uuid.uuid4().hex[:12]}"

    def end_run(self, run_id: str, *, failed: bool = False) -> None:
        pass

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        pass

    def running_runs(self) -> list[tuple[str, dict[str, str]]]:
        return []

    def set_tags(self, run_id: str, tags: Mapping[str, Any]) -> None:
        pass

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int | None = None) -> None:
        pass

    def log_input(self, run_id: str, name: str, digest: str, uri: Path, context: str = "input") -> None:
        pass

    def log_artifact(self, run_id: str, path: Path, artifact_path: str | None = None) -> None:
        pass

    def log_dict(self, run_id: str, data: dict[str, Any], artifact_file: str) -> None:
        pass
