"""Test-wide settings that must precede the first torch import, the engine fixtures (a test that uses
one is marked `cluster`), and the report of a test that ran past its time limit (tests/timeouts.py)."""

import os

# Spinning OpenMP workers make torch ~10x slower on a shared 2-core machine (see flows/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The fingerprint cache (tasks/fingerprint.py) of this test session: never the user's ~/.cache/kiln.
os.environ.setdefault("KILN_CACHE_DIR", __import__("tempfile").mkdtemp(prefix="kiln-test-cache-"))


from contextlib import contextmanager  # noqa: E402

import pytest  # noqa: E402

# Fixtures that start a real engine: a test that uses one, directly or through another fixture, is a
# `cluster` test whatever its own markers say, so that `make test-fast` never starts one.
ENGINE_FIXTURES = frozenset({"slurm_cluster", "slurm_two_nodes", "ray_cluster", "prefect_api"})


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.import_plugin("tests.timeouts")  # a timed-out test shows what it waited for


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if ENGINE_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.cluster)


@contextmanager
def running_slurm(folder, **kwargs):
    """A real local Slurm cluster, its SLURM_CONF set for this process's clients and restored after.

    It fails (never skips) when Slurm is missing: `make setup` installs it."""
    from kiln.tasks.launch.local_slurm import LocalSlurmCluster

    cluster = LocalSlurmCluster(folder, **kwargs).start()
    previous = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    try:
        yield cluster
    finally:
        cluster.stop()
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real single-node Slurm cluster for the session."""
    with running_slurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster (2 CPUs) for the session, started in this process: Kiln's Ray executor
    joins whatever `ray.init` this process holds. `address="local"` starts a fresh one even where
    RAY_ADDRESS points elsewhere. It fails (never skips) when Ray is missing: `make setup` installs it."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()
