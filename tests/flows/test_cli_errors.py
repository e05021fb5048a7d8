"""An unexpected error in a stage reaches the terminal once: one traceback, from the task run that raised it."""

import logging
import sys

from prefect.logging.handlers import PrefectConsoleHandler

import kiln.tasks.stages.collect
from kiln.flows.cli import main


def _prefect_console_to_this_tests_stderr(monkeypatch):
    """Prefect builds its console handlers once per process, on the stderr of whichever test ran first:
    point them at this test's captured stderr, as a terminal's would be."""
    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    for handler in {h for logger in loggers for h in getattr(logger, "handlers", [])}:
        if isinstance(handler, PrefectConsoleHandler):
            monkeypatch.setattr(handler, "stream", sys.stderr)
            monkeypatch.setattr(handler.console, "file", sys.stderr)


def test_an_unexpected_error_prints_one_traceback(prefect_api, in_repo, tmp_path, capfd, monkeypatch):
    def broken(cfg, out_dir, executor):
        raise TypeError("AbstractBufferedFile.readline() takes 1 positional argument but 2 were given")

    monkeypatch.setattr(kiln.tasks.stages.collect, "collect_documents", broken)
    _prefect_console_to_this_tests_stderr(monkeypatch)
    # retried once (an unexpected error may be infrastructure's), so two attempts fail with it
    code = main(["run", "configs/tiny.yaml", f"work_dir={tmp_path}", "orchestration.retries=1",
                 "orchestration.retry_delay_seconds=0", "--until", "collect"])
    assert code == 1
    err = capfd.readouterr().err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count("TypeError: AbstractBufferedFile.readline()") >= 3  # each echo still says what failed
    assert "kiln: failed: TypeError: AbstractBufferedFile.readline()" in err
