"""A real, temporary Prefect API (SQLite) for every flow test in this folder."""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def prefect_api():
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def in_repo(monkeypatch):
    """Run from the repository root: configs and data paths are relative to it."""
    monkeypatch.chdir(REPO)
    return REPO
