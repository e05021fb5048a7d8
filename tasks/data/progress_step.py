"""A datatrove step that lets the stage's process follow its ranks: each rank's running document count.

datatrove's ranks run in other processes (local workers, Slurm jobs, Ray actors), so the count
travels through files in the stage's folder (`tasks.progress.CountFiles`), written at most every
`every_s` and once at the end of the rank; the stage's process adds them up for its progress line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from datatrove.data import Document
from datatrove.pipeline.base import PipelineStep

from kiln.tasks.progress import CountFiles


class CountDocuments(PipelineStep):
    """Passes every document on, unchanged, counting them into `folder/<rank>`."""

    name = "progress"
    type = "kiln"

    def __init__(self, folder: str, every_s: float = 1.0) -> None:
        super().__init__()
        self.folder, self.every_s = folder, every_s

    def run(self, data: Iterator[Document], rank: int = 0, world_size: int = 1) -> Iterator[Document]:
        counts, worker = CountFiles(Path(self.folder)), f"{rank:05d}"
        count, last = 0, time.monotonic()
        for doc in data:
            count += 1
            if time.monotonic() - last >= self.every_s:
                counts.write(worker, count)
                last = time.monotonic()
            yield doc
        counts.write(worker, count)
