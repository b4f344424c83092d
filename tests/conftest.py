"""Shared fixtures."""

import os
import signal
import sys
from pathlib import Path

import pytest

# No process outlives the session: checked when it ends (tests/leak_check.py).
from tests.leak_check import (  # noqa: F401  (hooks)
    pytest_sessionfinish, pytest_sessionstart, pytest_testnodedown)

_DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)  # the trainer's pre-emption signals


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


def _process_state() -> dict:
    """What a test could leave switched on in this process for the tests after it: CPU mode's
    patches and function mode (megatron_boost/runtime/cpu_mode.py), any other torch function
    mode (e.g. a HostSyncCounter left entered), a patched ``torch.cuda.synchronize``, a process
    group, megatron's model-parallel groups, torchrun's variables in the environment (a
    later subprocess would try to join that world) and the pre-emption signal handlers. Modules not imported yet cannot hold any of it,
    so they are not imported here (a test of plain text stays cheap)."""
    state: dict = {"torch.distributed variables": {k: os.environ.get(k) for k in _DIST_ENV},
                   "signal handlers": [signal.getsignal(s) for s in _SIGNALS]}
    torch = sys.modules.get("torch")
    if torch is None:
        return state
    state["torch function modes"] = [type(m).__name__ for m in
                                     torch.overrides._get_current_function_mode_stack()]
    state["torch.cuda.synchronize"] = torch.cuda.synchronize
    state["torch.cuda.current_device"] = torch.cuda.current_device
    dist = torch.distributed
    state["process group"] = dist.is_available() and dist.is_initialized()
    cpu_mode = sys.modules.get("megatron_boost.runtime.cpu_mode")
    if cpu_mode is not None:
        state["cpu mode"] = cpu_mode.is_cpu_mode()
        state["cpu-mode patches"] = len(cpu_mode._STATE["patches"])
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None:
        state["megatron model-parallel groups"] = parallel_state.model_parallel_is_initialized()
    return state


def _reset_process_state() -> None:
    """Undo what a leaking test left on, so that one offender fails alone."""
    import torch.distributed as dist

    from megatron_boost.runtime.cpu_mode import restore_cuda
    from megatron_boost.train.distributed import shutdown

    restore_cuda()
    if dist.is_initialized():
        shutdown()


#: The state of a module first imported during a test, as it was before the import.
_DEFAULTS = {"cpu mode": False, "cpu-mode patches": 0, "megatron model-parallel groups": False}


@pytest.fixture(autouse=True)
def leaves_nothing_active(request):
    """Every test must leave the process as it found it: no CPU mode, no patch, no function
    mode, no process group. A test that leaves one fails here (and the state is reset, so the
    tests after it run in a clean process)."""
    before = _process_state()
    yield
    after = _process_state()
    # keys that appear only now (a module imported by the test) count from their default
    changed = {k: (before.get(k, _DEFAULTS.get(k)), v) for k, v in after.items()
               if v != before.get(k, _DEFAULTS.get(k, v))}
    if changed:
        _reset_process_state()
        pytest.fail(f"{request.node.nodeid} left process state changed (before, after): "
                    f"{changed}", pytrace=False)


# Two workers (scripts/test.sh runs ``pytest -n 2``, pytest-xdist): each takes whole files, so
# a file's module fixtures are built once, and the files below that share something take one
# group together.

#: Files that share one worker: the Slurm files start clusters on fixed ports (one per machine
#: at a time), and the conversion files share the session's trained checkpoints.
_WORKER_GROUPS = {"test_slurm": "slurm", "test_slurm_training": "slurm",
                  "test_convert": "checkpoints", "test_lm_eval": "checkpoints"}

#: The groups that take longest (pytest's slowest-tests list), handed out first so that the two
#: workers finish together; the rest follow in collection order. Only the balance depends on it.
_LONGEST_FIRST = ("slurm", "test_fault_tolerance", "checkpoints", "test_readme_walkthrough",
                  "test_training", "test_accounting", "test_lowrank_recompute",
                  "test_gpu_check", "test_rank_pool", "test_parallel", "test_bf16_training")


def worker_group(nodeid: str) -> str:
    """The unit a worker takes whole: the test's file, or its group in ``_WORKER_GROUPS``."""
    module = Path(nodeid.split("::", 1)[0]).stem
    return _WORKER_GROUPS.get(module, module)


def pytest_collection_modifyitems(config, items):
    """In an xdist worker (whose collection order is the order the groups are handed out),
    the longest groups first."""
    if not hasattr(config, "workerinput"):
        return
    first = {group: i for i, group in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(worker_group(item.nodeid), len(first)))  # stable


def pytest_xdist_make_scheduler(config, log):
    """xdist's ``loadfile``, with the groups of ``_WORKER_GROUPS`` and in collection order
    (its ``xdist_group`` marker does not group under pytest 9, and its ``loadscope`` orders
    the groups by their number of tests, not by their time)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)

    config.option.loadscopereorder = False
    return FileGroupScheduling(config, log)
