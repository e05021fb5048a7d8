"""A real two-node Slurm cluster (two slurmd on this host) for the Slurm launcher and training tests."""

import pytest

from tests.conftest import running_slurm


@pytest.fixture(scope="module")
def slurm_two_nodes(tmp_path_factory):
    """Nodes kiln-n1 and kiln-n2 with 2 CPUs each, one module long (SLURM_CONF restored after, so that
    the session's single-node `slurm_cluster` is found again)."""
    with running_slurm(tmp_path_factory.mktemp("slurm2"), cpus=2, nodes=2) as cluster:
        yield cluster
