#!/usr/bin/env python
"""The trainer with the fault-tolerance tests' faults: ``pretrain_lowrank.py``'s ``main`` called
with the callbacks ``megatron_boost/testing/faults.py`` builds from its environment variables.

    MEGATRON_BOOST_TEST_NAN_AT=3:1 torchrun --nproc_per_node=2 tests/fault_entry.py --config ...
    scripts/run_local.sh 2 configs/debug.yaml --entry tests/fault_entry.py parallel.tp=2

It lives here, not in ``megatron_boost/testing/``, because it calls the entry point (``cli/``), a
room above ``testing/`` (tests/test_import_graph.py). As in ``pretrain_lowrank.py``, nothing heavy
runs at import time (dist_checkpointing's spawned helper re-imports this file), and importing the
package makes such a helper die with its rank.
"""

import megatron_boost  # noqa: F401
from pathlib import Path

#: This script, for torchrun and the launcher's ``--entry``.
PATH = str(Path(__file__).resolve())
#: Its ``main`` as the tests' rank pool names it (tests/rank_pool.py).
TARGET = "tests.fault_entry:main"


def main(argv=None) -> int:
    from megatron_boost.cli.pretrain import main as pretrain_main
    from megatron_boost.testing.faults import callbacks_from_env

    return pretrain_main(argv, callbacks=callbacks_from_env())


if __name__ == "__main__":
    raise SystemExit(main())
