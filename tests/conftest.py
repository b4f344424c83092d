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


@pytest.fixture(scope="session")
def tokenizer_model(tmp_path_factory):
    """A SentencePiece tokenizer of 400 ids trained on the README."""
    from tests.convert_fixtures import train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory, tokenizer_model):
    """checkpoint(name) -> the checkpoints folder of a trainer run in layout ``name`` of
    ``convert_fixtures.LAYOUTS`` (trained once per session, shared by the test files)."""
    from tests.convert_fixtures import FROZEN_TRAINING, LAYOUTS, train

    made = {}

    def get(name):
        if name not in made:
            nproc, overrides = LAYOUTS[name]
            run = tmp_path_factory.mktemp(name)
            train(nproc, [*overrides, *FROZEN_TRAINING,
                          f"data.tokenizer_model={tokenizer_model}"], run)
            made[name] = str(run / "checkpoints")
        return made[name]

    return get
