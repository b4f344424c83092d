"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def slurm_pool():
    """One private Slurm cluster at a time (its ports are fixed), reused across test files."""
    from tests.slurm_cluster import SlurmClusterPool

    pool = SlurmClusterPool()
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture
def slurm_cluster_of(slurm_pool):
    """``slurm_cluster_of(nodes)``: a running cluster of that many nodes, or a skip with the
    reason when this machine cannot run one."""
    from tests.slurm_cluster import slurm_available

    def get(nodes: int):
        ok, why = slurm_available(nodes)
        if not ok:
            pytest.skip(why)
        return slurm_pool.get(nodes)

    return get
