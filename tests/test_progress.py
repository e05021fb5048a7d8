"""The progress line of long stages: in place on a terminal, periodic plain lines in a log."""

from __future__ import annotations

import io
import multiprocessing
import threading

import pytest

import kiln.tasks.progress
from kiln.tasks.progress import CountFiles, Progress, watching


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_line_updated_in_place_with_rate_and_eta():
    clock, out = Clock(), Terminal()
    progress = Progress("clean", 1000, "documents", stream=out, clock=clock)
    clock.now += 0.1
    progress.update(10)
    assert out.getvalue() == ""  # at most every TTY_EVERY_S
    clock.now += 1.9
    progress.update(200)
    assert out.getvalue() == "\rclean: 200/1,000 documents (20%), 100/s, ETA 8s\x1b[K"
    clock.now += 2.0
    progress.update(400, "loss 4.2")
    clock.now += 6.0
    progress.close()
    lines = out.getvalue().split("\r")[1:]
    assert lines[1] == "clean: 400/1,000 documents (40%), 100/s, ETA 6s, loss 4.2\x1b[K"
    assert lines[2] == "clean: 400/1,000 documents (40%), 40/s, in 10s, loss 4.2\x1b[K\n"  # the last line stays


def test_a_log_gets_a_plain_line_every_interval_and_a_last_one(monkeypatch):
    monkeypatch.setattr(kiln.tasks.progress, "LOG_EVERY_S", 30.0)
    clock, out = Clock(), io.StringIO()
    with Progress("sweep", 12, "trials", done=2, stream=out, clock=clock) as progress:
        for _ in range(10):
            clock.now += 10
            progress.advance()
    assert out.getvalue().splitlines() == [
        "sweep: 5/12 trials (42%), 0.1/s, ETA 1m10s",
        "sweep: 8/12 trials (67%), 0.1/s, ETA 40s",
        "sweep: 11/12 trials (92%), 0.1/s, ETA 10s",
        "sweep: 12/12 trials (100%), 0.1/s, in 1m40s",  # resumed trials do not count in the rate
    ]


def test_one_report_at_a_time_and_none_from_pool_workers():
    outer_out, inner_out = io.StringIO(), io.StringIO()
    with Progress("sweep", 3, "trials", stream=outer_out):
        with Progress("train", 30, "steps", stream=inner_out) as inner:  # a trial trained in the sweep's loop
            inner.update(30)
        assert inner.silent and inner_out.getvalue() == ""
    assert outer_out.getvalue().startswith("sweep: 0/3 trials")
    with Progress("next", 1, "steps", stream=io.StringIO()) as after:
        assert not after.silent  # the outer one has ended
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_silent_in_worker) is True


def _silent_in_worker() -> bool:
    return Progress("train", 10, "steps", stream=io.StringIO()).silent


def test_counts_written_by_other_workers_are_followed(tmp_path):
    counts, out = CountFiles(tmp_path / "progress"), io.StringIO()
    progress = Progress("clean", 300, "documents", stream=out)
    release = threading.Event()

    def worker(rank: int) -> None:
        for n in (50, 100):
            counts.write(f"{rank:05d}", n)
        release.wait(5)
        counts.write(f"{rank:05d}", 150)

    with progress, watching(counts, progress, every_s=0.01):
        threads = [threading.Thread(target=worker, args=(rank,)) for rank in (0, 1)]
        for thread in threads:
            thread.start()
        release.set()
        for thread in threads:
            thread.join()
    assert progress.done == 300 and out.getvalue().startswith("clean: 300/300 documents (100%)")


@pytest.mark.parametrize(("seconds", "shown"), [(59.4, "59s"), (61, "1m01s"), (3 * 3600 + 120, "3h02m")])
def test_durations(seconds, shown):
    assert kiln.tasks.progress._duration(seconds) == shown
