"""A pytest plugin: a test that pytest-timeout stops shows what it was waiting for.

pytest-timeout (its limit in pyproject.toml, longer ones on the tests that need them) fails a test
that runs too long, printing every other thread's stack; the main thread's traceback then says
which wait hung, but not on which job, port, URL or file. For those failures only, the report is
drawn with each frame's local variables (pytest's --showlocals), so the hung wait's job id, port or
path is in the report. tests/conftest.py loads it; tests/test_timeouts.py checks it.
"""

from __future__ import annotations

import pytest

FROM_PYTEST_TIMEOUT = "from pytest-timeout"  # how pytest-timeout's failure message ends


def timed_out(excinfo: pytest.ExceptionInfo | None) -> bool:
    return (excinfo is not None and excinfo.errisinstance(pytest.fail.Exception)
            and FROM_PYTEST_TIMEOUT in str(excinfo.value))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if timed_out(call.excinfo):
        option = item.config.option
        showing = option.showlocals
        option.showlocals = True
        try:
            report.longrepr = item.repr_failure(call.excinfo)
        finally:
            option.showlocals = showing
    return report
