#!/usr/bin/env python
"""Pretrain a low-rank bottleneck LLM with megatron-core + BOOST (torchrun / srun entry point).

    torchrun --nproc_per_node=2 pretrain_lowrank.py --config configs/debug.yaml parallel.tp=2
    python pretrain_lowrank.py --config configs/debug.yaml          # one process

The command line lives in ``megatron_boost/cli/pretrain.py``, the loop in
``megatron_boost/train/trainer.py``. The ``__main__`` guard is required: dist_checkpointing
starts a spawn-method multiprocessing helper that re-imports this file, so nothing heavy may
run at import time (docs/design.md §10.4). Importing the package is light and makes such a
helper die with its rank, even after a SIGKILL (megatron_boost/runtime/lifetime.py).
"""

import megatron_boost  # noqa: F401

if __name__ == "__main__":
    # megatron's known import notices are filtered by megatron_boost.cli (compat.py)
    from megatron_boost.cli.pretrain import main

    raise SystemExit(main())
