"""How far a long stage is: a count, its rate and the time left, on one line.

`Progress` reports documents (clean), trials (sweep) or steps (training). On a terminal it keeps
one line up to date in place (at most every `TTY_EVERY_S`); anywhere else (a log file, a pipe, a
worker's captured output) it writes a plain line every `LOG_EVERY_S`, and always a last line when
the work ends, so a log shows the pace without a line per item.

One report at a time: a `Progress` started while another is running in the same process (a trial
trained inside the sweep's own loop) stays silent, and so does one in a worker process of a pool
(`multiprocessing` children: the sweep's trials): the process that runs the stage reports.
Work done in other processes is counted through files (`CountFiles`): each worker writes its
running count to a file of its own and the stage's process adds them up.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

TTY_EVERY_S = 0.5
LOG_EVERY_S = 30.0
_ACTIVE: list[Progress] = []  # the reporting Progress of this process, if any


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Reports `done` of `total` `unit` (total None: unknown) for `what`, with rate and ETA."""

    def __init__(self, what: str, total: int | None, unit: str, *, done: int = 0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.what, self.total, self.unit, self.done = what, total, unit, done
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.silent = bool(_ACTIVE) or multiprocessing.parent_process() is not None
        self.started, self.start_done = clock(), done
        self.last_shown = self.started
        self.note = ""
        self.closed = False
        if not self.silent:
            _ACTIVE.append(self)

    def update(self, done: int, note: str = "") -> None:
        """`done` items so far (absolute: a count read from elsewhere); `note` is shown after it (a loss)."""
        self.done, self.note = done, note or self.note
        if self.silent or self.closed:
            return
        now = self.clock()
        if now - self.last_shown >= (TTY_EVERY_S if self.tty else LOG_EVERY_S):
            self.last_shown = now
            self._show()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.update(self.done + n, note)

    def line(self) -> str:
        elapsed = self.clock() - self.started
        rate = (self.done - self.start_done) / elapsed if elapsed > 0 else 0.0
        count = f"{self.done:,}/{self.total:,}" if self.total is not None else f"{self.done:,}"
        parts = [f"{self.what}: {count} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.done / self.total:.0f}%)"
        parts.append(f"{rate:.3g}/s" if rate < 1000 else f"{rate:,.0f}/s")
        if self.closed:
            parts.append(f"in {_duration(elapsed)}")
        elif self.total is not None and rate > 0:
            parts.append(f"ETA {_duration(max(self.total - self.done, 0) / rate)}")
        return ", ".join(parts) + (f", {self.note}" if self.note else "")

    def _show(self) -> None:
        if self.tty:
            self.stream.write(f"\r{self.line()}\x1b[K")
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        """The last report: the count, the rate and how long it took (a terminal's line is kept)."""
        if self.closed:
            return
        self.closed = True
        if self.silent:
            return
        _ACTIVE.remove(self)
        self._show()
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CountFiles:
    """Counts that worker processes write, one file each, into `folder` (which every worker can reach)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def write(self, worker: str, count: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".{worker}.tmp"
        tmp.write_text(str(count))
        os.replace(tmp, self.folder / worker)  # atomic: a reader never sees half a number

    def total(self) -> int:
        if not self.folder.is_dir():
            return 0
        return sum(int(path.read_text() or 0) for path in self.folder.iterdir() if not path.name.startswith("."))


@contextmanager
def watching(counts: CountFiles, progress: Progress, every_s: float = TTY_EVERY_S) -> Iterator[None]:
    """While the block runs (other processes doing the work), `progress` follows `counts`' total."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(every_s):
            progress.update(counts.total())

    thread = threading.Thread(target=poll, name="kiln-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        progress.update(counts.total())
