"""A real two-node Slurm cluster (two slurmd on this host) for the Slurm launcher and training tests."""

import os

import pytest


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory):
    """Nodes kiln-n1 and kiln-n2 with 2 CPUs each, one module long; clients reach it through SLURM_CONF
    (set here, then restored, so that the session's single-node `slurm_cluster` is found again).

    It fails (never skips) when Slurm is missing: `make setup` installs it."""
    from tasks.launch.local_slurm import LocalSlurmCluster

    cluster = LocalSlurmCluster(tmp_path_factory.mktemp("slurm2"), cpus=2, nodes=2).start()
    previous = os.environ.get("SLURM_CONF")
    os.environ.update(cluster.env)
    yield cluster
    cluster.stop()
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous
