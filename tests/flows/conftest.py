"""A real, temporary Prefect API (SQLite) for every flow test in this folder, and real `kiln up` servers
for the tests that need an operator's servers."""

import os
from pathlib import Path

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


@pytest.fixture
def kiln_servers(tmp_path) -> Path:
    """`kiln up` (SQLite, free ports) in tmp_path/servers-home, run from the repository root with its own
    list of running servers (XDG_STATE_HOME); yields the servers' work dir; `kiln down` afterwards."""
    from kiln.flows.cli import main
    from tests.flows.test_operate import free_port

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        patch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
        home = tmp_path / "servers-home"
        assert main(["up", f"work_dir={home}", "--prefect-port", str(free_port()),
                     "--mlflow-port", str(free_port())]) == 0
        try:
            yield home
        finally:
            main(["down", f"work_dir={home}"])
