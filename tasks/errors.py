"""Errors a user can act on, and whether running the same work again can help.

The CLI prints a `KilnError` without a traceback. Raise `ConfigError` for a bad setting and
`InputError` for bad or missing input data; the message must name the file, line or key at fault
and say how to fix it. Raise `InfrastructureError` (or a subclass) when the work broke for a reason
outside the config and the data: a lost node, a preempted or timed-out job, a rank that died. Its
`retryable` is true, so the orchestrator retries the stage (or the sub-run), which resumes from its
partial state; every other `KilnError` stops at once, since a retry would fail the same way.
"""

from __future__ import annotations

from typing import Any


class KilnError(Exception):
    """A user-facing error whose message alone tells the user what to do."""

    # Whether running the same work again, unchanged, can succeed. A class default that an instance may
    # override (`error.retryable = False` for a scheduler's refusal raised as a launch failure).
    retryable: bool = False


class ConfigError(KilnError):
    """A config file, key or override is wrong."""


class InputError(KilnError):
    """An input path or file cannot be used as configured."""


class InfrastructureError(KilnError):
    """The machines broke, not the config or the data: a retry, resuming from the partial state, can succeed."""

    retryable = True


class TrainingDivergedError(RuntimeError):
    """The loss stayed bad after `max_rollbacks` rollbacks; `events` holds the whole history. Not a user
    error (the config may be fine: a sweep records it as a diverged trial), but a retry diverges again:
    same seed, same data."""

    def __init__(self, message: str, events: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.events = events


def is_retryable(error: BaseException) -> bool:
    """Whether an orchestrator should retry work that raised `error`: Kiln's infrastructure errors and
    unexpected exceptions (a bug or a fault Kiln did not foresee) yes, every other `KilnError` and a
    diverged training no."""
    if isinstance(error, TrainingDivergedError):
        return False
    if isinstance(error, KilnError):
        return error.retryable
    return isinstance(error, Exception)
