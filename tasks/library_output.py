"""What libraries print while Kiln calls them goes to the stage's log file, not the terminal.

lm-eval and `datasets` write a progress bar per task and request type ("Generating test split",
"Running loglikelihood requests") and log a line per task built: about 160 lines for one
evaluate stage of the tiny run, and as many for validate's capability checks and every
continuous-eval pass, between Kiln's own progress lines. `library_output_to(path)` sends, for the
duration of one call, this process's `sys.stdout` and `sys.stderr` (where tqdm and print write) and
the libraries' loggers to `path`, appended, so the stage keeps them for the record. An exception
leaves the block unchanged and is reported once, by whoever handles it, on the terminal.

Only Python-level writes are moved: other threads' loggers keep their own streams (Prefect's
console handler holds the terminal), and nothing here touches file descriptors.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

LIBRARY_LOG = "libraries.log"
# The loggers of the libraries Kiln's evaluations call (lm-eval logs under both names).
EVAL_LOGGERS = ("lm_eval", "lm-eval", "datasets", "huggingface_hub", "transformers", "evaluate")


@contextlib.contextmanager
def library_output_to(path: Path, loggers: Sequence[str] = EVAL_LOGGERS) -> Iterator[None]:
    """Within the block, stdout, stderr and `loggers` (INFO and above) write to `path` (appended)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        handler = logging.StreamHandler(log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        saved = []
        for name in loggers:
            # `datasets` gives its logger a handler of its own, on the stderr it saw at import: replaced too
            logger = logging.getLogger(name)
            saved.append((logger, logger.handlers, logger.propagate, logger.level))
            logger.handlers, logger.propagate = [handler], False
            logger.setLevel(logging.INFO)
        try:
            yield
        finally:
            for logger, handlers, propagate, level in saved:
                logger.handlers, logger.propagate = handlers, propagate
                logger.setLevel(level)
