"""datatrove's log lines go to the stage's log file, not the terminal.

datatrove logs through loguru: each rank's `add_task_logger` writes every line to
`logging_dir/logs/task_NNNNN.log` *and* INFO and above to stderr, so a default `kiln run` printed
every rank's pipeline listing and per-step statistics between Kiln's own progress lines.
Importing this module (the clean stage's modules do, so every executor's worker process does before
it runs a rank) keeps datatrove's task log files exactly as they are and lets only errors reach
stderr, in the workers and in this process. `collect_task_logs` then joins the ranks' files into
the stage's `datatrove.log`, which the stage logs to MLflow.

datatrove 0.10 has no setting for this; the three executor modules bind `add_task_logger` by name,
so each binding is replaced. The replacements are datatrove's own functions with one sink changed.

Every sink loguru adds builds an exception formatter that asks `sysconfig` for some forty install
paths (about 10 ms); datatrove adds three sinks a rank, so a small job spent more on that than on
its shard. The paths are computed once per process instead (`_cache_loguru_lib_dirs`).
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path

from datatrove.utils import logging as dt_logging
from loguru import _better_exceptions, logger

LOG_FILE = "datatrove.log"
TERMINAL_LEVEL = "ERROR"  # a failing rank still says so on the terminal
_EXECUTOR_MODULES = ("datatrove.executor.base", "datatrove.executor.jobs", "datatrove.executor.ray")


def add_task_logger(logging_dir, rank: int, local_rank: int = 0, node_rank: int = -1):
    """datatrove's `add_task_logger`, with the terminal sink at ERROR instead of INFO."""
    logger.remove()
    logfile = logging_dir.open(f"logs/task_{rank:05d}.log", "w")
    prefix = f"[NODE {node_rank}] " if node_rank != -1 else ""
    fmt = f"{prefix}{{time:YYYY-MM-DD HH:mm:ss.SSS}} | <level>{{level: <8}}</level> | {{name}}:{{function}}:{{line}} - <level>{{message}}</level>"
    logger.add(sys.stderr, colorize=dt_logging.DATATROVE_COLORIZE_LOGS, level=TERMINAL_LEVEL, format=fmt)
    logger.add(logfile, colorize=dt_logging.DATATROVE_COLORIZE_LOG_FILES, level="DEBUG", format=fmt)
    logger.info(f"Launching pipeline for {rank=}")
    return logfile


def setup_default_logger() -> None:
    """datatrove's process-wide sink (used between ranks and by the executor itself), errors only."""
    logger.remove()
    logger.add(sys.stderr, colorize=dt_logging.DATATROVE_COLORIZE_LOGS, level=TERMINAL_LEVEL)


def _cache_loguru_lib_dirs() -> None:
    """loguru's `ExceptionFormatter._get_lib_dirs` (a private static method: which folders hold libraries,
    for its tracebacks), computed once per process; `tests/tasks/data/test_inspection.py` fails on a loguru
    that no longer has it."""
    formatter = _better_exceptions.ExceptionFormatter
    lib_dirs = getattr(formatter, "_get_lib_dirs", None)
    if lib_dirs is not None and not hasattr(lib_dirs, "cache_info"):
        formatter._get_lib_dirs = staticmethod(functools.cache(lib_dirs))


def _install() -> None:
    _cache_loguru_lib_dirs()
    dt_logging.add_task_logger = add_task_logger
    dt_logging.setup_default_logger = setup_default_logger  # close_task_logger calls it by this name
    for name in _EXECUTOR_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an executor whose optional dependency is missing is never used
            continue
        if hasattr(module, "add_task_logger"):
            module.add_task_logger = add_task_logger
    setup_default_logger()


def collect_task_logs(logging_dir: Path, target: Path) -> Path:
    """Every rank's log file under `logging_dir` (datatrove's logs/task_*.log), in rank order, as one file."""
    with open(target, "w", encoding="utf-8") as out:
        for path in sorted((logging_dir / "logs").glob("task_*.log")):
            out.write(f"===== {path.name} =====\n")
            out.write(path.read_text(encoding="utf-8", errors="replace"))
    return target


_install()
